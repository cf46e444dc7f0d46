"""Time to step N from process start, compile included, and steady speed on aspect-bucketed data: fluxzero's
`launch/train.py` at its defaults against the compiled diffusers + DeepSpeed peer (PEFT adapters for a LoRA),
both fed the same batches by the trainer's loader.

    PYTHONPATH=. python3 benchmarks/bucketed_speed.py --out $OUT/bucketed.jsonl                  # 512 px, 200 steps
    PYTHONPATH=. python3 benchmarks/bucketed_speed.py --res 1024 --out $OUT/bucketed.jsonl
    PYTHONPATH=. python3 benchmarks/bucketed_speed.py --micro-batch 8 --out $OUT/b.jsonl   # an 80 GB card
    PYTHONPATH=. python3 benchmarks/bucketed_speed.py --bucket-step 16 --out $OUT/b.jsonl  # the finer buckets
    PYTHONPATH=. python3 benchmarks/bucketed_speed.py --workloads tiny --steps 4 --out /tmp/b.jsonl   # CPU, flux-tiny

Workloads (WORKLOADS): `lite` is flux-dev-lite (the benchmark model) trained in full, `lora` a rank-16 LoRA on
all linear layers of FLUX.1-dev, both from random weights, ZeRO-2 bf16, with the micro batch and checkpointing of
the resolution's row. Data: `bucketed` is the synthetic source's `buckets=RES` mix (fluxzero.data.synthetic.
bucket_mix: 40% square, 20% each 3:4 and 4:3, 10% each 2:3 and 3:2, as `fluxzero cache` buckets a photo
collection), `one-shape` the square bucket alone, the figure the bucketed one is held against; T5 512 x 4096
and CLIP 768 as FLUX.1's encoders give. `--shards` writes the samples as a shard folder first (fluxzero.data.
synthetic.write_shards), so both sides read them through the shard reader as they would a cached folder.

Each run is one process, started with a fresh Inductor cache folder (TORCHINDUCTOR_CACHE_DIR; `--cache warm`
runs the case a second time on the folder the first run filled: what a user's second run on a machine costs;
`--cache portable` runs it on another empty folder with the first run's output_dir/compile_cache.bin, as a resume
on a fresh machine finds it)
and killed after step N (no checkpoint is written). fluxzero: `gen-config --preset zero2 --model M ARGS`, a run
file with only the data, model, LoRA and output keys, `python launch/train.py --config run.yaml`; its time to
step k is when metrics.jsonl first holds step k (polled every 0.2 s). The peer: this file's `--peer-child`,
benchmarks/sweep.py's diffusers baseline (its own step, the trainer's loader, the same DeepSpeed config
builder), writing a line per step after a device synchronisation, with as many loader workers as the
trainer takes; its time to step k is when that line is first seen. By default the peer runs with Dynamo's automatic
dynamic shapes off (`peer-static`: a graph per bucket shape), as a user of it must on torch 2.11, where it crashed
with them on; `--impls peer` runs it as it comes. A row per run: wall_s (process start to
step N), first_step_s (start-up and the first compile), steady_samples_per_s over the last `--last` steps (their
samples over the sum of their step times, so every bucket counts by its share) and steady_wall_samples_per_s
(the same samples over the time between the first sightings of their first and last steps: the time between
steps too), each step's image token count (the bucket sequence, the same for both sides), the recompiles Dynamo
logged (TORCH_LOGS=recompiles) and the guard failures that caused the first of them, peak memory, and provenance. A table is printed last; `--budget` records the runs that would start after it as not run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import astuple, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # provenance, runner and sweep, also when this file is loaded by path

import provenance  # noqa: E402 - needs the line above
import runner  # noqa: E402

from fluxzero.data.buckets import default_step  # noqa: E402 - torch-free: fluxzero cache's default step

LORA = {"rank": 16, "targets": "all-linear"}
# name: (model, lora, {resolution: (micro batch, checkpoint every k blocks)})
WORKLOADS = {
    "lite": ("flux-dev-lite", None, {512: (16, 0), 1024: (4, 1)}),
    "lora": ("flux-dev", LORA, {512: (4, 1), 1024: (1, 1)}),
    "tiny": ("flux-tiny", None, {128: (2, 1), 256: (2, 1)}),  # the CPU test's
    "tiny-lora": ("flux-tiny", {"rank": 4, "targets": "all-linear"}, {128: (2, 1)}),
}
DATA = ("bucketed", "one-shape")
# fluxzero-static: the trainer with fluxzero.compile.dynamic false (a graph per token count); fluxzero-dynamo: the
# token axis left to Dynamo's default, as the trainer compiled before fluxzero.compile.dynamic (a sitecustomize
# module on the child's path replaces DSView.dynamic_tokens; the trainer's files are untouched)
# peer-static: the peer with torch._dynamo.config.automatic_dynamic_shapes off (a graph per shape): with it on, the
# compiled peer crashed on bucketed data on torch 2.11 (an Inductor kernel for a dynamic sequence length,
# benchmarks/RESULTS.md 2026-12-05 afternoon), so this is the peer a user of it runs on buckets
IMPLS = ("fluxzero", "peer", "fluxzero-static", "fluxzero-dynamo", "peer-static")
SITECUSTOMIZE_DYNAMO = """from fluxzero.config.deepspeed.view import DSView
DSView.dynamic_tokens = lambda self, token_counts: None
"""


def text_tokens(model: str) -> int:
    """T5 tokens per sample: FLUX.1's 512, flux-tiny's 16."""
    return 16 if model == "flux-tiny" else 512


def data_spec(model: str, res: int, data: str, n: int, bucket_step: int | None = None) -> str:
    """The synthetic spec of one run: `n` samples of the model's text and latent widths; `bucket_step`: the bucket
    mix as `fluxzero cache --bucket-step` would make it (default: the command's default)."""
    from fluxzero.config import get_model_config
    from fluxzero.data.synthetic import bucket_mix

    m = get_model_config(model)
    txt = text_tokens(model)
    if data != "bucketed":
        shape = f"hw={res // 8}x{res // 8}"
    else:
        shape = f"buckets={res}" if bucket_step is None else f"hw={bucket_mix(res, bucket_step)}"
    return f"synthetic:n={n},{shape},txt={txt},ctx={m.context_in_dim},vec={m.vec_in_dim},ch={m.latent_channels}"


def _child_env(cache: Path, site: Path | None = None) -> dict:
    """site: a folder with a sitecustomize module, first on the path (it would shadow the installation's own)."""
    path = os.pathsep.join(
        [*([str(site)] if site else []), str(ROOT), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env = {
        **os.environ,
        "PYTHONPATH": path,
        "FLUXZERO_NO_PROGRESS": "1",
        "PYTHONUNBUFFERED": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "TORCH_LOGS": "recompiles",
    }  # the log names each recompile
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT", "TRITON_CACHE_DIR"):
        env.pop(key, None)  # each child is its own one-process group; Triton's kernels go in the Inductor folder
    return env


def _follow(
    cmd: list, log: Path, env: dict, steps_file: Path, steps: int, timeout: float
) -> tuple[dict, float, int | None]:
    """Run `cmd` until `steps_file` (JSON lines, one per step, "step" 1-based) holds step `steps`, it exits, or
    `timeout`; then kill its process group. Returns ({step: seconds from the start when first seen}, wall, rc)."""
    seen: dict[int, float] = {}
    with open(log, "w") as out:
        t0 = time.monotonic()
        p = runner.start(cmd, log=out, env=env)
        try:
            while time.monotonic() - t0 < timeout and p.poll() is None and len(seen) < steps:
                time.sleep(0.2)
                if steps_file.is_file():
                    now = time.monotonic() - t0
                    for row in _rows(steps_file):
                        seen.setdefault(row["step"], now)
        finally:
            rc = p.poll()
            if rc is None:
                runner.kill_group(p)
            p.wait()
    return seen, time.monotonic() - t0, rc


def _why(seen: dict, steps: int, rc: int | None) -> str:
    """Why a run has no step `steps`: "" when it has."""
    return "" if len(seen) >= steps else "timed out" if rc is None else f"exited with {rc}"


def _rows(path: Path) -> list[dict]:
    """The whole JSON lines of a file another process is appending to (a line cut by the read is left out)."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


@dataclass(frozen=True)
class Job:
    """One run, the trainer's or the peer's: its folder, workload, data, steps, time limit and Inductor cache folder."""

    work: Path
    model: str
    lora: dict | None
    mb: int
    ckpt: int
    spec: str
    steps: int
    timeout: float
    cache: Path
    impl: str


def run_fluxzero(job: Job) -> tuple[dict, list, str]:
    work, model, lora, mb, ckpt, spec, steps, timeout, cache, impl = astuple(job)
    ds = work / "ds.json"
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "fluxzero.cli",
            "gen-config",
            "--preset",
            "zero2",
            "--model",
            model,
            "--micro-batch",
            str(mb),
            "--checkpoint-every",
            str(ckpt),
            *(["--lora-rank", str(lora["rank"]), "--lora-targets", lora["targets"]] if lora else []),
            "-o",
            str(ds),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_child_env(cache),
    )
    if gen.returncode:
        return {}, [], f"gen-config failed: {gen.stderr.strip().splitlines()[-1:]}"
    site = None
    if impl == "fluxzero-static":
        cfg = json.loads(ds.read_text())
        cfg["fluxzero"].setdefault("compile", {})["dynamic"] = False
        ds.write_text(json.dumps(cfg))
    elif impl == "fluxzero-dynamo":
        site = work / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE_DYNAMO)
    run = {
        "deepspeed": str(ds),
        "data": spec,
        "output_dir": str(work / "out"),
        "model": model,
        "steps": 10**6,
        "log_every": 1,
        "export": {"format": None},
        **({"lora": lora} if lora else {}),
    }
    (work / "run.yaml").write_text(json.dumps(run))  # JSON is YAML
    metrics = work / "out" / "metrics.jsonl"
    env = _child_env(cache, site)
    # the trainer keeps its compile in out/compile_cache.bin after 50 steps (or a checkpoint): before the kill here
    env["FLUXZERO_COMPILE_SAVE_STEP"] = str(max(1, min(50, steps - 1)))
    seen, _, rc = _follow(
        [sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(work / "run.yaml")],
        work / "train.log",
        env,
        metrics,
        steps,
        timeout,
    )
    txt = text_tokens(model)
    steps_rows = [
        {
            "step": r["step"],
            "step_time_s": r["step_time_s"],
            "loss": r["loss"],
            "samples": round(r["samples_per_s"] * r["step_time_s"]),
            "img_tokens": round(r["tokens_per_s"] / r["samples_per_s"]) - txt,  # the metrics count both
            "peak_memory_gb": r["peak_memory_gb"],
        }
        for r in _rows(metrics)
    ]
    return seen, steps_rows, _why(seen, steps, rc)


def run_peer(job: Job) -> tuple[dict, list, str]:
    work, steps = job.work, job.steps
    args = {"model": job.model, "lora": job.lora or {}, "mb": job.mb, "ckpt": job.ckpt, "data": job.spec}
    args.update(steps=steps, work=str(work), static=job.impl == "peer-static")
    out = work / "peer_steps.jsonl"
    seen, _, rc = _follow(
        [sys.executable, str(Path(__file__).resolve()), "--peer-child", json.dumps(args)],
        work / "peer.log",
        _child_env(job.cache),
        out,
        steps,
        job.timeout,
    )
    return seen, _rows(out), _why(seen, steps, rc)


def peer_child(args: dict) -> int:
    """The compiled diffusers + DeepSpeed peer (benchmarks/sweep.py's baseline runner) for `steps` steps, one
    JSON line per step. Compiled on a GPU; eager on the CPU (the test's path), as the trainer decides there."""
    import sweep
    import torch

    from fluxzero.config import TrainConfig
    from fluxzero.train import distributed

    if args.get("static"):
        torch._dynamo.config.automatic_dynamic_shapes = False
    rank, world, device = distributed.init_distributed()
    work = Path(args["work"])
    case = sweep.Case(
        impl="diffusers",
        model=args["model"],
        zero=2,
        ckpt=args["ckpt"],
        mb=args["mb"],
        attn="flash" if device.type == "cuda" else "auto",
        compile=device.type == "cuda",
        data=args["data"],
        lora=args["lora"],
        warmup=0,
        steps=args["steps"],
        workers=None,  # the loader workers the trainer takes on this machine (TrainConfig.loader_workers)
    )
    ds_path = work / "peer_ds.json"
    ds_path.write_text(json.dumps(sweep.deepspeed_config(case, world)))
    cfg = TrainConfig(**sweep.run_file(case, world, str(ds_path), str(work / "peer_out")))
    engine, step = sweep.baseline_runner(case, cfg, rank, world, device, hook=lambda name: None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with open(work / "peer_steps.jsonl", "a") as out:
        for i in range(args["steps"]):
            sync()
            t = time.perf_counter()
            r = step()
            sync()
            peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0
            out.write(
                json.dumps(
                    {
                        "step": i + 1,
                        "step_time_s": time.perf_counter() - t,
                        "samples": args["mb"] * world,
                        "loss": r.loss,
                        "img_tokens": r.img_tokens,
                        "peak_memory_gb": peak,
                        "automatic_dynamic_shapes": torch._dynamo.config.automatic_dynamic_shapes,
                    }
                )
                + "\n"
            )
            out.flush()
    return 0


def summarize(row: dict, seen: dict, rows: list, steps: int, last: int) -> dict:
    """The row's figures up to step `steps`; a run stopped before it (timeout, failure) gets them up to its last
    step, with status naming that step, so a cut run still says how far it came and how fast."""
    done = min(steps, len(rows), max(seen, default=0))
    if done < 2:
        return {**row, "status": "failed", "steps_done": done}
    last = min(last, done - 1) if done < steps else last
    tail = rows[done - last : done]
    samples = sum(r["samples"] for r in tail)
    return {
        **row,
        "status": "ok" if done == steps else f"stopped at step {done}",
        "steps_done": done,
        "wall_s": round(seen[done], 2),
        "first_step_s": round(seen[min(seen)], 2),
        "steady_samples_per_s": round(samples / sum(r["step_time_s"] for r in tail), 3),
        # the same steps by the clock of the files' growth: also what the process does between steps
        "steady_wall_samples_per_s": round(samples / max(1e-9, seen[done] - seen[done - last]), 3),
        "steady_steps": last,
        "img_tokens_per_step": [r["img_tokens"] for r in rows[:done]],
        "peak_memory_gb": max(r["peak_memory_gb"] for r in rows[:done]),
        "losses_first": [round(r["loss"], 4) for r in rows[:3]],
    }


def recompiles(log: str, keep: int = 12) -> tuple[int, list[str]]:
    """(how many recompiles TORCH_LOGS=recompiles logged, the first `keep` guard failures that caused them): each
    recompile logs "Recompiling function F in FILE:LINE", then its failed guards as "    - 0/1: ..." lines."""
    count, reasons = 0, []
    for line in log.splitlines():
        if "[__recompiles]" not in line:
            continue
        text = line.split("[__recompiles]", 1)[1].strip()
        if text.startswith("Recompiling function"):
            count += 1
        elif text.startswith("- ") and len(reasons) < keep:
            reasons.append(text[2:])
    return count, reasons


def _portable_start(cold: Path, work: Path) -> int:
    """Put the cold run's output_dir/compile_cache.bin into this run's output_dir, as a resume on another machine
    finds it; returns its bytes (0: the cold run kept none, e.g. eager blocks on a CPU)."""
    kept = cold / "out" / "compile_cache.bin"
    if not kept.is_file():
        return 0
    (work / "out").mkdir(parents=True, exist_ok=True)
    shutil.copy(kept, work / "out" / "compile_cache.bin")
    return kept.stat().st_size


def _runs(a) -> list[tuple]:
    runs = []
    for w in a.workloads:
        for data in a.data:
            for impl in a.impls:
                for cache in a.cache:
                    if not (impl.startswith("peer") and cache == "portable"):  # the peer keeps no such file
                        runs.append((w, data, impl, cache))
    return runs


def _csv(choices):
    def parse(s: str) -> list[str]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (comma-separated), got {s!r}")
        return items

    return parse


def main(argv=None) -> int:
    ap = runner.parser(__doc__)
    runner.add_out(ap, None, "JSON lines file (appended, one row per run); required")
    ap.add_argument("--workloads", type=_csv(WORKLOADS), default=["lite", "lora"])
    ap.add_argument("--res", type=int, default=512, help="pixels: the bucket mix's resolution")
    ap.add_argument("--data", type=_csv(DATA), default=["bucketed"])
    ap.add_argument("--impls", type=_csv(IMPLS), default=["fluxzero", "peer-static"])
    ap.add_argument(
        "--cache",
        type=_csv(("cold", "warm", "portable")),
        default=["cold"],
        help="cold: a fresh Inductor cache folder; warm: again on the folder the cold run filled; portable (the "
        "trainer): another fresh folder, with the cold run's output_dir/compile_cache.bin in its output_dir, as a "
        "resume on another machine has it",
    )
    ap.add_argument("--steps", type=int, default=200, help="the step the wall time runs to")
    ap.add_argument("--last", type=int, default=50, help="steps at the end that the steady speed is taken over")
    runner.add_timeout(ap, 900, "seconds per run")
    ap.add_argument("--budget", type=float, default=None, help="seconds for all runs; later runs are not started")
    ap.add_argument("--shards", action="store_true", help="write the samples as a shard folder and train on that")
    ap.add_argument(
        "--micro-batch",
        type=int,
        help="instead of the workload's row (the rows are sized for a 141 GB H200: an 80 GB card needs a smaller one)",
    )
    ap.add_argument("--checkpoint-every", type=int, help="instead of the workload's row (0: no checkpointing)")
    ap.add_argument(
        "--bucket-step",
        type=int,
        help="the buckets `fluxzero cache --bucket-step N` makes (default: its default, 64 px from 256 px up, where "
        "every token count is a multiple of 16); 16 gives counts such as 999 that Inductor's alignment guard on "
        "attention splits",
    )
    ap.add_argument("--peer-child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.peer_child:
        return peer_child(json.loads(a.peer_child))
    if not a.out:
        ap.error("--out is required: the JSON lines file the rows are appended to")
    bad = [w for w in a.workloads if a.res not in WORKLOADS[w][2]]
    if bad:
        ap.error(
            f"--res {a.res} has no row for {', '.join(bad)}; resolutions: "
            f"{', '.join(f'{w} {sorted(WORKLOADS[w][2])}' for w in bad)}"
        )
    if a.steps < 2 or not 1 <= a.last < a.steps:
        ap.error("--steps must be >= 2 and --last between 1 and steps - 1 (the first step compiles)")
    if {"warm", "portable"} & set(a.cache) and "cold" not in a.cache:
        a.cache = ["cold", *a.cache]  # a warm or portable run reads what its cold run compiled
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    versions = provenance.versions("torch", "deepspeed", "diffusers", "peft")
    results, t_start = [], time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for w, data, impl, cache in _runs(a):
            model, lora, per_res = WORKLOADS[w]
            mb, ckpt = per_res[a.res]
            mb = a.micro_batch or mb
            ckpt = ckpt if a.checkpoint_every is None else a.checkpoint_every
            spec = data_spec(model, a.res, data, n=mb * a.steps, bucket_step=a.bucket_step)  # one epoch: all seen once
            name = f"{impl} {w} {a.res}px {data} {cache}"
            row = {
                "run": name,
                "impl": impl,
                "workload": w,
                "model": model,
                "lora": lora,
                "res": a.res,
                "data": data,
                "cache": cache,
                "micro_batch": mb,
                "checkpoint_every": ckpt,
                "steps": a.steps,
                "data_spec": spec,
                "bucket_step": a.bucket_step or default_step(a.res),
                "shards": a.shards,
                "date": provenance.stamp(),
                "versions": versions,
            }
            if a.budget is not None and time.monotonic() - t_start > a.budget:
                row["status"] = "not run (budget)"
            else:
                key = f"{impl}-{w}-{data}"
                work = Path(tmp) / f"{key}-{cache}"
                work.mkdir()
                source = spec
                if a.shards:
                    source = str(Path(tmp) / f"shards-{w}-{data}")
                    if not Path(source).is_dir():
                        from fluxzero.data.synthetic import write_shards

                        write_shards(spec, source)
                folder = Path(tmp) / f"inductor-{key}"
                if cache == "portable":
                    folder = folder.with_name(f"{folder.name}-portable")
                    row["compile_cache_bytes"] = _portable_start(Path(tmp) / f"{key}-cold", work)
                job = Job(work, model, lora, mb, ckpt, source, a.steps, a.timeout, folder, impl)
                seen, rows, why = (run_peer if impl.startswith("peer") else run_fluxzero)(job)
                row = summarize(row, seen, rows, a.steps, a.last)
                if impl.startswith("peer") and rows:
                    row["automatic_dynamic_shapes"] = rows[0].get("automatic_dynamic_shapes")
                log = work / ("peer.log" if impl.startswith("peer") else "train.log")
                row["recompiles"], row["recompile_reasons"] = recompiles(log.read_text(errors="replace"))
                if why:
                    row.update(why=why, log_tail=log.read_text(errors="replace").strip().splitlines()[-5:])
            results.append(row)
            runner.append_row(out, row)
            print(
                f"{name}: {row['status']} wall {row.get('wall_s', '')} s, steady "
                f"{row.get('steady_samples_per_s', '')} samples/s {row.get('log_tail', '')}",
                flush=True,
            )
    print("| run | wall to step N (s) | first step (s) | steady samples/s | by the clock | recompiles | peak GB |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['run']} | {r.get('wall_s', r['status'])} | {r.get('first_step_s', '')} | "
            f"{r.get('steady_samples_per_s', '')} | {r.get('steady_wall_samples_per_s', '')} | "
            f"{r.get('recompiles', '')} | {r.get('peak_memory_gb', '')} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
