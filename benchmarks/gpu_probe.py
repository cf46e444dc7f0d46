"""First look at a GPU machine: versions, the bf16 matmul ceiling, SDPA backends on FLUX-shaped attention,
and what DeepSpeed's fused optimizers cost to build there.

    PYTHONPATH=. python3 benchmarks/gpu_probe.py

Writes $OUT/gpu_probe.json (or ./gpu_probe.json) and prints a short table.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch


def matmul_peak(n: int = 8192, reps: int = 20) -> float:
    """bf16 dense matmul TFLOP/s on random data (median of reps, CUDA events)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return 2 * n**3 / times[len(times) // 2] / 1e12


def sdpa_check(backend_name: str) -> dict:
    """Forward+backward of one FLUX-shaped attention (512 px: 1536 tokens, 24 heads of 128) under one backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    torch.manual_seed(0)
    out = {"backend": backend_name}
    try:
        q, k, v = (torch.randn(4, 24, 1536, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        with sdpa_kernel([backend]):
            for _ in range(3):
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
                o.float().square().mean().backward()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(10):
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
                o.float().square().mean().backward()
            e.record()
            e.synchronize()
        out["ms_fwd_bwd"] = s.elapsed_time(e) / 10
        out["grads_finite"] = bool(all(torch.isfinite(t.grad).all() for t in (q, k, v)))
    except Exception as exc:  # report, don't stop the probe
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def timed_build(code: str, timeout: int = 300) -> dict:
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
        return {"seconds": round(time.time() - t0, 1), "rc": p.returncode, "tail": (p.stdout + p.stderr)[-400:]}
    except subprocess.TimeoutExpired:
        return {"seconds": timeout, "rc": "timeout"}


def main():
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }
    try:
        import deepspeed

        res["deepspeed"] = deepspeed.__version__
    except Exception as exc:
        res["deepspeed"] = f"import failed: {exc}"
    res["bf16_matmul_tflops"] = round(matmul_peak(), 1)
    res["sdpa"] = [sdpa_check(b) for b in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")]
    res["fused_adam_build"] = timed_build(
        "import torch, deepspeed; from deepspeed.ops.adam import FusedAdam; "
        "p=torch.nn.Parameter(torch.randn(10,device='cuda')); o=FusedAdam([p]); p.grad=torch.ones_like(p); o.step(); print('ok')"
    )
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "gpu_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
