"""NCCL bus bandwidth under fluxzero's NCCL profiles vs NCCL's defaults, on the GPUs of one node.

    PYTHONPATH=. python3 benchmarks/nccl_profiles.py            # 2 GPUs, < 3 min, JSON to $OUT
    PYTHONPATH=. python3 benchmarks/nccl_profiles.py --cpu-smoke # gloo on CPU, tiny sizes: checks the script only

Each configuration runs in a fresh `torch.distributed.run` job, because NCCL reads its environment once, at
communicator init. NCCL_NVLS_ENABLE=0 in every run (project rule); inherited NCCL_* variables are dropped so
every run sees exactly its own settings.

Collectives and sizes are ZeRO-3's: all-gather of bf16 parameters and reduce-scatter of bf16 gradients at
DeepSpeed-like bucket sizes (50 MB; 500 MB), all-reduce for comparison (ZeRO-1/2 and DDP), plus 1 MB where
latency dominates and the LL/LL128 protocols matter. S below is the full (unsharded) tensor size in bytes.

Bus bandwidth as in nccl-tests, so numbers compare with the link speed whatever the rank count n:
    all-reduce      busbw = S / t * 2 (n - 1) / n   (reduce-scatter + all-gather; each rank moves 2 (n-1)/n S)
    reduce-scatter  busbw = S / t * (n - 1) / n     (input S per rank, output S / n)
    all-gather      busbw = S / t * (n - 1) / n     (input S / n per rank, output S)

Configurations:
    default              NCCL chooses everything (profile `default`; `nvlink-single-node` sets the same)
    ring-simple          profile `ring-simple`: NCCL_ALGO=Ring NCCL_PROTO=Simple forced
    ring-ll128           NCCL_ALGO=Ring NCCL_PROTO=LL128 forced
    proto-ll             NCCL_PROTO=LL forced (the low-latency protocol at every size)
    debug                profile `debug` (NCCL_DEBUG=INFO, INIT/NET/ENV): what logging costs
    tcp-default          P2P and SHM off, IB off, sockets over loopback: NCCL's socket transport, 1x1 threads
    tcp-ethernet         the same with profile `ethernet` (4 threads x 4 sockets)
The two tcp-* runs move data through the kernel's loopback, not a NIC: they show what the socket
threading settings change in NCCL's socket transport, not a cluster's Ethernet bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fluxzero.cluster.nccl import profile_env  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runner, also when this file is loaded by path
import runner  # noqa: E402

SIZES_MB = (1, 50, 500)
OPS = ("all_reduce", "reduce_scatter", "all_gather")
TCP = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"}
CONFIGS = {
    "default": profile_env("default"),
    "ring-simple": profile_env("ring-simple"),
    "ring-ll128": {**profile_env("default"), "NCCL_ALGO": "Ring", "NCCL_PROTO": "LL128"},
    "proto-ll": {**profile_env("default"), "NCCL_PROTO": "LL"},
    "debug": profile_env("debug"),
    "tcp-default": {**profile_env("default"), **TCP},
    "tcp-ethernet": {**profile_env("ethernet"), **TCP},
}
BUDGET_S = 170  # stop starting new configurations after this (the whole script must stay under 3 minutes)


# ------------------------------------------------------------------------------------------------ worker (per rank)


def worker(out_path: str, sizes_mb: list[float], cpu: bool, time_per_point: float) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cpu:
        dist.init_process_group("gloo")
        device, dtype = torch.device("cpu"), torch.float32
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        dtype = torch.bfloat16

    def sync():
        if not cpu:
            torch.cuda.synchronize()

    def timed(fn, iters):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        return (time.perf_counter() - t0) / iters

    results = []
    elem = torch.tensor([], dtype=dtype).element_size()
    for size_mb in sizes_mb:
        n = int(size_mb * 1e6) // elem // world * world  # divisible by the rank count
        # zeros: repeated in-place sums stay finite (speed does not depend on the values)
        full = torch.zeros(n, dtype=dtype, device=device)
        shard = torch.zeros(n // world, dtype=dtype, device=device)
        calls = {
            # default arguments bind this size's buffers (the names are deleted at the end of the iteration)
            "all_reduce": (lambda full=full: dist.all_reduce(full), 2 * (world - 1) / world),
            "reduce_scatter": (
                lambda full=full, shard=shard: dist.reduce_scatter_tensor(shard, full),
                (world - 1) / world,
            ),
            "all_gather": (
                lambda full=full, shard=shard: dist.all_gather_into_tensor(full, shard),
                (world - 1) / world,
            ),
        }
        for op in OPS:
            fn, factor = calls[op]
            first = timed(fn, 2)  # warm-up: connections and buffers are set up lazily
            iters = max(3, min(50, int(time_per_point / max(first, 1e-6))))
            # the same iteration count on every rank, or the collectives would not pair up
            t = torch.tensor([iters], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            sec = timed(fn, int(t.item()))
            nbytes = n * elem
            results.append(
                {
                    "op": op,
                    "size_mb": nbytes / 1e6,
                    "time_us": sec * 1e6,
                    "algbw_gbs": nbytes / sec / 1e9,
                    "busbw_gbs": nbytes / sec / 1e9 * factor,
                    "iters": int(t.item()),
                }
            )
        del full, shard
    meta = {"world_size": world, "torch": torch.__version__}
    if not cpu:
        meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        meta["gpu"] = torch.cuda.get_device_name(device)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"meta": meta, "results": results}))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ driver


def run_config(
    name: str,
    env_vars: dict,
    nproc: int,
    sizes: list[float],
    cpu: bool,
    tmp: Path,
    time_per_point: float,
    timeout: float,
) -> dict:
    assert env_vars.get("NCCL_NVLS_ENABLE") == "0"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    env.update(env_vars)
    env["OMP_NUM_THREADS"] = "1"
    out = tmp / f"{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(Path(__file__).resolve()),
        "--worker",
        "--worker-out",
        str(out),
        "--sizes-mb",
        ",".join(map(str, sizes)),
        "--time-per-point",
        str(time_per_point),
    ]
    if cpu:
        cmd.append("--cpu-smoke")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"name": name, "env": env_vars, "error": f"timed out after {timeout:.0f} s"}
    wall = time.monotonic() - t0
    log = (proc.stdout + proc.stderr)[-4000:]
    if proc.returncode != 0 or not out.exists():
        return {"name": name, "env": env_vars, "error": f"exit {proc.returncode}", "log_tail": log, "wall_s": wall}
    data = json.loads(out.read_text())
    rec = {"name": name, "env": env_vars, "wall_s": wall, **data}
    if name == "debug":
        rec["nccl_info"] = [line for line in (proc.stdout + proc.stderr).splitlines() if "NCCL INFO" in line][:60]
    return rec


def table(records: list[dict]) -> str:
    base = {}
    for rec in records:
        if rec["name"] == "default" and "results" in rec:
            base = {(r["op"], round(r["size_mb"], 3)): r["busbw_gbs"] for r in rec["results"]}
    lines = [f"{'config':<14} {'op':<15} {'size MB':>8} {'busbw GB/s':>11} {'vs default':>11} {'time us':>10}"]
    for rec in records:
        if "results" not in rec:
            lines.append(f"{rec['name']:<14} {rec.get('error', 'skipped')}")
            continue
        for r in rec["results"]:
            ref = base.get((r["op"], round(r["size_mb"], 3)))
            rel = f"{100 * (r['busbw_gbs'] / ref - 1):+.0f}%" if ref else "-"
            lines.append(
                f"{rec['name']:<14} {r['op']:<15} {r['size_mb']:>8.3g} {r['busbw_gbs']:>11.1f} "
                f"{rel:>11} {r['time_us']:>10.0f}"
            )
    return "\n".join(lines)


def main() -> int:
    p = runner.parser(__doc__, raw=True)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU with tiny sizes (checks the script)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (GPUs) per run")
    p.add_argument("--sizes-mb", default=",".join(map(str, SIZES_MB)))
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    p.add_argument("--time-per-point", type=float, default=0.25, help="seconds of timed iterations per point")
    a = p.parse_args()
    sizes = [float(s) for s in a.sizes_mb.split(",")]
    if a.worker:
        worker(a.worker_out, sizes, a.cpu_smoke, a.time_per_point)
        return 0

    names = [c for c in a.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    if a.cpu_smoke:
        sizes, names = [0.1, 1.0], names[:2]
    else:
        import torch

        if torch.cuda.device_count() < a.nproc:
            print(f"needs {a.nproc} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
            return 1
    out_dir = runner.out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    records, t_start = [], time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            elapsed = time.monotonic() - t_start
            if elapsed > BUDGET_S:
                records.append({"name": name, "env": CONFIGS[name], "error": f"skipped: {elapsed:.0f} s budget used"})
                continue
            rec = run_config(
                name,
                CONFIGS[name],
                a.nproc,
                sizes,
                a.cpu_smoke,
                Path(tmp),
                a.time_per_point,
                timeout=min(90.0, BUDGET_S + 5 - elapsed),
            )
            records.append(rec)
            status = rec.get("error") or f"{rec['wall_s']:.0f} s"
            print(f"[{time.monotonic() - t_start:5.0f} s] {name}: {status}", flush=True)
    report = {
        "benchmark": "nccl_profiles",
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "sizes_mb": sizes,
        "total_s": time.monotonic() - t_start,
        "runs": records,
    }
    gpu = next((r["meta"].get("gpu", "cpu") for r in records if "meta" in r), "none")
    fname = out_dir / f"nccl_profiles_{gpu.replace(' ', '-')}_x{a.nproc}_{time.strftime('%Y-%m')}.json"
    fname.write_text(json.dumps(report, indent=1))
    print(table(records))
    print(f"wrote {fname} ({report['total_s']:.0f} s)")
    return 0 if all("results" in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
