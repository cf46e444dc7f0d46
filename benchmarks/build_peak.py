"""Peak host memory of building the trainer's engine on CPU, in bytes per model parameter.

Each case runs in a fresh one-rank process (gloo): the rank's resident set is read, its high-water mark reset
(Linux: `5` into /proc/self/clear_refs), then `engine.build_engine` builds the model and deepspeed.initialize
wraps it, as launch/train.py does. The rise of the high-water mark over the resident set before is the build's
peak, what stays resident after it is what the build holds. peft and torchao are imported first (~150 MB of
modules that are no part of a build); large tensors are mmap-allocated and returned when freed (measure() says
why), so a float32 copy that lived only during the build still shows in the peak. Cases: `lora` (rank 16,
attention+mlp, the frozen base in the training dtype), `lora-int8` / `lora-fp8` (the base's block linears
quantized, lora.base_quant), `full` (full fine-tune), `model` (fluxzero.model.build_model alone, in the
precision's dtype); each at ZeRO-2 in bf16 unless --precision / --zero-stage say otherwise. With --weights
(LAYOUT: bfl or diffusers) the build loads pretrained weights, a bf16 file of that layout the child writes
before the measurement; the pages of that memory-mapped file count in the resident set although the kernel can
drop them at any time, so each row also gives the peak of the anonymous resident set (RssAnon, sampled every
millisecond by a thread): what loading holds beyond the model.

    python benchmarks/build_peak.py [--model 'flux-dev:depth=1,depth_single_blocks=2'] [--cases lora,full]
        [--weights bfl|diffusers] [--root CHECKOUT]   # another checkout's fluxzero, e.g. the code before a change, measured the same way
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runner, also when this file is loaded by path
import runner  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = ("model", "lora", "lora-int8", "lora-fp8", "full")

CHILD = r"""
import importlib, json, os, socket, sys, tempfile, threading, time
root, spec, case, precision, stage = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
layout = sys.argv[6] or None
sys.path.insert(0, root)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
import warnings; warnings.filterwarnings("ignore")
import torch, deepspeed
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
from fluxzero.config.models import resolve_model
from fluxzero.config.deepspeed.view import view
from fluxzero.config.lora import LoraConfig
from fluxzero.model import build_model
from fluxzero.train import engine as E
torch.set_num_threads(1)
import peft, torchao.quantization  # noqa: F401 - imported before the measurement: their import is no part of a build

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

cfg = resolve_model(spec)
ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
      "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
if precision == "bf16":
    ds["bf16"] = {"enabled": True}
lora = None
if case.startswith("lora"):
    quant = case.split("-")[1] if "-" in case else None
    lora = LoraConfig(rank=16, **({"base_quant": quant} if quant else {}))
weights = None
if layout:  # a bf16 file of the model's shapes, written before the measurement
    from fluxzero.model.weights import save_weights
    weights = os.path.join(tempfile.mkdtemp(), "w.safetensors" if layout == "bfl" else "w")
    meta = build_model(cfg, device="meta").state_dict()
    save_weights({k: torch.full(v.shape, 0.01) for k, v in meta.items()}, weights, layout=layout,
                 dtype=torch.bfloat16, cfg=cfg)
    del meta
anon = [status("RssAnon")]
done = threading.Event()

def sample():  # RssAnon has no high-water mark of its own
    while not done.is_set():
        anon.append(status("RssAnon"))
        time.sleep(0.001)

before, anon_before = status("VmRSS"), anon[0]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current resident set
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
if case == "model":
    model = build_model(cfg, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
else:
    model = E.build_engine(cfg, ds, view(ds), torch.device("cpu"), seed=0, lora=lora, weights=weights).module
done.set()
sampler.join()
anon.append(status("RssAnon"))
peak, held, n = status("VmHWM") - before, status("VmRSS") - before, cfg.num_params()
peak_anon = max(anon) - anon_before
print(json.dumps({"case": case, "params": n, "weights": layout, "peak_bytes": peak,
                  "peak_bytes_per_param": round(peak / n, 3), "held_bytes_per_param": round(held / n, 3),
                  "peak_anon_bytes": peak_anon, "peak_anon_bytes_per_param": round(peak_anon / n, 3)}))
"""


def measure(
    case: str, spec: str, precision: str = "bf16", stage: int = 2, root: Path = ROOT, weights: str | None = None
) -> dict:
    """One case in a fresh process: {"case", "params", "weights", "peak_bytes", "peak_bytes_per_param",
    "held_bytes_per_param", "peak_anon_bytes", "peak_anon_bytes_per_param"} (held: the resident set after the
    build, over the one before; anon: the anonymous resident set, without the weights file's mapped pages).
    `weights`: None (random init) or the layout of a pretrained file to load (bfl, diffusers)."""
    # every allocation above 128 KiB mmap-ed and returned when freed: without it glibc raises its mmap threshold
    # as blocks are freed and keeps freed temporaries of varying sizes in its heap (measured: an int8 base then
    # read 3.0 bytes a parameter for 2.2 live), which says more about glibc than about what a GPU would hold
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), spec, case, precision, str(stage), weights or ""],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if out.returncode:
        raise RuntimeError(f"case {case} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = runner.parser(__doc__)
    ap.add_argument("--model", default="flux-dev:depth=1,depth_single_blocks=2")
    ap.add_argument("--cases", default="model,lora,lora-int8,full")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--weights", choices=("bfl", "diffusers"), help="load a pretrained file of this layout")
    ap.add_argument("--root", type=Path, default=ROOT)
    a = ap.parse_args(argv)
    for case in a.cases.split(","):
        if case not in CASES:
            ap.error(f"unknown case {case!r}; choose from {', '.join(CASES)}")
        row = {
            **measure(case, a.model, a.precision, a.zero_stage, a.root, a.weights),
            "model": a.model,
            "precision": a.precision,
            "zero_stage": a.zero_stage,
            "root": str(a.root),
        }
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
