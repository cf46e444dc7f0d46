"""Refit the memory model's fragmentation fractions (fluxzero/plan/breakdown.py, Estimate.fragmentation) on the
committed H200 runs, each regime fitted on some runs and checked on runs held out.

    PYTHONPATH=. python benchmarks/fragmentation_fit.py

Reserved = resident + (allocated peak - resident) x (1 + f). For each regime f is the value that minimises the
largest relative error of the predicted reserved memory over the fit runs (predicted allocations as the model
gives them, measured reserved from torch.cuda.max_memory_reserved); the held-out runs are then only checked.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mvg", ROOT / "benchmarks" / "memory_vs_gpu.py")
mvg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mvg)
from fluxzero import plan as memory  # noqa: E402

DEC = ROOT / "benchmarks" / "results" / "2026-12-h200"
# regime -> (fit runs, held-out runs) as (set, index)
REGIMES = {
    # 512 px runs fit, the 1024 px ones are held out
    "stage 0": ([("lite1", i) for i in (1, 2, 3, 7, 8, 9, 15)] + [("lite_after", 1)], [("lite1", 4), ("lite1", 10)]),
    # the two ends (every block checkpointed at micro batch 1, none at 16) fit, the four between are held out
    "stage 1-2": ([("lite_z2", 1), ("lite_z2", 6)], [("lite_z2", i) for i in (2, 3, 4, 5)]),
    # flux-dev-lite on one GPU fits; two GPUs and flux-dev are held out
    "stage 3": (
        [("lite1", i) for i in (11, 12, 13, 14)],
        [("scale", 1), ("scale", 2), ("dev2", 1), ("dev2", 2), ("dev2", 4), ("dev2b", 1), ("dev2c", 1)],
    ),
}


def all_rows() -> dict:
    rows = mvg.rows() + mvg.rows(DEC, ("lite_z2",))
    return {(r["set"], r["index"]): r for r in rows if r["impl"] == "fluxzero" and r["status"] == "ok"}


def measured_reserved(row: dict) -> float:
    return mvg.compare(row)["meas_reserved"]


def error(row: dict, f: float) -> float:
    spec = dataclasses.replace(mvg.spec_for(row), fragmentation=f)
    return memory.estimate(spec).gpu_reserved / memory.GiB / measured_reserved(row) - 1


def fit(runs: list[dict]) -> float:
    grid = [i / 100 for i in range(0, 151)]
    return min(grid, key=lambda f: max(abs(error(r, f)) for r in runs))


def main() -> None:
    rows = all_rows()
    out = {}
    for regime, (fit_keys, held_keys) in REGIMES.items():
        f = fit([rows[k] for k in fit_keys])
        errs = {f"{s}#{i}": round(error(rows[(s, i)], f), 4) for s, i in fit_keys + held_keys}
        out[regime] = {
            "f": f,
            "fit": [f"{s}#{i}" for s, i in fit_keys],
            "held_out": [f"{s}#{i}" for s, i in held_keys],
            "errors": errs,
        }
        held = [errs[f"{s}#{i}"] for s, i in held_keys]
        print(
            f"{regime}: f = {f:.2f} (fit on {', '.join(out[regime]['fit'])}); held-out errors "
            f"{min(held):+.1%} .. {max(held):+.1%}"
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
