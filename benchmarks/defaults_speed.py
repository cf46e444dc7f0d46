"""Speed of the trainer users run: `launch/train.py` itself, with the DeepSpeed JSON `fluxzero gen-config` writes.

    PYTHONPATH=. python3 benchmarks/defaults_speed.py --cases lite --out $OUT/defaults.jsonl
    PYTHONPATH=. python3 benchmarks/defaults_speed.py --cases cpu-smoke --out /tmp/smoke.jsonl   # CPU, flux-tiny
    PYTHONPATH=. python3 benchmarks/defaults_speed.py --cases policy --out $OUT/policy.jsonl   # checkpointing policies

Each case: `fluxzero gen-config ARGS -o ds.json`, a run file with only the keys the case names (everything else
is the trainer's default: that is the point), synthetic FLUX-shaped latents and text embeddings of the case's
resolution (512 px: 64x64 latents = 1024 image tokens, 512 T5 tokens of 4096, CLIP 768), then
`python launch/train.py --config run.yaml` in one process, killed once metrics.jsonl holds `--rows` steps (so no
checkpoint of tens of GB is written). Reported: the median samples/s of the steps after the first 3 (compile
and allocator warm-up), MFU over the bf16 matmul rate measured at the start of the same call (8192^3, median of
10; the trainer's own MFU column uses the datasheet peak), peak allocated memory (the trainer's metric), host
RSS of the process at the end, and wall time. `--memory-cap-gib` caps the trainer process with
torch.cuda.set_per_process_memory_fraction (set by a sitecustomize module on the child's path, so the trainer
is untouched), as a card of that size would.
A case "peer:..." runs the diffusers + DeepSpeed baseline of benchmarks/sweep.py in the same call instead.
One JSON line per case is appended to --out as soon as it is measured; a table is printed last.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # runner, also when this file is loaded by path

import runner  # noqa: E402

# name: (model, resolution, gen-config args, run-file keys, lora section or None)
DEV_LORA = {"rank": 16, "targets": "all-linear"}
# a case whose gen-config args hold --fit gets only --model and --world-size 1 besides them: --fit chooses the rest
FIT_H200 = ["--fit", "--gpu-memory", "141", "--host-memory", "128"]
# a rank-16 all-linear LoRA as --fit writes it for an 80 GB card (the config runs the same on a larger one)
FIT_LORA_80 = [
    "--fit",
    "--gpu-memory",
    "80",
    "--host-memory",
    "128",
    "--lora-rank",
    "16",
    "--lora-targets",
    "all-linear",
]
SEL = ["--checkpoint-policy", "selective"]
FULL_SR_CK1 = ["--zero-stage", "0", "--optimizer-mode", "bf16-sr", "--micro-batch", "16", "--checkpoint-every", "1"]
CASES = {
    # flux-dev-lite (5 + 10 full-width blocks), ZeRO-2 bf16, micro batch 16: the rows
    "lite-ckpt1-old": (
        "flux-dev-lite",
        512,
        ["--checkpoint-every", "1", "--no-compile"],
        {"num_workers": 0, "prefetch_batches": 0},
        None,
    ),
    "lite-ckpt1": ("flux-dev-lite", 512, ["--checkpoint-every", "1"], {}, None),
    "lite-ckpt1-fp8": ("flux-dev-lite", 512, ["--checkpoint-every", "1", "--fp8", "tensorwise"], {}, None),
    "lite-ckpt0": ("flux-dev-lite", 512, ["--checkpoint-every", "0"], {}, None),
    "lite-ckpt0-fp8": ("flux-dev-lite", 512, ["--checkpoint-every", "0", "--fp8", "tensorwise"], {}, None),
    "lite-ckpt1-mb8": ("flux-dev-lite", 512, ["--checkpoint-every", "1", "--micro-batch", "8"], {}, None),
    # rank-16 LoRA on FLUX.1-dev, ZeRO-2 bf16, every block checkpointed
    "lora-mb4": ("flux-dev", 512, ["--checkpoint-every", "1", "--micro-batch", "4"], {}, DEV_LORA),
    "lora-mb4-fp8": (
        "flux-dev",
        512,
        ["--checkpoint-every", "1", "--micro-batch", "4", "--fp8", "tensorwise"],
        {},
        DEV_LORA,
    ),
    "lora-mb1": ("flux-dev", 512, ["--checkpoint-every", "1", "--micro-batch", "1"], {}, DEV_LORA),
    "lora-mb1-fp8": (
        "flux-dev",
        512,
        ["--checkpoint-every", "1", "--micro-batch", "1", "--fp8", "tensorwise"],
        {},
        DEV_LORA,
    ),
    "lora-1024-mb1": ("flux-dev", 1024, ["--checkpoint-every", "1", "--micro-batch", "1"], {}, DEV_LORA),
    # the same with a DoRA (its forward makes each W + s B A whole to take row norms) and a LoKr (lora.type)
    "dora-mb4": ("flux-dev", 512, ["--checkpoint-every", "1", "--micro-batch", "4"], {}, {**DEV_LORA, "type": "dora"}),
    "lokr-mb4": ("flux-dev", 512, ["--checkpoint-every", "1", "--micro-batch", "4"], {}, {**DEV_LORA, "type": "lokr"}),
    "cpu-smoke": ("flux-tiny", 128, ["--checkpoint-every", "1", "--micro-batch", "2"], {}, None),
    "cpu-smoke-sel": ("flux-tiny", 128, ["--checkpoint-every", "1", "--micro-batch", "2", *SEL], {}, None),
    # the selective checkpointing policy (keep matmul and attention outputs, recompute the pointwise ops) against
    # full and no checkpointing at the same micro batch: its step time and its peak memory
    "lite-ckpt1-sel": ("flux-dev-lite", 512, ["--checkpoint-every", "1", *SEL], {}, None),
    "lora-mb4-ckpt0": ("flux-dev", 512, ["--checkpoint-every", "0", "--micro-batch", "4"], {}, DEV_LORA),
    "lora-mb4-sel": ("flux-dev", 512, ["--checkpoint-every", "1", "--micro-batch", "4", *SEL], {}, DEV_LORA),
    "lora-1024-mb1-ckpt0": ("flux-dev", 1024, ["--checkpoint-every", "0", "--micro-batch", "1"], {}, DEV_LORA),
    "lora-1024-mb1-sel": ("flux-dev", 1024, ["--checkpoint-every", "1", "--micro-batch", "1", *SEL], {}, DEV_LORA),
    # full FLUX.1-dev fine-tune on one H200 (issue 22 target 5): what `gen-config --fit` writes, and the levers
    # beside it (FP8 matmuls, bf16-sr with every block checkpointed at micro batch 16, an EMA of the weights)
    "full-fit": ("flux-dev", 512, FIT_H200, {}, None),
    "full-fit-fp8": ("flux-dev", 512, [*FIT_H200, "--fp8", "tensorwise"], {}, None),
    "full-fit-sr": ("flux-dev", 512, [*FIT_H200, "--optimizer-mode", "bf16-sr"], {}, None),
    "full-sr-ck1": ("flux-dev", 512, FULL_SR_CK1, {}, None),
    "full-sr-ck1-fp8": ("flux-dev", 512, [*FULL_SR_CK1, "--fp8", "tensorwise"], {}, None),
    "full-sr-ck1-ema": ("flux-dev", 512, FULL_SR_CK1, {"ema": {"decay": 0.9999, "dtype": "bf16"}}, None),
    "cpu-smoke-fit": ("flux-tiny", 128, ["--fit", "--gpu-memory", "8", "--host-memory", "16"], {}, None),
    # the LoRA rows as users on an 80 GB card get them from --fit (micro batch, stage and checkpointing its choice)
    "lora-fit-80gb": ("flux-dev", 512, FIT_LORA_80, {}, DEV_LORA),
    "lora-1024-fit-80gb": ("flux-dev", 1024, [*FIT_LORA_80, "--resolution", "1024"], {}, DEV_LORA),
    # --fit on an 80 GB card told the micro batches: what it checkpoints is its own choice
    "lora-fit-mb4": ("flux-dev", 512, [*FIT_LORA_80, "--micro-batch", "4"], {}, DEV_LORA),
    "lora-fit-mb1": ("flux-dev", 512, [*FIT_LORA_80, "--micro-batch", "1"], {}, DEV_LORA),
    "lora-1024-fit-mb1": ("flux-dev", 1024, [*FIT_LORA_80, "--resolution", "1024", "--micro-batch", "1"], {}, DEV_LORA),
}
PEER_LORA = ["--model", "flux-dev", "--zero", "2", "--ckpt", "1", "--compile", "1", "--lora-rank", "16"]
PEERS = {  # benchmarks/sweep.py arguments of the diffusers + DeepSpeed baseline (--compile 1: compiled blocks)
    "peer:lite-ckpt0": ["--model", "flux-dev-lite", "--zero", "2", "--ckpt", "0", "--mb", "16", "--compile", "1"],
    "peer:lite-ckpt1": ["--model", "flux-dev-lite", "--zero", "2", "--ckpt", "1", "--mb", "16", "--compile", "1"],
    "peer:lite-ckpt1-mb8": ["--model", "flux-dev-lite", "--zero", "2", "--ckpt", "1", "--mb", "8", "--compile", "1"],
    # issue 22 target 2's other bar: 1.3x the eager peer
    "peer:lite-ckpt1-eager": ["--model", "flux-dev-lite", "--zero", "2", "--ckpt", "1", "--mb", "16", "--compile", "0"],
    # the compiled PEFT peer of the LoRA rows (rank 16 on all linears), every block checkpointed as they are
    "peer:lora-mb4": [*PEER_LORA, "--mb", "4"],
    "peer:lora-mb1": [*PEER_LORA, "--mb", "1"],
    "peer:lora-1024-mb1": [*PEER_LORA, "--mb", "1", "--res", "1024"],
    # the same peer without gradient checkpointing, where the card holds it: the peer's own best on that card
    "peer:lora-mb4-ckpt0": [*PEER_LORA, "--mb", "4", "--ckpt", "0"],
    "peer:lora-mb1-ckpt0": [*PEER_LORA, "--mb", "1", "--ckpt", "0"],
    "peer:lora-1024-mb1-ckpt0": [*PEER_LORA, "--mb", "1", "--res", "1024", "--ckpt", "0"],
    # the peer's code path on the CPU, flux-tiny (tests/benchmarks/test_defaults_speed.py)
    "peer:cpu-smoke-eager": ["--model", "flux-tiny", "--zero", "2", "--ckpt", "0", "--mb", "1", "--compile", "0"]
    + ["--res", "64", "--device", "cpu"],
}
SETS = {
    "lite": ["lite-ckpt1-old", "lite-ckpt1", "lite-ckpt1-fp8", "lite-ckpt0", "lite-ckpt0-fp8", "peer:lite-ckpt0"],
    "lora": ["lora-mb4", "lora-mb4-fp8", "lora-mb1", "lora-mb1-fp8"],
    "adapters": ["lora-mb4", "dora-mb4", "lokr-mb4"],
    # the LoRA speed targets: each row beside its PEFT peer, then --fit's own choices on an 80 GB card
    "lora-peer": ["lora-mb4", "peer:lora-mb4", "lora-mb1", "peer:lora-mb1", "lora-1024-mb1", "peer:lora-1024-mb1"],
    "lora-fit": ["lora-fit-80gb", "lora-1024-fit-80gb"],
    # --fit at the issue's micro batches beside the peer checkpointed (as diffusers' examples run it) and not
    "lora-fit-peer": [
        "lora-1024-fit-mb1",
        "peer:lora-1024-mb1",
        "peer:lora-1024-mb1-ckpt0",
        "lora-fit-mb4",
        "peer:lora-mb4",
        "peer:lora-mb4-ckpt0",
        "lora-fit-mb1",
        "peer:lora-mb1",
        "peer:lora-mb1-ckpt0",
    ],
    # selective checkpointing against full and none: flux-dev-lite at micro batch 16, the LoRA at 512 px mb 4 and
    # 1024 px mb 1 (compiled blocks, as gen-config writes them below ZeRO-3)
    "policy": [
        "lite-ckpt0",
        "lite-ckpt1",
        "lite-ckpt1-sel",
        "lora-mb4-ckpt0",
        "lora-mb4",
        "lora-mb4-sel",
        "lora-1024-mb1-ckpt0",
        "lora-1024-mb1",
        "lora-1024-mb1-sel",
    ],
}

SITECUSTOMIZE = """import os
cap = os.environ.get("FLUXZERO_BENCH_MEMORY_CAP_GIB")
if cap:
    import torch
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(cap) * 1024**3 / total))
"""


def measured_peak_tflops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(times) / 1e12


def _rss_gib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1024**3
    except OSError:
        return None
    return None


def gen_config_args(name: str) -> list[str]:
    """`fluxzero gen-config`'s arguments for case `name` (its -o excepted)."""
    model, _, gen_args, _, _ = CASES[name]
    if "--fit" in gen_args:
        base = ["--model", model, "--world-size", "1"]
    else:
        base = [
            "--preset",
            "zero2",
            "--model",
            model,
            *([] if "--micro-batch" in gen_args else ["--micro-batch", "16"]),
        ]
    return [*base, *gen_args]


def run_case(name: str, work: Path, rows: int, timeout: float, cap: float | None, peak: float | None) -> dict:
    model, res, gen_args, keys, lora = CASES[name]
    work.mkdir(parents=True, exist_ok=True)
    ds = work / "ds.json"
    gen = subprocess.run(
        [sys.executable, "-m", "fluxzero.cli", "gen-config", *gen_config_args(name), "-o", str(ds)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if gen.returncode:
        return {"case": name, "status": "gen-config failed", "error": gen.stderr.strip().splitlines()[-1:]}
    lat, txt, ctx, vec = res // 8, 512, 4096, 768
    if model == "flux-tiny":
        txt, ctx, vec = 16, 64, 32
    mb = json.loads(ds.read_text())["train_micro_batch_size_per_gpu"]
    run = {
        "deepspeed": str(ds),
        "data": f"synthetic:n={max(64, mb * (rows + 4))},hw={lat}x{lat},txt={txt},ctx={ctx},vec={vec}",
        "output_dir": str(work / "out"),
        "model": model,
        "steps": 100000,
        "log_every": 1,
        "export": {"format": None},
        "attention": "flash" if _cuda() else "auto",
        **keys,
    }
    if lora:
        run["lora"] = lora
    (work / "run.yaml").write_text(json.dumps(run))  # JSON is YAML
    site = work / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    # the cap's sitecustomize only when capped: it would shadow one the Python installation may have
    path = os.pathsep.join([*([str(site)] if cap else []), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "FLUXZERO_NO_PROGRESS": "1", "PYTHONUNBUFFERED": "1"}
    if cap:
        env["FLUXZERO_BENCH_MEMORY_CAP_GIB"] = str(cap)
    log = open(work / "train.log", "w")
    t0 = time.monotonic()
    p = runner.start(
        [sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(work / "run.yaml")], log=log, env=env
    )
    metrics, got, rss = work / "out" / "metrics.jsonl", [], None
    while time.monotonic() - t0 < timeout and p.poll() is None:
        time.sleep(1)
        if metrics.is_file():
            got = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if len(got) >= rows:
            break
    rss = _rss_gib(p.pid)
    if p.poll() is None:
        runner.kill_group(p)
    p.wait()
    log.close()
    wall = time.monotonic() - t0
    tail = (work / "train.log").read_text(errors="replace").strip().splitlines()[-3:]
    row = {
        "case": name,
        "model": model,
        "res": res,
        "micro_batch": mb,
        "gen_config": gen_args,
        "run_keys": keys,
        "lora": lora,
        "memory_cap_gib": cap,
        "wall_s": round(wall, 1),
        "steps_logged": len(got),
        "host_rss_gib": rss,
    }
    if len(got) <= 3:
        return {**row, "status": "failed" if p.returncode not in (None, -9) else "too few steps", "log_tail": tail}
    after = got[3:]
    sps = statistics.median(r["samples_per_s"] for r in after)
    flops = statistics.median(r.get("mfu") or 0 for r in after)
    row.update(
        status="ok",
        samples_per_s=round(sps, 3),
        step_s=round(statistics.median(r["step_time_s"] for r in after), 4),
        step_s_all=[round(r["step_time_s"], 4) for r in got],  # every logged step: the spread behind the median
        peak_allocated_gb=max(r["peak_memory_gb"] for r in got),
        mfu_datasheet=flops,
        losses=[round(r["loss"], 4) for r in got],
        skipped_steps=got[-1]["skipped_steps"],
        grad_norm_last=got[-1].get("grad_norm"),
    )
    if peak and flops:
        import torch

        from fluxzero.train.metrics import peak_flops  # the datasheet figure the trainer's mfu used

        sheet = peak_flops(torch.device("cuda"), torch.bfloat16)
        row["mfu_measured_peak"] = round(flops * sheet / (peak * 1e12), 4) if sheet else None
    return row


def run_peer(name: str, work: Path, timeout: float) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    out = work / "peer.jsonl"
    cmd = [
        sys.executable,
        str(HERE / "sweep.py"),
        "--impl",
        "diffusers",
        "--res",
        "512",  # unless the case says otherwise: the last --res counts
        *PEERS[name],
        "--workers",
        "auto",  # the trainer's loader workers, as the fluxzero rows' launch/train.py takes them
        "--warmup",
        "3",
        "--steps",
        "5",
        "--timeout",
        str(int(timeout)),
        "--name",
        "peer",
        "--out",
        str(work),
    ]
    t0 = time.monotonic()
    p = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout + 60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    rows = [json.loads(line) for f in work.glob("*.jsonl") for line in f.read_text().splitlines() if line.strip()]
    row = {"case": name, "wall_s": round(time.monotonic() - t0, 1), "sweep_args": PEERS[name]}
    if rows and "samples_per_s" in rows[-1]:
        r = rows[-1]
        row.update(
            status=r.get("status", "ok"),
            samples_per_s=round(r["samples_per_s"], 3),
            mfu_measured_peak=r.get("mfu"),
            peak_allocated_gb=_sweep_peak_gb(r),
            # the step's wait for its batch (prefetched as the trainer does: near 0 unless the data path is slow)
            data_s=r.get("data_s"),
            step_s=r.get("step_s"),
        )
    else:
        row.update(status="failed", log_tail=(p.stdout + p.stderr).strip().splitlines()[-3:])
    del out
    return row


def _sweep_peak_gb(row: dict) -> float | None:
    """The largest rank's peak allocated memory of a sweep row (peak_alloc_gib, one value per rank) in GB, as the
    trainer's rows give theirs; None off CUDA. (Peer rows read other keys before 2026-12-05 and recorded None.)"""
    peaks = [x for x in row.get("peak_alloc_gib") or [] if x is not None]
    return round(max(peaks) * 2**30 / 1e9, 3) if peaks else None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv=None) -> int:
    ap = runner.parser(__doc__)
    ap.add_argument(
        "--cases",
        required=True,
        help=f"comma-separated case names or sets ({', '.join(SETS)}); cases: {', '.join([*CASES, *PEERS])}",
    )
    runner.add_out(ap, None, "JSON lines file (appended)", required=True)
    ap.add_argument("--rows", type=int, default=8, help="metrics rows (steps) to wait for per case")
    runner.add_timeout(ap, 150)
    ap.add_argument("--memory-cap-gib", type=float, default=None)
    a = ap.parse_args(argv)
    names = [n for part in a.cases.split(",") for n in SETS.get(part, [part])]
    unknown = [n for n in names if n not in CASES and n not in PEERS]
    if unknown:
        ap.error(f"unknown cases {unknown}")
    peak = measured_peak_tflops()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in names:
            work = Path(tmp) / n.replace(":", "-")
            row = (
                run_peer(n, work, a.timeout)
                if n in PEERS
                else run_case(n, work, a.rows, a.timeout, a.memory_cap_gib, peak)
            )
            row.update(measured_peak_tflops=peak, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
            results.append(row)
            runner.append_row(out, row)
            print(
                f"{n}: {row.get('status')} {row.get('samples_per_s', '')} samples/s "
                f"peak {row.get('peak_allocated_gb', '')} GB {row.get('log_tail', '')}",
                flush=True,
            )
    print(f"\nmeasured bf16 matmul peak: {peak and round(peak)} TFLOP/s")
    print("| case | samples/s | MFU (measured peak) | peak alloc GB | host RSS GiB | wall s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        mfu = r.get("mfu_measured_peak")
        print(
            f"| {r['case']} | {r.get('samples_per_s', r.get('status'))} | "
            f"{'' if mfu is None else f'{100 * mfu:.1f}%'} | {r.get('peak_allocated_gb', '')} | "
            f"{'' if r.get('host_rss_gib') is None else round(r['host_rss_gib'], 1)} | {r['wall_s']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
