"""Wall time of `fluxzero gen-config` (and check-config's own checks), median of N fresh processes.

Target: <= 0.3 s on the 2-core CI machine. Each run is a new interpreter, as a user or a launcher script
would start it, so the figure includes Python start-up and every import gen-config makes.

    python benchmarks/gen_config_speed.py [--runs 21]

Prints a markdown table; writes JSON to $OUT/gen_config_speed.json when OUT is set.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runner, also when this file is loaded by path
import runner  # noqa: E402


def timed(cmd: list[str], runs: int) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds user+sys) per run. CPU time barely moves when other work loads the machine;
    wall time is what the target is about."""
    subprocess.run(cmd, check=True, capture_output=True)  # warm the page cache once
    walls, cpus = [], []
    for _ in range(runs):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        walls.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
    return walls, cpus


def main() -> None:
    ap = runner.parser(__doc__)
    ap.add_argument("--runs", type=int, default=21)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp()
    out_json = os.path.join(tmp, "ds.json")
    exe = shutil.which("fluxzero") or os.path.join(os.path.dirname(sys.executable), "fluxzero")
    gen_args = [
        "gen-config",
        "--preset",
        "zero3-offload",
        "--world-size",
        "8",
        "--micro-batch",
        "2",
        "--global-batch",
        "64",
        "-o",
        out_json,
    ]
    cases = {
        "python -c pass (interpreter floor)": [sys.executable, "-c", "pass"],
        "python -m fluxzero.cli gen-config": [sys.executable, "-m", "fluxzero.cli", *gen_args],
        "check-config --no-deepspeed": [
            sys.executable,
            "-m",
            "fluxzero.cli",
            "check-config",
            out_json,
            "--world-size",
            "8",
            "--no-deepspeed",
        ],
    }
    if os.path.exists(exe):
        cases["fluxzero gen-config (console script)"] = [exe, *gen_args]
    results = {}
    for name, cmd in cases.items():
        if "check-config" in name and not os.path.exists(out_json):
            subprocess.run(cases["python -m fluxzero.cli gen-config"], check=True, capture_output=True)
        t, c = timed(cmd, args.runs)
        results[name] = {
            "median_s": statistics.median(t),
            "min_s": min(t),
            "max_s": max(t),
            "median_cpu_s": statistics.median(c),
            "runs": len(t),
        }

    info = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "results": results,
        # other work on the machine inflates every row alike; compare with the interpreter floor
        "load_average_1m": os.getloadavg()[0],
    }
    print(f"load average (1 min) {info['load_average_1m']:.2f}")
    print(f"| command ({args.runs} runs, {info['machine']}) | median wall s | min wall s | max wall s | median CPU s |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} | {r['median_cpu_s']:.3f} |")
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "gen_config_speed.json"), "w") as f:
            json.dump(info, f, indent=2)


if __name__ == "__main__":
    main()
