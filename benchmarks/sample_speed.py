"""`fluxzero sample` against diffusers' FluxPipeline on the same transformer; `--ema`: the trainer's EMA update.

    PYTHONPATH=. python3 benchmarks/sample_speed.py --out $OUT/sample_speed.jsonl          # GPU: flux-dev
    PYTHONPATH=. python3 benchmarks/sample_speed.py --ema --out $OUT/ema_update.jsonl      # GPU: flux-dev EMA
    PYTHONPATH=. python3 benchmarks/sample_speed.py --device cpu --size 32 --steps 2 --runs 1 --t5-tokens 8 \
        --tiny-vae --rows fluxzero,diffusers,fluxzero-batch4 --out /tmp/sample_speed.jsonl   # CPU smoke test
    PYTHONPATH=. python3 benchmarks/sample_speed.py --rows fluxzero-fast,diffusers,fluxzero-cudnn --profile \
        --out $OUT/sample_speed.jsonl                                                      # GPU: the speed options

Sampling. One transformer, built by fluxzero's model builder (random init, seed 0; bf16 on the GPU, fp32 on the
CPU), and diffusers' FluxTransformer2DModel holding the same weights (fluxzero.model.layouts.bfl_to_diffusers);
one VAE (diffusers AutoencoderKL with FLUX.1's shapes, random init); random T5 (images x 512 x 4096) and CLIP
pooled (images x 768) embeddings; seed 0 for every image. Rows, in the order they run:
  fluxzero            the loop `fluxzero sample` runs (fluxzero.sampling.pipeline.sample_images, called as
                      fluxzero/commands/sample.py calls it) at the command's defaults: --batch-size and
                      --compile chosen as the command chooses them (auto_speed: on a GPU 4 images a call,
                      eager, for 4 images of 28 steps at 1024 px), attention "any" (torch's choice: cuDNN's
                      kernel on Hopper), PNGs and grid.png written to a temporary folder.
  fluxzero-batch1     the same at --batch-size 1 --no-compile (the "fluxzero" row before 2026-12-05 (close)).
  diffusers           FluxPipeline(FLUX.1-dev's scheduler config, vae, transformer, no text encoders) called
                      with prompt_embeds / pooled_prompt_embeds, guidance_scale 3.5, output_type "pil", as a
                      diffusers user runs it (eager), each image then saved as a PNG.
  fluxzero-batch4     the command with --batch-size 4 (all images in one model call).
  fluxzero-compile    the command with --compile: every block compiled by the trainer's helper
                      (fluxzero.sampling.pipeline.prepare_model, as the command calls it); the warm-up compiles.
  fluxzero-cudnn      the command with --attention cudnn (on the CPU, which has no cuDNN attention: math).
  fluxzero-flash      the command with --attention auto (flash first: the trainer's, and the command's default
                      before 2026-12-04).
  fluxzero-fast       --compile --attention cudnn --batch-size 4 --no-grid: every speed option at once.
  diffusers           ... (above); diffusers-cudnn: the same call inside sdpa_kernel([cuDNN, flash, efficient,
                      math], set_priority=True), so its transformer takes cuDNN attention; the VAE's head dim
                      512 has no cuDNN kernel and falls back as it would (its pipeline stays eager unless
                      diffusers-compiled ran before it: the row records "compiled").
  diffusers-compiled  the pipeline after transformer.compile_repeated_blocks(fullgraph=True) (diffusers'
                      regional compile of its two block classes), for reference.
Every fluxzero row starts from the eager "auto" model: after a row its blocks lose their compiled forwards and
Dynamo's caches are reset, so each compiled row pays its compile in its warm-up, as a fresh `fluxzero sample
--compile` does.
Both sides decode with the VAE and write PNG files inside the timed region. Each row: --warmup calls with
--warmup-steps (the same shapes, so compilation and allocator growth happen there), then --runs timed calls
of --steps, torch.cuda.synchronize() around each; the row's figure is the median. A CUDA event recorded in
each side's per-step callback (the command's progress-bar hook, the pipeline's callback_on_step_end; no host
sync) gives the time of one denoising step (median within a batch), so a row also says how much of a call is
the transformer loop (step_s x steps x calls) and how much is the rest (noise, decode, PNG files).
Same work: both start from the same noise (the sampler draws what FluxPipeline.prepare_latents draws for the
same seeds) on the same time grid, so the images must agree. Each row's images are compared with the first
row's: relative L2 difference of the pixels and the mean absolute difference in levels (0-255); `other_prompt`
is the difference between two images of one row that share the noise but not the prompt, the size of a real
difference. Tolerance: fp32 (CPU) within 1 level (measured: identical); bf16 at most half of other_prompt (the
same prompt and noise give closer images than another prompt does). bf16 cannot be tighter: the sampler feeds
float32 timesteps where diffusers rounds them to bf16 (docs/sampling.md), and 28 steps of a random-weight model
carry such differences into the pixels (flux-tiny in bf16 on the CPU: 0.3-0.45 of other_prompt).

EMA (--ema). The trainer's own EMA (fluxzero.train.ema.ShardedEMA, built by fluxzero.train.loop.setup from a
run file with `ema: {}`, i.e. its defaults) on the engine of a full fine-tune as `fluxzero gen-config --fit
--gpu h200 --world-size 1` writes it. Times run.ema.update(step), the trainer's call after every optimizer step,
for --ema-updates consecutive steps (2 untimed first), median; reports where the EMA lives (device, dtype, bytes)
and the update's share of a full fine-tune step of --step-s seconds (given, not measured here: a step of that
run needs the GPU memory the EMA takes). The masters do not change between the timed updates (no optimizer
step is taken); the update's work does not depend on their values.

FLOPs (forward, per image and step): ModelConfig.flops_per_sample(image tokens, T5 tokens), derived in
fluxzero/config/models.py; 1024 x 1024 px = 4096 image tokens. TFLOP/s = that x images x steps / loop time.

--profile: after a row's timed calls, one more call of 2 steps under torch.profiler, recording only the second
denoising step (the device synchronized at both ends, so the window holds that step's kernels and nothing else):
CUDA kernel time by kind (attention: flash/fmha/sdpa/cuDNN SDPA kernels; matmul: gemm/cutlass/sm90/nvjet;
other: pointwise, norms, copies, Triton fusions) and host gaps = the step's wall time minus the kernel time
(the GPU idle, waiting for the host). On the CPU (the smoke test) operator self time stands in for kernel
time. Into the row's JSON ("profile") and a table in <--out stem>_profile.txt beside --out.

Output: one JSON line per row to --out (date, device, versions, command), a table printed last. Time limits
inside: --run-timeout-s per call (a watchdog writes a timeout row and ends the process), --budget-s for the
whole script (a row whose estimated time does not fit is written as "not run (budget)"; the estimate: the slowest
row so far times the calls, plus COMPILE_ALLOWANCE_S for a compiling row and the profiled call with --profile).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # provenance, runner, cache_speed; also when loaded by path
import provenance  # noqa: E402 - needs the lines above
import runner  # noqa: E402

# fluxzero rows: the command's options (--batch-size, --compile, --attention, --grid) for each
FLUXZERO_ROWS = {
    # None: chosen as the command chooses them (fluxzero.sampling.pipeline.auto_speed), see row_options
    "fluxzero": dict(batch_size=None, compile=None, attention="any", grid=True),
    "fluxzero-batch1": dict(batch_size=1, compile=False, attention="any", grid=True),
    "fluxzero-batch4": dict(batch_size=4, compile=False, attention="any", grid=True),
    "fluxzero-compile": dict(batch_size=1, compile=True, attention="any", grid=True),
    "fluxzero-cudnn": dict(batch_size=1, compile=False, attention="cudnn", grid=True),
    "fluxzero-flash": dict(batch_size=1, compile=False, attention="auto", grid=True),
    "fluxzero-fast": dict(batch_size=4, compile=True, attention="cudnn", grid=False),
}
ROWS = (*FLUXZERO_ROWS, "diffusers", "diffusers-cudnn", "diffusers-compiled")
COMPILING_ROWS = ("fluxzero-compile", "fluxzero-fast", "diffusers-compiled")
GUIDANCE, SEED = 3.5, 0
COMPILE_ALLOWANCE_S = 90.0  # budget estimate for a compiling row's first call (measured ~12 s on an H200, 2026-12-04)
PROFILE_STEPS = 2  # the profiled call: step 1 warms the profiler up, step 2 is recorded
GIB = 2**30


def scheduler():
    """FLUX.1-dev's released scheduler_config.json."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def build(model_name: str, device: torch.device, dtype: torch.dtype, tiny_vae: bool = False):
    """(fluxzero model, diffusers transformer with the same weights, VAE), eval mode, on `device` in `dtype`."""
    from cache_speed import build_vae
    from diffusers import FluxTransformer2DModel

    from fluxzero.model import build_model
    from fluxzero.model.layouts import bfl_to_diffusers
    from fluxzero.model.weights import diffusers_config

    torch.manual_seed(SEED)
    ours = build_model(model_name, device=device, dtype=dtype).eval()
    config = {k: v for k, v in diffusers_config(ours.config, Path(model_name)).items() if k != "_class_name"}
    with torch.device("meta"):  # no second random init: the weights are ours, converted
        theirs = FluxTransformer2DModel(**config)
    theirs.load_state_dict(bfl_to_diffusers(ours.state_dict()), strict=True, assign=True)
    vae = build_vae(tiny=tiny_vae, device=device, dtype=dtype)
    return ours, theirs.eval(), vae


def embeddings(images: int, cfg, t5_tokens: int):
    """Random prompt embeddings in fluxzero's file form (what `fluxzero sample --embeddings` loads)."""
    from fluxzero.sampling.embeddings import PromptEmbeddings

    g = torch.Generator().manual_seed(SEED + 1)
    return PromptEmbeddings(
        [f"prompt {i}" for i in range(images)],
        torch.randn(images, t5_tokens, cfg.context_in_dim, generator=g),
        torch.randn(images, cfg.vec_in_dim, generator=g),
    )


class StepClock:
    """End-of-step marks: CUDA events on the GPU (recorded, no sync), perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def step_s(self, per_call: int) -> float:
        """Median time between consecutive marks of the same call (`per_call` marks per call)."""
        gaps = []
        for a in range(0, len(self.marks) - 1):
            if (a + 1) % per_call:  # a and a + 1 are in the same call
                x, y = self.marks[a], self.marks[a + 1]
                gaps.append(x.elapsed_time(y) / 1e3 if self.cuda else y - x)
        return statistics.median(gaps) if gaps else float("nan")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ----- the two sides: one call each, returning the paths of the PNGs it wrote ----------------------------------
def fluxzero_call(
    model, vae, emb, out_dir: Path, *, size: int, steps: int, batch_size: int, clock: StepClock, grid: bool = True
):
    """The command's loop (commands/sample.py -> sampling.pipeline.sample_images), PNGs included."""
    from fluxzero.sampling.pipeline import sample_images

    def run():
        return sample_images(
            model,
            vae,
            emb,
            out_dir,
            width=size,
            height=size,
            steps=steps,
            seeds=[SEED],
            guidance=GUIDANCE,
            batch_size=batch_size,
            weights="random init",
            on_step=clock.mark,
            write_grid=grid,
        )

    return run


def diffusers_call(
    pipe, emb, out_dir: Path, *, size: int, steps: int, device, dtype, clock: StepClock, cudnn: bool = False
):
    """FluxPipeline as a diffusers user calls it with precomputed embeddings, then each image saved as a PNG;
    `cudnn`: inside sdpa_kernel with cuDNN attention first (the others after it, for what cuDNN cannot run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    txt, y = emb.t5.to(device, dtype), emb.clip_pooled.to(device, dtype)
    n = txt.shape[0]

    def on_step(_pipe, _i, _t, _kwargs):
        clock.mark()
        return {}

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    def run():
        with sdpa_kernel(order, set_priority=True) if cudnn else contextlib.nullcontext():
            images = pipe(
                prompt_embeds=txt,
                pooled_prompt_embeds=y,
                height=size,
                width=size,
                num_inference_steps=steps,
                guidance_scale=GUIDANCE,
                generator=[torch.Generator().manual_seed(SEED) for _ in range(n)],
                output_type="pil",
                callback_on_step_end=on_step,
            ).images
        paths = []
        for i, im in enumerate(images):
            paths.append(out_dir / f"{i:04d}.png")
            im.save(paths[-1])
        return paths

    return run


def read_pngs(paths) -> torch.Tensor:
    """Shape: -> (N, H, W, 3) uint8"""
    import numpy as np
    from PIL import Image

    out = []
    for p in paths:
        with Image.open(p) as im:
            out.append(torch.from_numpy(np.array(im.convert("RGB"))))
    return torch.stack(out)


# ----- measurement ---------------------------------------------------------------------------------------------
class Watchdog:
    """Ends the process when one call runs past its limit, after writing a row that says where."""

    def __init__(self, out: Path, base: dict):
        self.out, self.base, self.timer = out, base, None

    def arm(self, seconds: float, where: str) -> None:
        def fire():
            row = dict(self.base, row=where.split(":")[0], status=f"timeout after {seconds:.0f} s at {where}")
            write_row(self.out, row)
            print(f"[sample_speed] {row['status']}: stopping", flush=True)
            os._exit(3)

        self.timer = threading.Timer(seconds, fire)
        self.timer.daemon = True
        self.timer.start()

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def timed(run, device, watchdog: Watchdog, limit: float, where: str):
    """(seconds, result) of one call between two synchronizations, under the watchdog."""
    sync(device)
    watchdog.arm(limit, where)
    t = time.perf_counter()
    result = run()
    sync(device)
    s = time.perf_counter() - t
    watchdog.disarm()
    return s, result


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def row_options(name: str, device_type: str, images: int, steps: int, size: int) -> dict:
    """A fluxzero row's options, its None ones (--batch-size, --compile) chosen as `fluxzero sample` chooses them
    for these images, steps and size on this device."""
    from fluxzero.sampling.pipeline import auto_speed
    from fluxzero.sampling.schedule import image_tokens

    opts = dict(FLUXZERO_ROWS[name])
    if device_type != "cuda" and opts["attention"] == "cudnn":  # torch's CPU SDPA has no cuDNN: exercise a switch
        opts["attention"] = "math"
    opts["batch_size"], opts["compile"] = auto_speed(
        device_type, images, steps, image_tokens(size, size), opts["batch_size"], opts["compile"]
    )
    return opts


def measure_row(name: str, args, ctx: dict, watchdog: Watchdog) -> dict:
    device = ctx["device"]
    if name in FLUXZERO_ROWS:
        opts = row_options(name, device.type, args.images, args.steps, args.size)
        from fluxzero.sampling.pipeline import prepare_model

        # as the command does; --compile-backend eager only for the CPU smoke test (Inductor there: ~15 s a row)
        prepare_model(ctx["ours"], attention=opts["attention"], compile=opts["compile"], backend=args.compile_backend)
        try:
            return dict(_measure(name, args, ctx, watchdog, opts), options=opts)
        finally:
            eager_again(ctx["ours"])
    if name == "diffusers-compiled" and not ctx.get("compiled"):
        ctx["pipe"].transformer.compile_repeated_blocks(fullgraph=True)
        ctx["compiled"] = True
    opts = dict(batch_size=args.images, compiled=bool(ctx.get("compiled")), cudnn=name == "diffusers-cudnn")
    return dict(_measure(name, args, ctx, watchdog, opts), options=opts)


def eager_again(model) -> None:
    """Undo prepare_model: the blocks' own forwards (apply_compile set instance attributes), "auto" attention, and
    Dynamo's caches cleared, so the next row compiles afresh (as a new `fluxzero sample --compile` process)."""
    for block in (*model.double_blocks, *model.single_blocks):
        block.__dict__.pop("forward", None)
    model.set_attention("auto")
    torch._dynamo.reset()


def _measure(name: str, args, ctx: dict, watchdog: Watchdog, opts: dict) -> dict:
    device, dtype, cfg = ctx["device"], ctx["dtype"], ctx["cfg"]
    out_dir = Path(tempfile.mkdtemp(prefix=f"sample_speed_{name}_"))
    clock = StepClock(device)
    batch = opts["batch_size"]
    if name in FLUXZERO_ROWS:

        def make(steps, clock=clock):
            return fluxzero_call(
                ctx["ours"],
                ctx["vae"],
                ctx["emb"],
                out_dir,
                size=args.size,
                steps=steps,
                batch_size=batch,
                clock=clock,
                grid=opts["grid"],
            )

        calls = -(-args.images // batch)
    else:

        def make(steps, clock=clock):
            return diffusers_call(
                ctx["pipe"],
                ctx["emb"],
                out_dir,
                size=args.size,
                steps=steps,
                device=device,
                dtype=dtype,
                clock=clock,
                cudnn=opts["cudnn"],
            )

        calls = 1
    resident = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    warm = []
    for w in range(args.warmup):
        run = make(args.warmup_steps)
        s, _ = timed(
            run,
            device,
            watchdog,
            args.run_timeout_s + (COMPILE_ALLOWANCE_S if name in COMPILING_ROWS or opts.get("compile") else 0),
            f"{name}: warm-up {w + 1}",
        )
        warm.append(round(s, 3))
        print(f"[sample_speed] {name}: warm-up {w + 1} ({args.warmup_steps} steps) {s:.2f} s", flush=True)
    clock.marks.clear()
    times, images = [], None
    for r in range(args.runs):
        run = make(args.steps)
        s, paths = timed(run, device, watchdog, args.run_timeout_s, f"{name}: run {r + 1}")
        times.append(s)
        print(f"[sample_speed] {name}: run {r + 1} {s:.2f} s", flush=True)
        if r == args.runs - 1:
            images = read_pngs(paths)
    step = clock.step_s(args.steps)
    median = statistics.median(times)
    loop = step * args.steps * calls
    flops = cfg.flops_per_sample((args.size // 16) ** 2, args.t5_tokens) * args.images * args.steps
    row = {
        "row": name,
        "status": "ok",
        "batch_size": batch,
        "calls": calls,
        "run_s": [round(t, 3) for t in times],
        "median_s": round(median, 3),
        "s_per_image": round(median / args.images, 3),
        "step_s": round(step, 4),
        "loop_s": round(loop, 3),
        "other_s": round(median - loop, 3),
        "warmup_s": warm,
        "loop_tflops": round(flops / loop / 1e12, 1) if loop > 0 else None,
    }
    if device.type == "cuda":
        row.update(
            resident_gib=round(resident / GIB, 2),
            peak_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 2),
            peak_above_resident_gib=round((torch.cuda.max_memory_allocated() - resident) / GIB, 2),
            peak_reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 2),
        )
    row.update(compare_images(name, images, ctx))
    if args.profile:
        watchdog.arm(args.run_timeout_s, f"{name}: profile")
        row["profile"] = profile_step(make, device, min(batch, args.images))
        watchdog.disarm()
    return row


# ----- --profile -------------------------------------------------------------------------------------------------
# kernel (CUDA) or operator (CPU) name -> kind, first match wins: attention before matmul (the efficient kernel's
# name says cutlass), matmul before the rest
KINDS = (
    ("attention", re.compile(r"flash|fmha|sdpa|scaled_dot_product|attention", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|sm90|nvjet|wgmma|\baten::(?:mm|addmm|bmm|baddbmm|matmul|linear)$", re.I)),
)


# record_function ranges (compiled regions) that appear on the GPU timeline; older torch does not flag them all
ANNOTATIONS = ("## Call CompiledFxGraph", "Torch-Compiled Region", "TorchDynamo Cache Lookup", "CompiledFunction")


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


class ProfileClock(StepClock):
    """The per-step hook while profiling: wait for the device, then advance the profiler's schedule (so the
    recorded window is exactly one denoising step's work, started and finished on the device)."""

    def __init__(self, device: torch.device, prof):
        super().__init__(device)
        self.device, self.prof = device, prof

    def mark(self) -> None:
        sync(self.device)
        self.marks.append(time.perf_counter())
        self.prof.step()


def profile_step(make, device: torch.device, batch: int) -> dict:
    """One call of PROFILE_STEPS steps under torch.profiler, recording its second denoising step: time by kind."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    trace = {}
    with profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
        on_trace_ready=lambda p: trace.setdefault("events", p.events()),
    ) as prof:
        clock = ProfileClock(device, prof)
        make(PROFILE_STEPS, clock)()
    sync(device)
    wall_us = (clock.marks[1] - clock.marks[0]) * 1e6
    spent, count, names = {"attention": 0.0, "matmul": 0.0, "other": 0.0}, 0, {}
    for e in trace.get("events", []):
        if e.name.startswith("ProfilerStep") or (
            cuda and (getattr(e, "is_user_annotation", False) or e.name.startswith(ANNOTATIONS))
        ):
            continue  # ranges, not work: on the GPU timeline they span the kernels inside them
        if cuda:  # kernels (and copies): their span on the device
            if e.device_type != DeviceType.CUDA:
                continue
            us = e.time_range.elapsed_us()
        else:  # operators: self time, so nested operators are not counted twice
            if e.device_type != DeviceType.CPU:
                continue
            us = e.self_cpu_time_total
        spent[kind_of(e.name)] += us
        count += 1
        n = names.setdefault(e.name, [0.0, 0])
        n[0] += us
        n[1] += 1
    busy = sum(spent.values())
    ms = {k: round(v / 1e3, 3) for k, v in spent.items()}
    ms["host_gaps"] = round(max(wall_us - busy, 0.0) / 1e3, 3)
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:12]
    return {
        "window": f"denoising step 2 of a {PROFILE_STEPS}-step call, device synchronized at both ends",
        "timing": "CUDA kernel time" if cuda else "CPU operator self time",
        "images_per_step": batch,
        "wall_ms": round(wall_us / 1e3, 3),
        "ms": ms,
        "share": {k: round(v * 1e3 / wall_us, 4) for k, v in ms.items()} if wall_us > 0 else {},
        "events": count,
        "top": [{"name": n[:120], "kind": kind_of(n), "ms": round(v[0] / 1e3, 3), "calls": v[1]} for n, v in top],
    }


def profile_table(rows: list[dict]) -> str:
    lines = [
        "| row | images / step | step wall ms | attention ms | matmul ms | other ms | host gaps ms | timing |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.get("profile")
        if not p:
            continue
        m, sh = p["ms"], p["share"]
        cells = [f"{m[k]:.1f} ({100 * sh.get(k, 0):.0f}%)" for k in ("attention", "matmul", "other", "host_gaps")]
        lines.append(
            f"| {r['row']} | {p['images_per_step']} | {p['wall_ms']:.1f} | {' | '.join(cells)} | {p['timing']} |"
        )
    out = ["\n".join(lines)]
    for r in rows:
        if r.get("profile"):
            out.append(
                f"\n{r['row']}: top kernels\n"
                + "\n".join(
                    f"  {t['ms']:9.3f} ms {t['calls']:5d}x  {t['kind']:9s} {t['name']}" for t in r["profile"]["top"]
                )
            )
    return "\n".join(out)


def compare_images(name: str, images: torch.Tensor, ctx: dict) -> dict:
    """This row's images against the first measured row's (the reference is kept in ctx)."""
    ref_name, ref = ctx.setdefault("ref_images", (name, images))
    diff = (images.int() - ref.int()).abs()
    out = {
        "images_vs": ref_name,
        "image_rel_diff": round(rel_diff(images, ref), 5),
        "image_mean_abs_levels": round(diff.float().mean().item(), 3),
        "image_max_abs_levels": int(diff.max()),
    }
    if len(images) > 1:  # same noise, another prompt: the size of a real difference
        out["other_prompt_rel_diff"] = round(rel_diff(images[1], images[0]), 5)
    out["images_match"] = images_match(out, ctx["dtype"])
    return out


def images_match(row: dict, dtype: torch.dtype) -> bool:
    """The tolerance the module docstring states: fp32 within 1 level; bf16 at most half of other_prompt."""
    if dtype == torch.float32:
        return row["image_max_abs_levels"] <= 1
    return row["image_rel_diff"] <= 0.5 * row.get("other_prompt_rel_diff", float("inf"))


def fits(name: str, args, t0: float, last_run_s: float | None) -> bool:
    if last_run_s is None:
        return True
    estimate = (args.runs + args.warmup * args.warmup_steps / args.steps) * last_run_s
    estimate += PROFILE_STEPS / args.steps * last_run_s * 2 if args.profile else 0  # 2: the profiler's own cost
    estimate += COMPILE_ALLOWANCE_S if name in COMPILING_ROWS else 0
    return time.monotonic() - t0 + estimate <= args.budget_s


def sample_rows(args, base: dict, watchdog: Watchdog, t0: float) -> list[dict]:
    from diffusers import FluxPipeline

    from fluxzero.config import get_model_config

    device, dtype = torch.device(args.device), torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = get_model_config(args.model)
    print(f"[sample_speed] building {args.model} ({dtype}) and diffusers' copy on {device}", flush=True)
    tb = time.perf_counter()
    ours, theirs, vae = build(args.model, device, dtype, args.tiny_vae)
    pipe = FluxPipeline(
        scheduler=scheduler(),
        vae=vae,
        transformer=theirs,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
    )
    pipe.set_progress_bar_config(disable=True)
    print(f"[sample_speed] built in {time.perf_counter() - tb:.1f} s", flush=True)
    ctx = dict(
        device=device,
        dtype=dtype,
        cfg=cfg,
        ours=ours,
        vae=vae,
        pipe=pipe,
        emb=embeddings(args.images, cfg, args.t5_tokens),
    )
    rows, last = [], None
    for name in args.rows:
        row = dict(base, row=name)
        if not fits(name, args, t0, last):
            row["status"] = f"not run (budget {args.budget_s:.0f} s)"
        else:
            try:
                row.update(measure_row(name, args, ctx, watchdog))
                last = max(last or 0.0, row["median_s"])  # the slowest row so far: a compiled one is no guide
            except Exception as e:  # noqa: BLE001 - an OOM or a failed compile is this row's result; the others stand
                watchdog.disarm()
                kind = "OOM" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
                row["status"] = f"{kind}: {(str(e).splitlines() or [''])[0][:200]}"
        write_row(args.out, row)
        rows.append(row)
        print(f"[sample_speed] {name}: {row['status']}", flush=True)
    summary = dict(base, row="summary", status="ok", images_match={r["row"]: r.get("images_match") for r in rows})
    for ref_name in ("diffusers", "diffusers-cudnn", "diffusers-compiled"):
        ref = next((r for r in rows if r["row"] == ref_name and r["status"] == "ok"), None)
        if ref is not None:
            key = f"speedup_vs_{ref_name.replace('-', '_')}"
            for r in rows:
                if r["status"] == "ok":
                    r[key] = round(ref["median_s"] / r["median_s"], 3)
            summary[key] = {r["row"]: r.get(key) for r in rows}
    write_row(args.out, summary)
    return rows


# ----- EMA -----------------------------------------------------------------------------------------------------
def ema_rows(args, base: dict, watchdog: Watchdog) -> list[dict]:
    from fluxzero.cli import main as cli
    from fluxzero.config import get_model_config
    from fluxzero.config.run import TrainConfig
    from fluxzero.train import distributed, loop

    rank, world, device = distributed.init_distributed()
    work = Path(tempfile.mkdtemp(prefix="sample_speed_ema_"))
    ds_path = work / "ds.json"
    fit = [
        "gen-config",
        "--fit",
        "--world-size",
        "1",
        "--gpu",
        args.gpu,
        "--model",
        args.model,
        "--resolution",
        str(args.ema_resolution),
        *shlex.split(args.gen_config_extra),
        "-o",
        str(ds_path),
    ]
    cli(fit, standalone_mode=False)
    m = get_model_config(args.model)
    latent = args.ema_resolution // 8
    run_file = {
        "deepspeed": str(ds_path),
        "model": args.model,
        "output_dir": str(work / "run"),
        "steps": 10,
        "seed": 0,
        "log_every": 1,
        "checkpoint": {"resume": False},
        "export": {"format": None},
        "ema": json.loads(args.ema_section),
        "data": f"synthetic:n=1024,hw={latent}x{latent},txt=16,ctx={m.context_in_dim},vec={m.vec_in_dim},"
        f"ch={m.latent_channels}",
    }
    print(f"[sample_speed] EMA: building the trainer's run ({args.model}, `fluxzero {' '.join(fit[:-2])}`)", flush=True)
    tb = time.perf_counter()
    watchdog.arm(args.run_timeout_s * 3, "ema: setup")
    run = loop.setup(TrainConfig.from_dict(run_file), rank, world, device)
    watchdog.disarm()
    ema = run.ema
    print(
        f"[sample_speed] EMA: built in {time.perf_counter() - tb:.1f} s: {ema.kind}, {ema.numel:,} elements, "
        f"{ema.nbytes / GIB:.2f} GiB",
        flush=True,
    )
    row = dict(
        base,
        row="ema-update",
        status="ok",
        ds_config=json.loads(ds_path.read_text()),
        ema_config=ema.config.to_dict(),
        ema_kind=ema.kind,
        ema_numel=ema.numel,
        ema_bytes=ema.nbytes,
        ema_gib=round(ema.nbytes / GIB, 2),
        ema_buffers=len(ema._ema),
        ema_device=str(ema._ema[0].device),
        ema_dtype=str(ema._ema[0].dtype).replace("torch.", ""),
        master_dtype=str(next(iter(ema._masters())).dtype).replace("torch.", ""),
    )
    times, eager_times = [], []
    try:
        for step in range(1, args.ema_updates + 3):
            s, updated = timed(lambda: ema.update(step), device, watchdog, args.run_timeout_s, f"ema-update: {step}")
            if not updated:
                raise RuntimeError(f"ema.update({step}) did not update")
            if step > 2:  # the first two: allocator and kernel warm-up (the second captures the CUDA graph)
                times.append(s)
        step = args.ema_updates + 3
        row["check"] = check_update(ema, step)  # one more update, against a reference computed here
        if device.type == "cuda":  # before: the kernels launched one by one (no CUDA graph), same call
            ema.use_graphs = False
            for step in range(step + 1, step + 1 + args.ema_updates // 2):
                eager_times.append(
                    timed(
                        lambda: ema.update(step), device, watchdog, args.run_timeout_s, f"ema-update (no graph): {step}"
                    )[0]
                )
    except (RuntimeError, TypeError) as e:  # a failing update is the row's result
        watchdog.disarm()
        row["status"] = f"update failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if eager_times:
        row["median_update_s_no_graph"] = round(statistics.median(eager_times), 5)
    if times:
        med = statistics.median(times)
        row.update(
            updates=len(times),
            update_s=[round(t, 5) for t in times],
            median_update_s=round(med, 5),
            step_s_given=args.step_s,
            share_of_step=[round(med / s, 4) for s in args.step_s],
            update_gb_per_s=round(ema.numel * (2 * ema._ema[0].element_size() + 2) / med / 1e9, 1),
        )
        print(f"[sample_speed] EMA update: median {med * 1e3:.1f} ms over {len(times)}", flush=True)
    if device.type == "cuda":
        row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    write_row(args.out, row)
    return [row]


@torch.no_grad()
def check_update(ema, step: int) -> str:
    """One ema.update(step) against old.lerp(master, 1 - decay) in fp32, on three buffers (first, largest, last)
    first halved so that the EMA differs from the masters (no optimizer step runs here). An fp32 EMA must be
    within 1e-6 relative. A bf16 EMA moves 1e-4 of the gap, far under an ulp, so element by element only its
    mean can be checked: stochastic rounding is unbiased, so the moves projected on the expected ones' signs
    must sum to their expected total within 5% (~0.7% is noise over FLUX.1-dev's largest tensor); an update
    that does nothing gives 0."""
    masters = [m.detach().reshape(-1) for m in ema._masters()]
    picks = sorted({0, max(range(len(ema._ema)), key=lambda i: ema._ema[i].numel()), len(ema._ema) - 1})
    for i in picks:
        ema._ema[i].mul_(0.5)
    before = {i: ema._ema[i].float().clone() for i in picks}  # .float() of an fp32 EMA is the EMA itself
    weight = 1.0 - ema.config.decay_at(step)
    if not ema.update(step):
        return f"FAILED: update({step}) did not update"
    out, moved, expected = [], 0.0, 0.0
    for i in picks:
        want = before[i].lerp(masters[i].to(before[i].device, torch.float32), weight)
        got = ema._ema[i].float()
        if ema._ema[i].dtype == torch.bfloat16:  # summed over the buffers: the largest decides
            moved += float(((got - before[i]) * (want - before[i]).sign()).sum())
            expected += float((want - before[i]).abs().sum())
        else:
            err = float(((got - want).abs() / (want.abs() + 1e-30)).max())
            out.append((err <= 1e-6, f"buffer {i}: max relative error {err:.1e}"))
    if expected:
        out.append(
            (
                abs(moved / expected - 1) <= 0.05,
                f"buffers {picks}: moved {moved / expected:.3f} of the "
                f"expected ({sum(before[i].numel() for i in picks):,} values)",
            )
        )
    return ("ok: " if all(ok for ok, _ in out) else "FAILED: ") + "; ".join(text for _, text in out)


def sdpa_state() -> dict:
    """torch's process-wide SDPA flags and backend priority: what diffusers' attention calls may pick (fluxzero's
    blocks choose theirs with their `attention` setting, "auto" = flash, efficient, math)."""
    b = torch.backends.cuda
    state = {
        "flash": b.flash_sdp_enabled(),
        "efficient": b.mem_efficient_sdp_enabled(),
        "math": b.math_sdp_enabled(),
        "cudnn": b.cudnn_sdp_enabled(),
    }
    order = getattr(torch._C, "_get_sdp_priority_order", None)
    if order is not None:
        names = {int(v): k.lower() for k, v in torch.nn.attention.SDPBackend.__members__.items()}
        state["priority"] = [names.get(int(i), str(i)) for i in order()]
    return state


# ----- output --------------------------------------------------------------------------------------------------
def write_row(out: Path, row: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    runner.append_row(out, row)


def table(rows: list[dict]) -> str:
    if rows and rows[0]["row"] == "ema-update":
        r = rows[0]
        if r["status"] != "ok":
            return f"EMA update: {r['status']}"
        shares = ", ".join(f"{100 * x:.2f}% of a {s} s step" for x, s in zip(r["share_of_step"], r["step_s_given"]))
        return (
            f"| EMA update | median | EMA | where | share |\n|---|---|---|---|---|\n"
            f"| {r['ema_kind']}, every {r['ema_config']['every']} | {r['median_update_s'] * 1e3:.1f} ms | "
            f"{r['ema_gib']} GiB {r['ema_dtype']} | {r['ema_device']} | {shares} |"
        )
    lines = [
        "| row | s / batch (median) | runs | s / step | loop s | rest s | loop TFLOP/s | peak GiB (above "
        "models) | vs diffusers / cudnn / compiled | image diff (rel, mean levels) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['row']} | {r['status']} |  |  |  |  |  |  |  |  |")
            continue
        peak = f"{r['peak_allocated_gib']} (+{r['peak_above_resident_gib']})" if "peak_allocated_gib" in r else "-"
        speed = " / ".join(
            f"{r[k]:.3f}x" if k in r else "-"
            for k in ("speedup_vs_diffusers", "speedup_vs_diffusers_cudnn", "speedup_vs_diffusers_compiled")
        )
        ok = "" if r["images_match"] else " MISMATCH"
        lines.append(
            f"| {r['row']} | {r['median_s']:.3f} | {', '.join(f'{t:.2f}' for t in r['run_s'])} | "
            f"{r['step_s']:.4f} | {r['loop_s']:.2f} | {r['other_s']:.2f} | {r['loop_tflops']} | {peak} | "
            f"{speed} | {r['image_rel_diff']}, {r['image_mean_abs_levels']} vs {r['images_vs']}{ok} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    p = runner.parser(__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, help="model preset (default: flux-dev on cuda, flux-tiny on cpu)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--size", type=int, default=1024, help="image height and width in pixels")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--t5-tokens", type=int, default=512, help="T5 tokens per prompt (FLUX.1-dev: 512)")
    p.add_argument("--tiny-vae", action="store_true", help="a tiny VAE instead of FLUX.1's shapes (CPU smoke test)")
    p.add_argument("--runs", type=int, default=3, help="timed calls per row (the median is reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per row first")
    p.add_argument("--warmup-steps", type=int, default=2, help="denoising steps of a warm-up call")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {', '.join(ROWS)}")
    p.add_argument("--run-timeout-s", type=float, default=120.0, help="limit for one call")
    p.add_argument("--budget-s", type=float, default=270.0, help="rows that would end past this are not run")
    p.add_argument(
        "--compile-backend",
        default="inductor",
        choices=["inductor", "aot_eager", "eager"],
        help="Dynamo backend of the fluxzero compile rows (the command's: inductor; eager: CPU smoke test)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after each row's timed calls, profile one denoising step: time by kind, into the row and "
        "<--out stem>_profile.txt",
    )
    runner.add_out(p, "sample_speed.jsonl", "JSON lines file (appended)")
    p.add_argument("--ema", action="store_true", help="measure the trainer's EMA update instead of sampling")
    p.add_argument("--ema-updates", type=int, default=20, help="timed EMA updates")
    p.add_argument("--ema-section", default="{}", help="the run file's ema: section as JSON ({} = the defaults)")
    p.add_argument("--ema-resolution", type=int, default=512, help="the full fine-tune's resolution for --fit")
    p.add_argument("--gpu", default="h200", help="--fit's GPU for the full fine-tune config")
    p.add_argument(
        "--gen-config-extra",
        default="",
        help="more gen-config options for --ema, e.g. "
        "'--optimizer-mode bf16-kahan' (what --fit picks for flux-dev on one H200) on a small model",
    )
    p.add_argument(
        "--step-s",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[3.5, 4.5],
        help="full fine-tune step times (s) to compare the EMA update with",
    )
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.model = args.model or ("flux-dev" if cuda else "flux-tiny")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    if args.size % 16:
        p.error(f"--size must be a multiple of 16 pixels, got {args.size}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    base = {
        "date": provenance.stamp(),
        "command": " ".join(["benchmarks/sample_speed.py", *(argv or sys.argv[1:])]),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "versions": provenance.versions("torch", "diffusers", "deepspeed"),
        "model": args.model,
        "dtype": args.dtype,
        "size": args.size,
        "steps": args.steps,
        "images": args.images,
        "t5_tokens": args.t5_tokens,
        "vae": "tiny" if args.tiny_vae else "FLUX.1 shapes",
        "sdpa": sdpa_state(),
    }
    watchdog = Watchdog(args.out, base)
    rows = ema_rows(args, base, watchdog) if args.ema else sample_rows(args, base, watchdog, t0)
    print(f"[sample_speed] done in {time.monotonic() - t0:.0f} s; rows in {args.out}", flush=True)
    print(table(rows), flush=True)
    if args.profile and not args.ema:
        text = profile_table(rows)
        path = args.out.with_name(args.out.stem + "_profile.txt")
        path.write_text(f"{base['date']} {base['device']} {base['model']} {base['size']} px\n{text}\n")
        print(text, flush=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    code = main()
    # every row is written and closed: leave without interpreter teardown, where the --ema run's process group
    # (NCCL, or gloo on the CPU) can stall or abort a finished process (as launch/train.py does)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
