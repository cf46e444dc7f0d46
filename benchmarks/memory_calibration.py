"""Predicted (fluxzero.plan) vs measured peak GPU memory of real fluxzero training steps.

Each case runs in its own process group (`python -m torch.distributed.run --standalone`, one process per GPU,
killed at its timeout) through the trainer itself: `fluxzero.train.loop.setup` builds what train() runs (the
DeepSpeed config view, the trainer's loader on synthetic cached latents, the engine: zero.Init under ZeRO-3,
checkpointing applied from outside, deepspeed.initialize; and the public TrainStep), and each step is
`run.step()`. The final checkpoint and export of train() are left out: flux-dev's optimizer state alone is
~190 GB of disk.

Measured per rank, for every step: torch.cuda.max_memory_allocated / max_memory_reserved of the engine start
(setup: loader, model build, deepspeed.initialize), of data + forward + backward and of the optimizer step (peak
counters reset between phases by TrainStep's on_phase hook), and the process's peak RSS. The DeepSpeed config is
exactly `fluxzero gen-config`'s (its bucket sizes, torch AdamW), and the prediction reads that same config
(memory.run_options_from_ds_config).

    PYTHONPATH=. python benchmarks/memory_calibration.py --grid lite            # 1 GPU, flux-dev-lite
    PYTHONPATH=. python benchmarks/memory_calibration.py --grid dev2 --cases 1-3  # 2 GPUs, flux-dev
    PYTHONPATH=. python benchmarks/memory_calibration.py --grid dev2 --list

Results: one JSON line per case in $OUT/memory_calibration.jsonl (or ./memory_calibration.jsonl), a markdown
table on stdout. A case that runs out of memory is a result (status "oom", with the phase), not a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # runner, also when this file is loaded by path

import runner  # noqa: E402

from fluxzero import plan as memory  # noqa: E402
from fluxzero.config import get_model_config  # noqa: E402
from fluxzero.config.deepspeed import build as ds_config  # noqa: E402  (pure modules: the parent never imports torch)

GiB = memory.GiB


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    gpus: int
    stage: int
    micro_batch: int
    px: int
    checkpoint_every: int = 1
    offload_optimizer: str = "none"
    offload_param: str = "none"
    expandable: bool = False
    adam_impl: str = "torch"
    txt_len: int = 512
    steps: int = 3
    timeout_s: int = 240
    extra: dict = field(default_factory=dict)  # more gen-config options (bucket sizes, ...)

    def ds(self) -> dict:
        opts = ds_config.options_from(
            None,
            model=self.model,
            world_size=self.gpus,
            micro_batch=self.micro_batch,
            zero_stage=self.stage,
            offload_optimizer=self.offload_optimizer,
            offload_param=self.offload_param,
            checkpoint_every=self.checkpoint_every,
            adam_impl=self.adam_impl,
            precision="bf16",
            steps_per_print=10**6,
            **self.extra,
        )
        return ds_config.build(opts)

    def spec(self) -> memory.RunSpec:
        # load_bytes=0: the benchmark trains from random init, no weights file is read on the host
        return memory.RunSpec(
            get_model_config(self.model),
            gpus_per_node=self.gpus,
            height=self.px,
            width=self.px,
            txt_len=self.txt_len,
            expandable_segments=self.expandable,
            load_bytes=0,
            **memory.run_options_from_ds_config(self.ds()),
        )


def _case(prefix, model, gpus, stage, mb, px=512, ck=1, timeout_s=240, **kw):
    tags = "".join(
        t
        for t, on in (
            ("-offload", kw.get("offload_optimizer", "none") != "none"),
            ("-fused", kw.get("adam_impl") == "fused"),
            ("-bigprefetch", "extra" in kw),
            ("-expandable", kw.get("expandable")),
        )
        if on
    )
    if kw.get("adam_impl") == "fused":
        timeout_s += 90  # FusedAdam's JIT build (~62 s) the first time on a machine
    return Case(
        f"{prefix}-z{stage}-ck{ck}-mb{mb}-{px}{tags}", model, gpus, stage, mb, px, ck, timeout_s=timeout_s, **kw
    )


def _lite(stage, mb, px=512, ck=1, **kw):
    return _case("lite", "flux-dev-lite", 1, stage, mb, px, ck, timeout_s=180, **kw)


def _dev2(stage, mb, px=512, ck=1, **kw):
    return _case("dev2", "flux-dev", 2, stage, mb, px, ck, **kw)


# The measured 1024 px facts used a larger ZeRO-3 prefetch / persistence than gen-config's defaults.
BIG_PREFETCH = {"stage3_prefetch_bucket_size": 500_000_000, "stage3_param_persistence_threshold": 1_000_000}

# Most informative first: a time budget cuts the tail.
GRIDS: dict[str, list[Case]] = {
    # CPU smoke test of the code path (tests/plan/test_memory.py); no memory numbers on CPU
    "tiny": [
        Case("tiny-z2-ck1-mb2-64", "flux-tiny", 1, 2, 2, 64, txt_len=16, steps=2, timeout_s=150),
        Case("tiny2-z3-ck2-mb1-64", "flux-tiny", 2, 3, 1, 64, checkpoint_every=2, txt_len=16, steps=2, timeout_s=150),
    ],
    "lite": [
        _lite(2, 1),
        _lite(2, 4),
        _lite(2, 1, ck=0),
        _lite(2, 4, ck=0),
        _lite(0, 1),
        _lite(0, 2, ck=0),
        _lite(3, 1),
        _lite(3, 2, ck=0),
        _lite(2, 2),
        _lite(2, 8),
        _lite(2, 1, 1024),
        _lite(2, 2, 1024),
        _lite(2, 1, 1024, ck=0),
        _lite(3, 4, 1024),
        _lite(1, 1),
        _lite(2, 2, ck=2),
        _lite(2, 1, offload_optimizer="cpu"),
        _lite(2, 1, adam_impl="fused"),
    ],
    "dev2": [
        _dev2(3, 1),
        _dev2(2, 1, adam_impl="fused"),
        _dev2(2, 1, adam_impl="fused", expandable=True),
        _dev2(3, 1, adam_impl="fused"),
        _dev2(3, 16),
        _dev2(3, 4, 1024, extra=BIG_PREFETCH),
        _dev2(3, 8, 1024, extra=BIG_PREFETCH),
        _dev2(3, 32),
        _dev2(3, 1, ck=0),
        _dev2(3, 2),
        _dev2(3, 4),
        _dev2(3, 8),
        _dev2(3, 2, ck=0),
        _dev2(3, 1, 1024),
        _dev2(3, 2, 1024),
        _dev2(2, 1),
    ],
}


# ---------------------------------------------------------------------------------------------------------
# Worker: one case, one rank (started by torch.distributed.run)
# ---------------------------------------------------------------------------------------------------------
def worker(case: Case, ds_path: str, result_path: str) -> None:
    """One rank of one case: loop.setup builds loader, engine and TrainStep exactly as train() does; the
    TrainStep's on_phase hook resets and reads the peak counters between forward+backward and the update."""
    import resource

    import torch
    import torch.distributed as dist

    from fluxzero.config import TrainConfig
    from fluxzero.train import distributed, loop
    from fluxzero.train.checkpoint import locks

    out = tempfile.mkdtemp(prefix="memcal-")
    world = case.gpus
    hw = case.px // 8
    mc = get_model_config(case.model)
    data = (
        f"synthetic:n={max(64, 2 * case.micro_batch * world)},hw={hw}x{hw},txt={case.txt_len},"
        f"ctx={mc.context_in_dim},vec={mc.vec_in_dim}"
    )
    cfg = TrainConfig(
        deepspeed=ds_path,
        data=data,
        output_dir=out,
        model=case.model,
        checkpoint={"resume": False},
        steps=case.steps,
        export={"format": None},
    )  # micro batch and bf16: in the DeepSpeed config
    rank, world, device = distributed.init_distributed()
    cuda = torch.cuda.is_available()
    rec: dict = {"rank": rank, "steps": [], "status": "ok"}
    gib = lambda n: n / GiB  # noqa: E731

    def mark(phase: str) -> dict:
        if not cuda:  # CPU smoke runs (tests): the code path only
            return {"phase": phase, "allocated": 0.0, "reserved": 0.0}
        torch.cuda.synchronize()
        return {
            "phase": phase,
            "allocated": gib(torch.cuda.max_memory_allocated()),
            "reserved": gib(torch.cuda.max_memory_reserved()),
        }

    def reset():
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    phase, marks = "init", {}

    def on_phase(name: str) -> None:  # TrainStep's hook; synchronising here is fine: nothing is timed
        nonlocal phase
        if name == "data":
            phase = "train"
            reset()
        elif name == "update":
            marks["train"] = mark("train")
            phase = "step"
            reset()
        elif name == "end":
            marks["step"] = mark("step")

    try:
        reset()
        run = loop.setup(cfg, rank, world, device)
        rec["init"] = mark("init")
        run.step.on_phase = on_phase
        for _ in range(case.steps):
            r = run.step()
            rec["steps"].append({"train": marks["train"], "step": marks["step"], "loss": r.loss})
    except torch.OutOfMemoryError as e:
        rec.update(
            status="oom",
            oom_phase=phase,
            oom_step=len(rec["steps"]),
            error=str(e).splitlines()[0][:300],
            at_oom=mark(phase),
        )
    finally:
        locks.release_output_dir()
    rec["rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    everyone = [None] * world
    dist.all_gather_object(everyone, rec)
    if rank == 0:
        Path(result_path).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# Blocks: saved-for-backward bytes and backward peak of one block of each kind, on this device
# ---------------------------------------------------------------------------------------------------------
def blocks_check(model: str, pxs: list[int], txt_len: int, out_dir: Path, lora: str | None = None) -> list[str]:
    """Per block kind, resolution and attention kernel: bytes saved for backward (saved_tensors_hooks,
    distinct storages still held when forward returns, minus parameters and inputs) vs
    memory.double/single_block_saved, and (CUDA) the allocator peak of forward+backward above the inputs, weight
    gradients dropped as made, vs saved + memory.block_backward_workspace + the block's largest weight gradient (in
    flight). `lora` (lora, dora, lokr): rank-16 bf16 adapters on attention+mlp (ZeRO 0-2's), the prediction then
    the frozen block's plus memory.lora_block_saved and memory.adapter_block_fixed."""
    import weakref

    import torch

    from fluxzero.model import build_model

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    cfg = get_model_config(model).replace(depth=1, depth_single_blocks=1)
    net = build_model(cfg, device=dev, dtype=torch.bfloat16)
    if lora:
        from fluxzero.config.lora import LoraConfig
        from fluxzero.model.lora import apply_lora

        apply_lora(net, LoraConfig(rank=16, type=lora))
        net.to(torch.bfloat16)  # the adapters in the training dtype, as the engine casts them below ZeRO-3
    params = list(net.parameters())
    for p_ in (q for q in params if q.requires_grad):  # ZeRO-2/3 move each weight gradient into a bucket as soon
        p_.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))  # as it exists: do the same
    rows, C = [], cfg.hidden_size
    for px in pxs:
        I, T = (px // 16) ** 2, txt_len
        for backend in ("auto", "math"):
            net.set_attention(backend)  # the blocks' SDPA backend (a model setting)
            att = "math" if backend == "math" else "flash"
            g = torch.Generator(device=dev).manual_seed(0)
            img = torch.randn(1, I, C, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
            txt = torch.randn(1, T, C, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
            vec = torch.randn(1, C, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
            ids = torch.zeros(1, I + T, 3, device=dev)
            ids[..., 1] = torch.arange(I + T, device=dev)
            pe = net.pe_embedder(ids)
            x = torch.cat((txt, img), 1).detach().requires_grad_()
            for kind, block, args, predict_fn in (
                ("double", net.double_blocks[0], (img, txt, vec, pe), memory.double_block_saved),
                ("single", net.single_blocks[0], (x, vec, pe), memory.single_block_saved),
            ):
                held: list = []

                class Box:  # what the graph holds: a tensor saved and dropped within forward is not counted
                    __slots__ = ("t", "__weakref__")

                def pack(t):
                    box = Box()
                    box.t = t
                    held.append(weakref.ref(box))
                    return box

                if cuda:
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
                    out = block(*args)
                skip = {t.untyped_storage().data_ptr() for t in params + list(args)}
                seen = {b.t.untyped_storage().data_ptr(): b.t.untyped_storage().nbytes() for r in held if (b := r())}
                saved = sum(n for ptr, n in seen.items() if ptr not in skip)
                outs = out if isinstance(out, tuple) else (out,)
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                peak = (torch.cuda.max_memory_allocated() - base) / GiB if cuda else 0.0
                del out, outs
                for p_ in params + list(args):
                    p_.grad = None
                pred_saved = sum(predict_fn(cfg, I, T, 2, device=dev, attention=att, frozen=bool(lora)).values())
                if lora:
                    spec = memory.RunSpec(cfg, height=px, width=px, txt_len=T, lora_rank=16, lora_type=lora, device=dev)
                    i = int(kind == "single")
                    pred_saved += memory.lora_block_saved(spec)[i] + memory.adapter_block_fixed(spec).saved[i]
                in_flight = 2 * max(
                    sum(q.numel() for q in m.parameters()) for m in block.modules() if isinstance(m, torch.nn.Linear)
                )  # one weight gradient, bf16
                pred_peak = (pred_saved + memory.block_backward_workspace(cfg, I, T, 2, att) + in_flight) / GiB
                rec = {
                    "model": model,
                    "kind": kind,
                    "px": px,
                    "txt_len": T,
                    "attention": backend,
                    "lora": lora,
                    "device": dev,
                    "saved_gib": saved / GiB,
                    "saved_pred_gib": pred_saved / GiB,
                    "bwd_peak_gib": peak,
                    "bwd_peak_pred_gib": pred_peak,
                }
                runner.append_row(out_dir / "memory_blocks.jsonl", rec)
                err = (pred_saved - saved) / saved
                mib = GiB / 1024
                rows.append(
                    f"| {kind} | {px} | {backend} | {pred_saved / mib:.1f} / {saved / mib:.1f} ({err:+.1%}) | "
                    f"{pred_peak * 1024:.1f} / {peak * 1024:.1f} |"
                )
                print(rows[-1], file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------------
# Parent: prediction, one subprocess per case, table
# ---------------------------------------------------------------------------------------------------------
def predict(case: Case) -> dict:
    e = memory.estimate(case.spec())
    return {
        "init": e.gpu_phase("init") / GiB,
        "train": e.gpu_phase("train") / GiB,
        "step": e.gpu_phase("step") / GiB,
        "allocated": e.gpu_allocated / GiB,
        "reserved": e.gpu_reserved / GiB,
        "peak_phase": e.peak_phase,
        "host_per_node": e.host_per_node / GiB,
        "fits_h200": memory.verdict(e, memory.Hardware(memory.GPU_MEMORY_GIB["h200"], None, 1, case.gpus), 0.0)[0],
    }


def summarise(ranks: list[dict]) -> dict:
    """Max over ranks and steps of each phase's allocated/reserved peaks."""
    m: dict = {"status": "oom" if any(r["status"] == "oom" for r in ranks) else "ok"}
    for ph in ("init", "train", "step"):
        if ph == "init":
            vals = [r["init"] for r in ranks if "init" in r]
        else:
            vals = [s[ph] for r in ranks for s in r["steps"]]
        if vals:
            m[ph] = max(v["allocated"] for v in vals)
            m[ph + "_reserved"] = max(v["reserved"] for v in vals)
    oom = [r for r in ranks if r["status"] == "oom"]
    if oom:
        m.update(
            oom_phase=oom[0]["oom_phase"],
            oom_step=oom[0]["oom_step"],
            error=oom[0]["error"],
            at_oom=max(r["at_oom"]["allocated"] for r in oom),
        )
    peaks = [m[p] for p in ("init", "train", "step") if p in m]
    if peaks and m["status"] == "ok":
        m["allocated"] = max(peaks)
        m["reserved"] = max(m[p + "_reserved"] for p in ("init", "train", "step") if p + "_reserved" in m)
    m["host_per_node_rss"] = sum(r["rss_gib"] for r in ranks)
    return m


def run_case(case: Case, workdir: Path) -> dict:
    ds_path, result = workdir / f"{case.name}.json", workdir / f"{case.name}.result.json"
    ds_path.write_text(json.dumps(case.ds(), indent=1))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # compiled DeepSpeed ops (FusedAdam) are built once per machine, outside $OUT
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(tempfile.gettempdir()) / "fluxzero-torch-extensions"))
    if case.expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    else:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={case.gpus}",
        str(Path(__file__).resolve()),
        "--worker",
        json.dumps(asdict(case)),
        str(ds_path),
        str(result),
    ]
    log = workdir / f"{case.name}.log"
    res = runner.run(cmd, timeout=case.timeout_s, log=log, env=env, cwd=Path.cwd())
    out = {"wall_s": round(res.wall_s, 1)}
    if result.exists():
        out.update(summarise(json.loads(result.read_text())))
    else:
        out.update(status="timeout" if res.timed_out else "error", rc=res.rc, log_tail=runner.log_tail(log, 1500))
    return out


def parse_cases(text: str | None, grid: list[Case]) -> list[Case]:
    if not text:
        return grid
    chosen = []
    for part in text.split(","):
        if "-" in part and part.replace("-", "").isdigit():
            a, b = map(int, part.split("-"))
            chosen += grid[a - 1 : b]
        elif part.isdigit():
            chosen.append(grid[int(part) - 1])
        else:
            chosen += [c for c in grid if c.name == part]
    return chosen


def row(case: Case, pred: dict, meas: dict) -> str:
    def cell(p, m):
        if m is None:
            return f"{p:.1f} / -"
        if m <= 0:
            return f"{p:.1f} / {m:.1f}"
        return f"{p:.1f} / {m:.1f} ({(p - m) / m:+.0%})"

    status = meas.get("status")
    if status == "oom":
        status = f"OOM at {meas['oom_phase']} of step {meas['oom_step'] + 1} ({meas.get('at_oom', 0):.1f} GiB)"
    return (
        f"| {case.name} | {cell(pred['init'], meas.get('init'))} | {cell(pred['train'], meas.get('train'))} | "
        f"{cell(pred['step'], meas.get('step'))} | {cell(pred['allocated'], meas.get('allocated'))} | "
        f"{cell(pred['reserved'], meas.get('reserved'))} | {pred['host_per_node']:.0f} / "
        f"{meas.get('host_per_node_rss', 0):.0f} | {'yes' if pred['fits_h200'] else 'no'} | {status} |"
    )


def main(argv=None) -> int:
    p = runner.parser(__doc__)
    p.add_argument("--grid", choices=sorted(GRIDS), default="lite")
    p.add_argument("--cases", help="1-based indices, ranges (1-3) or names, comma-separated (default: all)")
    p.add_argument("--list", action="store_true", help="list the grid's cases with predictions and exit")
    p.add_argument("--budget-s", type=float, default=540, help="start no case after this many seconds")
    p.add_argument(
        "--blocks",
        action="store_true",
        help="instead of training: saved bytes and backward peak of one block of each kind",
    )
    p.add_argument("--blocks-model", default="flux-dev")
    p.add_argument("--blocks-px", default="512,1024", help="resolutions for --blocks, comma-separated")
    p.add_argument("--blocks-txt", type=int, default=512)
    p.add_argument(
        "--blocks-lora", choices=("lora", "dora", "lokr"), help="--blocks with rank-16 adapters of this type"
    )
    p.add_argument("--worker", nargs=3, metavar=("CASE", "DS", "RESULT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.blocks:
        out_dir = runner.out_dir()
        out_dir.mkdir(parents=True, exist_ok=True)
        pxs = [int(v) for v in a.blocks_px.split(",")]
        rows = blocks_check(a.blocks_model, pxs, a.blocks_txt, out_dir, a.blocks_lora)
        print(
            "| block | px | attention | saved MiB pred / meas | fwd+bwd peak above inputs MiB pred / meas |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows)
        )
        return 0
    if a.worker:
        c = json.loads(a.worker[0])
        worker(Case(**c), a.worker[1], a.worker[2])
        return 0
    cases = parse_cases(a.cases, GRIDS[a.grid])
    header = (
        "| case | init GiB pred / meas | fwd+bwd | step | max allocated | max reserved | host/node pred / RSS "
        "| H200 fits (pred) | status |\n|---|---|---|---|---|---|---|---|---|"
    )
    if a.list:
        print(header)
        for i, c in enumerate(GRIDS[a.grid], 1):
            print(row(c, predict(c), {"status": f"#{i}"}))
        return 0
    jsonl = runner.out_dir() / "memory_calibration.jsonl"
    t0, rows, walls = time.time(), [], []
    with tempfile.TemporaryDirectory() as tmp:
        for c in cases:
            # expect a case to take 1.5x the slowest so far (its timeout before the first one finished)
            expected = min(c.timeout_s, 1.5 * max(walls)) if walls else c.timeout_s
            if time.time() - t0 + expected > a.budget_s:
                print(f"budget: not starting {c.name} and the rest", file=sys.stderr)
                break
            pred = predict(c)
            meas = run_case(c, Path(tmp))
            walls.append(meas["wall_s"])
            runner.append_row(jsonl, {"case": asdict(c), "predicted": pred, "measured": meas})
            rows.append(row(c, pred, meas))
            print(rows[-1], file=sys.stderr, flush=True)
    print(header)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
