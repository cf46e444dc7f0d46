"""Transient memory of one optimizer step of each optimizer mode, on one flat partition (as ZeRO 1-3 hand it).

Each mode runs in its own subprocess on CPU: a 1-D tensor of N elements in the mode's master dtype (bf16
for the bf16 modes, fp32 for "fp32") with its gradient, one untimed step (allocates the states), then the
process's peak resident set is read before and after a second step. Tensors this large are mmap-allocated
and returned to the system when freed, so the rise of the peak RSS (ru_maxrss) over the steady state is
the step's transient working set. Reported in bytes per partition element; the memory model's "optimizer
working set at step" item (fluxzero/config/memory.py, MODE_STEP_TEMP) takes these figures.

    python benchmarks/optim_step_memory.py [--numel 5e7] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import gc, json, os, resource, sys, tempfile
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "fluxzero-inductor"))
import torch
sys.path.insert(0, sys.argv[3])
from fluxzero.config.optim_modes import get_mode
from fluxzero.train.optim import build_optimizer
mode, n = sys.argv[1], int(float(sys.argv[2]))
dtype = torch.bfloat16 if get_mode(mode).master_dtype == "bf16" else torch.float32
p = torch.nn.Parameter((torch.randn(n) * 0.05).to(dtype))
p.grad = (torch.randn(n) * 1e-3).to(dtype)
opt = build_optimizer([p], mode, lr=1e-5, weight_decay=0.01)
opt.step()
gc.collect()
def rss():  # current resident bytes
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
steady = rss()
opt.step()
after_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"mode": mode, "numel": n, "steady_bytes": steady, "peak_before": before_peak,
                  "peak_after": after_peak, "transient_B_per_elem": (after_peak - max(steady, 0)) / n,
                  "peak_rose": after_peak > before_peak}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=float, default=5e7)
    ap.add_argument("--modes", nargs="*", default=["fp32", "bf16-sr", "bf16-kahan", "adamw8bit-sr", "adafactor-sr"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for mode in a.modes:
        r = subprocess.run([sys.executable, "-c", CHILD, mode, str(a.numel), str(ROOT)], capture_output=True,
                           text=True, timeout=900)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode or not line:
            rows.append({"mode": mode, "error": r.stderr[-500:]})
            print(f"{mode:<14} failed: {r.stderr[-300:]}")
            continue
        row = json.loads(line[-1])
        rows.append(row)
        print(f"{mode:<14} step transient {row['transient_B_per_elem']:6.1f} B per element"
              + ("" if row["peak_rose"] else " (peak did not rise: the first step's peak was higher)"))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        Path(a.out, "optim_step_memory.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
