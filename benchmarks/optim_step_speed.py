"""Time of one optimizer step over a model's weights, per optimizer mode: where a full fine-tune's step goes.

    PYTHONPATH=. python3 benchmarks/optim_step_speed.py --model flux-dev --out $OUT/optim_step.jsonl   # one GPU
    PYTHONPATH=. python3 benchmarks/optim_step_speed.py --model flux-tiny --device cpu --out /tmp/o.jsonl

The weights are the model's own parameter shapes (built on the meta device, then real bf16 tensors of those
shapes, as at ZeRO 0 where shapes are kept), with random bf16 gradients. Each mode is built by the trainer's
`fluxzero.train.optim.optimizers.build_optimizer` (bf16-kahan also with `fused=False`: the eager path the CPU runs),
stepped twice to warm up (the first step allocates states and compiles), then timed: median of --steps steps,
the device synchronised around each. Bytes moved per element, the floor: bf16-kahan reads weight, grad, m, v,
carry and writes weight, m, v, carry (18 B); bf16-sr the same without the carry (14 B). One JSON line per mode.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from fluxzero.model.flux import build_model
from fluxzero.train.optim.optimizers import KahanAdamW, build_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runner, also when this file is loaded by path
import runner  # noqa: E402

FLOOR_BYTES = {"bf16-kahan": 18, "bf16-kahan-eager": 18, "bf16-sr": 14, "adamw8bit-sr": 10, "adafactor-sr": 8}


def weights(model: str, device: torch.device) -> list[torch.nn.Parameter]:
    meta = build_model(model, device="meta", dtype=torch.bfloat16)
    return [
        torch.nn.Parameter(torch.randn(p.shape, device=device, dtype=torch.bfloat16) * 0.02) for p in meta.parameters()
    ]


def time_mode(mode: str, params: list, steps: int, device: torch.device) -> dict:
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    if mode == "bf16-kahan-eager":
        opt = KahanAdamW(params, lr=1e-5, weight_decay=0.01, fused=False)
    else:
        opt = build_optimizer(params, mode, lr=1e-5, weight_decay=0.01)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(2 + steps):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in params)
    step = statistics.median(times)
    row = {
        "mode": mode,
        "elements": n,
        "tensors": len(params),
        "step_s": round(step, 4),
        "times_s": [round(t, 4) for t in times],
        "floor_gb_per_s": round(FLOOR_BYTES.get(mode, 0) * n / step / 1e9, 1),
    }
    if device.type == "cuda":
        row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del opt
    for p in params:
        p.grad = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return row


def main(argv=None) -> int:
    ap = runner.parser(__doc__)
    ap.add_argument("--model", default="flux-dev")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", default="bf16-kahan,bf16-kahan-eager,bf16-sr")
    ap.add_argument("--steps", type=int, default=5)
    runner.add_out(ap, None, "JSON lines file (appended)", required=True)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    params = weights(a.model, device)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in a.modes.split(","):
        try:
            row = time_mode(mode, params, a.steps, device)
        except Exception as e:  # noqa: BLE001 - one mode that fails (OOM, missing package) must not cost the others
            row = {"mode": mode, "error": f"{type(e).__name__}: {e}"[:300]}
        row.update(
            model=a.model,
            device=str(device),
            torch=torch.__version__,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        )
        rows.append(row)
        runner.append_row(out, row)
        print(json.dumps(row), flush=True)
    print("| mode | step s | GB/s at the floor's bytes |\n|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r.get('step_s', r.get('error'))} | {r.get('floor_gb_per_s', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
