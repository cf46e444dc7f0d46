"""launch/train.py under a memory cap: what fits on a 24 GB (or 16 GB) card, proven on a bigger one.

Each case is a real run: `fluxzero gen-config` (the CLI itself) writes the DeepSpeed JSON, a run file names it,
and launch/train.py's main() runs it in a process of its own under a per-run timeout. Before the trainer starts,
that process caps PyTorch's CUDA allocator at --memory-cap-gib with
torch.cuda.set_per_process_memory_fraction(cap / total), so anything that would allocate more than the smaller
card holds fails here as it would there (the cap is what torch reports for the card: ~23.6 GiB for a 24 GB RTX
4090, ~15.6 GiB for a 16 GB card). Each row (JSON line in --out, appended as soon as the case ends) records
samples/s (median of metrics.jsonl after the warm-up steps), peak allocated and reserved GiB
(torch.cuda.max_memory_*), the host's peak RSS of the trainer process (written every 5 s, so a run killed at its
timeout still has them), the cap, the exit code and the last line
of the trainer's output when it failed (an out-of-memory is one sentence there); the trainer's whole output is in
train.log beside each run (under --workdir). A run ends at its last step's metrics row (the final save is not
timed). The `fit` set runs what `gen-config --fit` writes and prints for each card (DeepSpeed JSON, micro batch,
lora: section) and records --fit's predicted peak beside the measured one. A short table is printed last.

    # GPU, the 24 GB LoRA story: FLUX.1-dev (random init, `weights:` unset), rank 16, 512 px
    PYTHONPATH=. python3 benchmarks/capped_runs.py --set lora24 --memory-cap-gib 23.6 --out $OUT/capped.jsonl
    # GPU, every card of issue 23 as --fit chooses (one case per call: --cases, with a --timeout each)
    PYTHONPATH=. python3 benchmarks/capped_runs.py --set fit --cases fit-lora16-512px-24gb --memory-cap-gib 23.6
    # GPU (Ada or Hopper), the same LoRA with --base-quant fp8-matmul pinned: FP8 matmuls on the frozen base
    PYTHONPATH=. python3 benchmarks/capped_runs.py --set fit --cases fit-lora16-512px-24gb-fp8mm --memory-cap-gib 23.6
    # GPU, launch/train.py's LoRA at 1024 px micro batch 1 with one step profiled (its GPU idle time)
    PYTHONPATH=. python3 benchmarks/capped_runs.py --set lora-defaults --cases lora16-1024px-mb1 --profile-step 6
    # GPU, the full fine-tune in the fused mode as --fit writes it, one step profiled (copies vs compute)
    PYTHONPATH=. python3 benchmarks/capped_runs.py --set fit --cases fit-full-512px-24gb --memory-cap-gib 23.6 \
        --profile-step 5
    # GPU, a LoRA's base streamed from host memory on a 16 GB card, then --fit's config for that card beside it
    PYTHONPATH=. python3 benchmarks/capped_runs.py --set lora16-stream --cases lora16-stream-512px-16gb \
        --memory-cap-gib 15.6 --out $OUT/capped.jsonl
    PYTHONPATH=. python3 benchmarks/capped_runs.py --set lora16-stream --cases lora16-resident-512px-mb8 \
        --memory-cap-gib 0 --out $OUT/capped.jsonl
    # (each row records its losses: the streamed and the resident LoRA log the same ones; on flux-tiny in seconds:
    #  --set cpu-smoke --cases tiny-z0-lora-resident,tiny-z0-lora-stream-k2, on a GPU too)
    PYTHONPATH=. python3 benchmarks/capped_runs.py --set fit --cases fit-lora16-512px-16gb --memory-cap-gib 15.6 \
        --out $OUT/capped.jsonl
    # CPU smoke test of the same code path on flux-tiny (no cap: there is no CUDA allocator to cap)
    PYTHONPATH=. python3 benchmarks/capped_runs.py --set cpu-smoke --out /tmp/capped.jsonl
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # runner, also when this file is loaded by path

import runner  # noqa: E402

GIB = 1024**3


@dataclass
class Case:
    name: str
    gen_config: list[str]  # gen-config options beyond the common ones (model, micro batch, precision, ...)
    lora: dict = field(default_factory=dict)  # the run file's lora: section
    model: str = "flux-dev"
    data: str = "synthetic:n=64,hw=64x64,txt=512,ctx=4096,vec=768,ch=16"  # 512 px: 1024 image + 512 text tokens
    micro_batch: int = 1
    precision: str = "bf16"
    steps: int = 8
    warmup: int = 3  # steps left out of the median (allocation, DeepSpeed's first-step setup)
    timeout: int = 900
    # `gen-config --fit` options (GPU and host memory, LoRA rank): the config and the lora: section are then what
    # --fit writes and prints (micro batch, stage, base quantization), and its predicted peak goes in the row
    fit: list[str] | None = None


_LORA16 = {"rank": 16, "targets": "all-linear"}
_DATA_1024 = "synthetic:n=64,hw=128x128,txt=512,ctx=4096,vec=768,ch=16"  # 1024 px: 4096 image + 512 text tokens


def _fused(k: int) -> list[str]:
    return ["--zero-stage", "0", "--optimizer-mode", "fused-adafactor-sr", "--offload-blocks", str(k)]


SETS = {
    # the 24 GB row: ZeRO-2 with the bf16 base, ZeRO-2 with the int8 base, ZeRO-3 parameter offload
    "lora24": [
        Case("z2-bf16-base", ["--zero-stage", "2"], {**_LORA16, "base_quant": "none"}),
        Case("z2-int8-base", ["--zero-stage", "2"], {**_LORA16, "base_quant": "int8"}),
        Case("z3-param-offload", ["--zero-stage", "3", "--offload-param", "cpu"], {**_LORA16, "base_quant": "none"}),
        # the parameter fetch is paid once per micro batch: a larger one spreads it
        Case(
            "z3-param-offload-mb4",
            ["--zero-stage", "3", "--offload-param", "cpu"],
            {**_LORA16, "base_quant": "none"},
            micro_batch=4,
        ),
        Case(
            "z3-param-offload-mb16",
            ["--zero-stage", "3", "--offload-param", "cpu"],
            {**_LORA16, "base_quant": "none"},
            micro_batch=16,
        ),
        # prefetch one whole block ahead instead of gen-config's 0.9 x hidden^2 elements (8.5M for FLUX.1-dev,
        # less than the next block's first weight): DeepSpeed's prefetch then copies block i+1 from pinned host
        # memory on its own stream while block i computes. 339.8M = a FLUX.1-dev double block (ParamInventory);
        # live parameters stay under gen-config's 1e9 (one block in use + one prefetched: 0.68e9).
        Case(
            "z3-param-offload-pf",
            ["--zero-stage", "3", "--offload-param", "cpu", "--stage3-prefetch-bucket-size", "339831296"],
            {**_LORA16, "base_quant": "none"},
        ),
        Case(
            "z3-param-offload-mb4-pf",
            ["--zero-stage", "3", "--offload-param", "cpu", "--stage3-prefetch-bucket-size", "339831296"],
            {**_LORA16, "base_quant": "none"},
            micro_batch=4,
        ),
    ],
    # the LoRA rows of defaults_speed.py (ZeRO-2, every block checkpointed, compiled) through this runner, so that
    # --profile-step shows launch/train.py's own GPU idle time (no cap needed: --memory-cap-gib 0)
    "lora-defaults": [
        Case("lora16-512px-mb4", ["--zero-stage", "2"], _LORA16, micro_batch=4),
        Case("lora16-1024px-mb1", ["--zero-stage", "2"], _LORA16, data=_DATA_1024),
    ],
    # what `gen-config --fit` chooses for each card of the issue (the configs users run); host 128 GiB
    "fit": [
        Case("fit-lora16-512px-24gb", [], fit=["--gpu-memory", "24", "--host-memory", "128", "--lora-rank", "16"]),
        Case(
            "fit-lora16-1024px-24gb",
            [],
            data=_DATA_1024,
            fit=["--gpu-memory", "24", "--host-memory", "128", "--lora-rank", "16", "--resolution", "1024"],
        ),
        Case("fit-lora16-512px-16gb", [], fit=["--gpu-memory", "16", "--host-memory", "128", "--lora-rank", "16"]),
        # the 24 GB LoRA on an fp8-matmul base (FP8 matmuls): what --fit chooses for --gpu rtx4090; --gpu-memory
        # leaves the GPU unknown (no FP8 tensor cores assumed), so it is pinned here
        Case(
            "fit-lora16-512px-24gb-fp8mm",
            [],
            fit=["--gpu-memory", "24", "--host-memory", "128", "--lora-rank", "16", "--base-quant", "fp8-matmul"],
        ),
        # full fine-tunes: --fit chooses fused-adafactor-sr on these cards (blocks streamed from the host at 24/16 GB)
        Case("fit-full-512px-80gb", [], fit=["--gpu-memory", "80", "--host-memory", "120"]),
        Case("fit-full-512px-48gb", [], fit=["--gpu-memory", "48", "--host-memory", "96"]),
        Case("fit-full-512px-24gb", [], fit=["--gpu-memory", "24", "--host-memory", "64"]),
        Case("fit-full-512px-16gb", [], fit=["--gpu-memory", "16", "--host-memory", "64"]),
        Case(
            "fit-full-1024px-24gb",
            [],
            data=_DATA_1024,
            fit=["--gpu-memory", "24", "--host-memory", "64", "--resolution", "1024"],
        ),
        # the optimizer step on the host (cpu-* modes, what --fit chose at 48 GB before the fused mode): a step
        # takes tens of seconds, so fewer are timed
        Case(
            "fit-full-512px-48gb-host-step",
            [],
            fit=["--gpu-memory", "48", "--host-memory", "120", "--offload-optimizer", "cpu"],
            steps=4,
            warmup=2,
        ),
    ],
    # full fine-tunes in the fused mode (each tensor stepped in backward, no gradient buffer), the last K blocks
    # streamed from pinned host memory (gen-config --offload-blocks K); run each with its card's cap
    "fused": [
        Case("fused-512px-24gb", _fused(38), micro_batch=4),  # --memory-cap-gib 23.6, host <= 64 GiB
        Case("fused-512px-16gb", _fused(48), micro_batch=2),  # --memory-cap-gib 15.6, host <= 64 GiB
        Case("fused-512px-48gb", _fused(0), micro_batch=8),  # --memory-cap-gib 44.4, host <= 96 GiB
        Case("fused-512px-80gb", _fused(0), micro_batch=16),  # --memory-cap-gib 79.1, host <= 120 GiB
        Case("fused-1024px-24gb", _fused(38), data=_DATA_1024),  # --memory-cap-gib 23.6, host <= 64 GiB
    ],
    # a LoRA's frozen bf16 base, the last K blocks streamed from pinned host memory (opt-in: --fit does not choose
    # it; gen-config needs --lora-rank to write offload_blocks without a fused mode); K=54 of 57: `fluxzero
    # estimate` predicts 10.8 GiB allocated, 13.3 GiB needed at micro batch 8, every block checkpointed. Beside
    # it, fit-lora16-512px-16gb (set fit) is what --fit writes for the same card
    "lora16-stream": [
        Case(
            "lora16-stream-512px-16gb",
            ["--zero-stage", "0", "--offload-blocks", "54", "--lora-rank", "16", "--lora-targets", "all-linear"],
            {**_LORA16, "base_quant": "none"},
            micro_batch=8,
            timeout=540,  # a case ends within 9 minutes
        ),  # --memory-cap-gib 15.6, host <= 64 GiB
        # the same run with every block resident (~31 GiB predicted: uncapped, on the same card): what streaming costs
        Case(
            "lora16-resident-512px-mb8",
            ["--zero-stage", "0", "--lora-rank", "16", "--lora-targets", "all-linear"],
            {**_LORA16, "base_quant": "none"},
            micro_batch=8,
            timeout=540,
        ),  # --memory-cap-gib 0
    ],
    "cpu-fused-smoke": [
        Case(
            "tiny-fused-k2",
            _fused(2),
            model="flux-tiny",
            data="synthetic:n=16,hw=8x8,txt=4,ctx=64,vec=32",
            steps=3,
            warmup=1,
            timeout=600,
        ),
    ],
    "cpu-fit-smoke": [
        Case(
            "tiny-fit-lora",
            [],
            model="flux-tiny",
            data="synthetic:n=16,hw=8x8,txt=4,ctx=64,vec=32",
            steps=3,
            warmup=1,
            timeout=600,
            fit=["--gpu-memory", "24", "--host-memory", "64", "--lora-rank", "4", "--resolution", "128"],
        ),
        # the fused mode pinned with two blocks streamed: what --fit writes for it, run on the CPU
        Case(
            "tiny-fit-fused",
            ["--optimizer-mode", "fused-adafactor-sr", "--offload-blocks", "2"],
            model="flux-tiny",
            data="synthetic:n=16,hw=8x8,txt=4,ctx=64,vec=32",
            steps=3,
            warmup=1,
            timeout=600,
            fit=["--gpu-memory", "24", "--host-memory", "64", "--resolution", "128"],
        ),
    ],
    "cpu-smoke": [
        Case(
            f"tiny-{n}",
            opts,
            {"rank": 4, "targets": "all-linear", "base_quant": q},
            model="flux-tiny",
            data="synthetic:n=16,hw=8x8,txt=4,ctx=64,vec=32",
            steps=3,
            warmup=1,
            timeout=600,
        )
        for n, opts, q in [
            ("z2-bf16-base", ["--zero-stage", "2"], "none"),
            ("z2-int8-base", ["--zero-stage", "2"], "int8"),
            ("z3-param-offload", ["--zero-stage", "3", "--offload-param", "cpu"], "none"),
            ("z0-lora-resident", ["--zero-stage", "0", "--lora-rank", "4"], "none"),
            ("z0-lora-stream-k2", ["--zero-stage", "0", "--offload-blocks", "2", "--lora-rank", "4"], "none"),
        ]
    ],
}

# The trainer's process: cap the CUDA allocator, run launch/train.py's main(), write what it used.
CHILD = r"""
import json, os, resource, sys, threading, time
root, cap, run_file, stats_file, metrics, steps = sys.argv[1], float(sys.argv[2]), *sys.argv[3:6], int(sys.argv[6])
sys.path.insert(0, root)
import torch
GIB = 1024**3
stats = {"memory_cap_gib": cap or None}
if torch.cuda.is_available():
    total = torch.cuda.get_device_properties(0).total_memory
    stats["device_total_gib"] = total / GIB
    if cap:
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GIB / total))

LOCK = threading.Lock()  # the watcher's snapshots and the main thread's finish() write the same file

def snapshot():  # what was used so far: written every few seconds, so a run the parent kills at its timeout has it
    with LOCK:
        stats["host_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
        if torch.cuda.is_available():
            stats["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
            stats["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        with open(stats_file + ".tmp", "w") as f:
            json.dump(stats, f)
        os.replace(stats_file + ".tmp", stats_file)

def finish(code):
    with LOCK:  # the watcher may be dumping stats: no key added meanwhile
        stats["exit_code"] = code
    snapshot()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(code)

T0 = time.time()

def watch():  # the measurement ends with the last step's metrics row: the final save is not part of it
    ticks = 0
    while True:
        time.sleep(0.5)
        ticks += 1
        if ticks % 10 == 0:
            snapshot()
        try:
            with open(metrics) as f:
                n = sum(1 for line in f if '"samples_per_s"' in line)
            if n and "first_step_logged_s" not in stats:  # start-up: build, quantize, compile, first step
                with LOCK:
                    stats["first_step_logged_s"] = round(time.time() - T0, 1)
            if n >= steps:
                with LOCK:
                    stats["stopped_after_steps"] = steps
                finish(0)
        except OSError:
            pass

def profiled(n):  # optimizer step n under torch.profiler: busy time of copies and of compute kernels, and its wall time
    from fluxzero.train import step as train_step
    plain, calls = train_step.TrainStep.__call__, [0]

    def call(self):
        calls[0] += 1
        if calls[0] != n:
            return plain(self)
        from torch.profiler import ProfilerActivity, profile
        cuda = torch.cuda.is_available()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            result = plain(self)
            if cuda:
                torch.cuda.synchronize()
        split = {"profile_step": n, "profile_wall_ms": (time.perf_counter() - t) * 1e3, "profile_h2d_ms": 0.0,
                 "profile_d2h_ms": 0.0, "profile_kernels_ms": 0.0}
        try:  # GPU activity only: memcpys by direction, everything else as compute (they overlap: busy, not wall)
            for e in prof.key_averages():
                ms = getattr(e, "self_device_time_total", 0) / 1e3
                if not ms or str(getattr(e, "device_type", "")).split(".")[-1] != "CUDA":
                    continue
                key = "profile_h2d_ms" if "HtoD" in e.key else "profile_d2h_ms" if "DtoH" in e.key else \
                    "profile_kernels_ms"
                split[key] += ms
        except Exception as err:  # noqa: BLE001 - a profiler API change must not lose the run's row
            split["profile_error"] = repr(err)[:200]
        with LOCK:
            stats.update(split)
        return result

    train_step.TrainStep.__call__ = call

if os.environ.get("CAPPED_PROFILE_STEP"):
    profiled(int(os.environ["CAPPED_PROFILE_STEP"]))
threading.Thread(target=watch, daemon=True).start()
code = 1
try:
    from fluxzero.train.loop import main
    code = main(["--config", run_file])
finally:
    finish(code)
"""


def _gen_config(case: Case, path: Path) -> dict:
    """Writes the case's DeepSpeed JSON; for a --fit case, what --fit chose: micro batch, lora:, predicted peak."""
    if case.fit is not None:
        cmd = [
            sys.executable,
            "-m",
            "fluxzero.cli",
            "gen-config",
            "--fit",
            "--world-size",
            "1",
            "--model",
            case.model,
            *case.fit,
            *case.gen_config,
            "-o",
            str(path),
        ]
        done = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
        out = done.stdout + done.stderr
        chose = {
            "micro_batch": json.loads(path.read_text())["train_micro_batch_size_per_gpu"],
            "fit_chose": next((ln.strip() for ln in out.splitlines() if ln.strip().startswith("chose")), None),
        }
        m = re.search(r"predicted ([0-9.]+) GiB allocated", out)
        chose["fit_predicted_gib"] = float(m.group(1)) if m else None
        m = re.search(r"lora: (\{[^}]*\})", out)
        if m:
            chose["lora"] = yaml.safe_load(m.group(1))
        return chose
    cmd = [
        sys.executable,
        "-m",
        "fluxzero.cli",
        "gen-config",
        "--model",
        case.model,
        "--micro-batch",
        str(case.micro_batch),
        "--precision",
        case.precision,
        "--checkpoint-every",
        "1",
        "--adam-impl",
        "torch",
        "--lr",
        "1e-4",
        "--scheduler",
        "none",
        "--steps-per-print",
        "1000000000",
        *case.gen_config,
        "-o",
        str(path),
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    return {}


def run_case(case: Case, cap: float, work: Path, profile_step: int | None = None) -> dict:
    """One case in its own process; the row of what it measured (or how it failed)."""
    work.mkdir(parents=True, exist_ok=True)
    # an earlier run of the case in this --workdir left its metrics.jsonl: its rows would be read as this run's
    shutil.rmtree(work / "run", ignore_errors=True)
    row = {
        "case": case.name,
        "model": case.model,
        "data": case.data,
        "micro_batch": case.micro_batch,
        "precision": case.precision,
        "gen_config": case.gen_config,
        "lora": case.lora,
        "memory_cap_gib": cap or None,
    }
    try:
        row.update(_gen_config(case, work / "ds.json"))
    except subprocess.CalledProcessError as e:
        lines = (e.stderr or e.stdout).strip().splitlines()
        return {**row, "ok": False, "error": " ".join(lines[-6:]) if case.fit is not None else lines[-1]}
    run = {
        "deepspeed": str(work / "ds.json"),
        "data": case.data,
        "output_dir": str(work / "run"),
        "model": case.model,
        "steps": case.steps,
        "seed": 0,
        "log_every": 1,
        "checkpoint": {"every": 0, "resume": False},
        "export": {"format": None},
        "lora": row["lora"] or None,
    }
    (work / "run.json").write_text(json.dumps(run))  # YAML is a superset of JSON: the run file as it is
    # this checkout first, then whatever path the caller had (the device's wheels live there)
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "FLUXZERO_NO_PROGRESS": "1", "PYTHONPATH": path}
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        env.setdefault(k, v)
    env.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if profile_step:
        env["CAPPED_PROFILE_STEP"] = str(profile_step)
    stats_file = work / "stats.json"
    t0 = time.perf_counter()
    log = work / "train.log"  # the trainer's whole output, kept beside the run (a timeout leaves it too)
    res = runner.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(ROOT),
            str(cap or 0),
            str(work / "run.json"),
            str(stats_file),
            str(work / "run" / "metrics.jsonl"),
            str(case.steps),
        ],
        timeout=case.timeout,
        log=log,
        env=env,
    )
    if res.timed_out:
        code, tail = None, [f"timed out after {case.timeout} s"]
    else:
        code, tail = res.rc, log.read_text(errors="replace").strip().splitlines()[-1:]
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    if stats_file.is_file():
        row.update(json.loads(stats_file.read_text()))
    metrics = work / "run" / "metrics.jsonl"
    speeds = []
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        speeds = [r["samples_per_s"] for r in rows if "samples_per_s" in r and r.get("step", 0) > case.warmup]
    row["samples_per_s"] = statistics.median(speeds) if speeds else None
    # per step: runs of the same seed and data that differ only in where weights live log the same losses
    row["losses"] = [r["loss"] for r in rows if "loss" in r] if metrics.is_file() else []
    row["steps_logged"] = sum("samples_per_s" in r for r in rows) if metrics.is_file() else 0
    row["ok"] = code == 0 and bool(speeds)
    if not row["ok"]:
        row["error"] = tail[0] if tail else f"exit code {code}"
    return row


def _table(rows: list[dict]) -> str:
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    lines = [
        "| case | ok | micro batch | samples/s | peak alloc GiB | --fit predicted GiB | peak reserved GiB "
        "| host RSS GiB | cap GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {'yes' if r['ok'] else 'no: ' + r.get('error', '')[:80]} | "
            f"{r.get('micro_batch')} | {f(r.get('samples_per_s'))} | {f(r.get('peak_allocated_gib'))} | "
            f"{f(r.get('fit_predicted_gib'))} | "
            f"{f(r.get('peak_reserved_gib'))} | {f(r.get('host_peak_rss_gib'))} | "
            f"{f(r.get('memory_cap_gib'), '{:.1f}')} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = runner.parser(__doc__)
    ap.add_argument("--set", choices=sorted(SETS), default="lora24")
    ap.add_argument("--cases", help="comma-separated case names of the set (default: all)")
    ap.add_argument(
        "--memory-cap-gib",
        type=float,
        default=0.0,
        help="cap PyTorch's CUDA allocator at this many GiB in each trainer process (0: no cap)",
    )
    runner.add_timeout(ap, None, "seconds per case (default: each case's own)", type=int)
    ap.add_argument("--steps", type=int, help="optimizer steps per case (default: each case's own)")
    ap.add_argument("--warmup", type=int, help="steps left out of the median (default: each case's own)")
    runner.add_out(ap, "capped_runs.jsonl", "JSON lines file (appended)")
    ap.add_argument("--workdir", type=Path, help="where the runs write (default: a temporary folder)")
    ap.add_argument(
        "--profile-step",
        type=int,
        help="run this optimizer step under torch.profiler: the row gets its "
        "GPU busy time in host-to-device and device-to-host copies and in compute kernels (profile_*_ms)",
    )
    a = ap.parse_args(argv)
    cases = SETS[a.set]
    if a.cases:
        wanted = a.cases.split(",")
        unknown = sorted(set(wanted) - {c.name for c in cases})
        if unknown:
            ap.error(f"no case {', '.join(unknown)} in set {a.set}; its cases: {', '.join(c.name for c in cases)}")
        cases = [c for c in cases if c.name in wanted]
    given = {k: v for k, v in (("timeout", a.timeout), ("steps", a.steps), ("warmup", a.warmup)) if v is not None}
    cases = [dataclasses.replace(c, **given) for c in cases]
    work = a.workdir or Path(tempfile.mkdtemp(prefix="capped_runs_"))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in cases:
        row = run_case(case, a.memory_cap_gib, work / case.name, a.profile_step)
        rows.append(row)
        runner.append_row(a.out, row)
        print(
            f"{case.name}: {'ok' if row['ok'] else 'FAILED'} samples/s={row.get('samples_per_s')} "
            f"peak_alloc={row.get('peak_allocated_gib')} rss={row.get('host_peak_rss_gib')}",
            flush=True,
        )
    print(_table(rows))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
