"""Transient memory of one optimizer step of each optimizer mode, on one flat partition (as ZeRO 1-3 hand it).

Each mode runs in its own subprocess on CPU: a 1-D tensor of N elements in the mode's master dtype (bf16
for the bf16 modes, fp32 for "fp32") with its gradient, one untimed step (allocates the states), then the
peak resident set is reset (`echo 5 > /proc/self/clear_refs`, which resets VmHWM) and read after a second
step. Tensors this large are mmap-allocated and returned to the system when freed, so the rise of the peak
over the steady state is the step's transient working set. Where the reset is refused, the peak since the
process started (ru_maxrss) is read instead, an upper bound that includes the first step (and torch.compile).
Reported in bytes per partition element; the memory model's "optimizer working set at step" item
(each mode's step_temp in fluxzero/config/optim_modes.py) takes these figures per element of what is stepped at
once: a whole tensor, or for modes with a step_chunk (fluxzero.config.optim_modes) one chunk of it.
`--step-chunks 0 default` steps each such mode twice: whole (0, as before chunking) and in its chunks.

    python benchmarks/optim_step_memory.py [--numel 5e7] [--modes ...] [--step-chunks default] [--out DIR]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fluxzero.config.optim_modes import get_mode  # noqa: E402  (pure: no torch in this process)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runner, also when this file is loaded by path
import runner  # noqa: E402

CHILD = r"""
import gc, json, os, resource, sys, tempfile
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "fluxzero-inductor"))
import torch
sys.path.insert(0, sys.argv[3])
from fluxzero.config.optim_modes import get_mode
from fluxzero.train.optim.optimizers import build_optimizer
mode, n, chunk = sys.argv[1], int(float(sys.argv[2])), sys.argv[4]
dtype = torch.bfloat16 if get_mode(mode).master_dtype == "bf16" else torch.float32
p = torch.nn.Parameter((torch.randn(n) * 0.05).to(dtype))
p.grad = (torch.randn(n) * 1e-3).to(dtype)
opt = build_optimizer([p], mode, lr=1e-5, weight_decay=0.01)
if chunk != "default":
    opt.step_chunk = int(chunk) or None  # 0: the whole tensor at once
opt.step()
gc.collect()
def rss():  # current resident bytes
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def hwm():  # peak resident bytes since the last reset
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM"))
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    reset = True
except OSError:
    reset = False
before_peak = hwm() if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
steady = rss()
opt.step()
after_peak = hwm() if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"mode": mode, "numel": n, "step_chunk": getattr(opt, "step_chunk", None),
                  "steady_bytes": steady, "peak_before": before_peak, "peak_after": after_peak,
                  "transient_bytes": after_peak - steady, "transient_B_per_elem": (after_peak - steady) / n,
                  "peak_reset": reset, "peak_rose": after_peak > before_peak}))
"""


def main() -> None:
    ap = runner.parser(__doc__)
    ap.add_argument("--numel", type=float, default=5e7)
    ap.add_argument("--modes", nargs="*", default=["fp32", "bf16-sr", "bf16-kahan", "adamw8bit-sr", "adafactor-sr"])
    ap.add_argument(
        "--step-chunks",
        nargs="*",
        default=["default"],
        help="for modes with a step_chunk: 'default' (the registry's), 0 (whole tensor) or elements",
    )
    runner.add_out(ap, None, "folder for --file (default: print only)")
    ap.add_argument("--file", default="optim_step_memory.json", help="file name under --out")
    a = ap.parse_args()
    rows = []
    for mode in a.modes:
        for chunk in a.step_chunks if get_mode(mode).step_chunk else ["default"]:
            r = subprocess.run(
                [sys.executable, "-c", CHILD, mode, str(a.numel), str(ROOT), chunk],
                capture_output=True,
                text=True,
                timeout=900,
            )
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            if r.returncode or not line:
                rows.append({"mode": mode, "error": r.stderr[-500:]})
                print(f"{mode:<14} failed: {r.stderr[-300:]}")
                continue
            row = json.loads(line[-1])
            rows.append(row)
            print(
                f"{mode:<14} chunk {str(row['step_chunk']):<9} step transient {row['transient_bytes'] / 2**20:8.1f} "
                f"MiB = {row['transient_B_per_elem']:5.1f} B per element"
                + ("" if row["peak_reset"] else " (peak since start: an upper bound)")
            )
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        Path(a.out, a.file).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
