"""One optimizer-offload step on this machine's CPU: torch.optim.AdamW (what gen-config writes with
`"torch_adam": true`, fused and foreach) against DeepSpeedCPUAdam (`--adam-impl cpu`), and the host optimizer modes
(cpu-bf16-sr, cpu-adamw8bit-sr: fluxzero.train.optim.host.HostAdamW on a bf16 copy of the partition), each with
its compiled chunk kernel and with its eager fallback (two rows; the compile happens in the untimed first step,
reported as first_step_s).

What ZeRO-Offload's CPU step does, on one flat fp32 partition of N parameters (its gradient filled in, as
the reduced gradients arrive in pinned host memory): one `optimizer.step()`. Each optimizer takes one
untimed step first (state allocation; DeepSpeedCPUAdam's JIT build, ~2 minutes the first time, happens at
construction and is timed apart), then the median of --steps timed steps.

    python benchmarks/cpu_adam_speed.py --params 250e6 --steps 3 --out $OUT [--no-deepspeed] [--chunk 65536]

Writes cpu_adam_<host CPU count>cpu.json under --out. The ratio holds for the machine it ran on: a 2-core
development machine says little about a GPU host's many-core CPUs (DeepSpeedCPUAdam's AVX kernel and
torch's fused kernel both scale with cores and memory bandwidth, not necessarily alike).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runner, also when this file is loaded by path
import runner  # noqa: E402


def step_times(opt, params, steps: int) -> list[float]:
    opt.step()  # untimed: allocates exp_avg / exp_avg_sq
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = runner.parser(__doc__)
    ap.add_argument("--params", type=float, default=250e6, help="fp32 parameters in the flat partition")
    ap.add_argument("--steps", type=int, default=3)
    runner.add_out(ap, "", "folder for cpu_adam_<CPU count>cpu.json")
    ap.add_argument("--chunk", type=float, default=0, help="HostAdamW's elements per chunk (0: HOST_STEP_CHUNK)")
    ap.add_argument("--no-deepspeed", action="store_true", help="leave out DeepSpeedCPUAdam (and its JIT build)")
    a = ap.parse_args()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))
    import torch

    n = int(a.params)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n) * 0.02)
    p.grad = torch.randn(n) * 1e-3
    kw = dict(lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    rows = {}
    for name, make in (
        ("torch AdamW(fused=True)", lambda: torch.optim.AdamW([p], fused=True, **kw)),
        ("torch AdamW(foreach=True)", lambda: torch.optim.AdamW([p], foreach=True, **kw)),
    ):
        opt = make()
        times = step_times(opt, [p], a.steps)
        rows[name] = {"median_s": statistics.median(times), "times_s": times}
        print(f"{name:<44} {statistics.median(times):7.3f} s / step", flush=True)
        del opt
    from fluxzero.train.optim.optimizers import OptimModeError, build_optimizer

    pb = torch.nn.Parameter(p.detach().bfloat16())  # the host modes step bf16 masters and gradients
    pb.grad = p.grad.bfloat16()
    for mode in ("cpu-bf16-sr", "cpu-adamw8bit-sr"):
        for compiled in (True, False):  # HostAdamW's compiled chunk kernel and its eager fallback, one row each
            try:
                opt = build_optimizer([pb], mode, **kw)
            except OptimModeError as e:  # torchao missing
                print(f"{mode:<28} skipped: {e}", flush=True)
                break
            opt.compiled = compiled
            if a.chunk:
                opt.chunk = int(a.chunk)
            t = time.perf_counter()
            times = step_times(opt, [pb], a.steps)
            first = time.perf_counter() - t - sum(times)  # the untimed step: state allocation, and the compile
            name = f"HostAdamW ({mode}, {'compiled' if compiled else 'eager'})"
            rows[name] = {
                "median_s": statistics.median(times),
                "times_s": times,
                "first_step_s": first,
                "chunk": opt.chunk,
            }
            print(f"{name:<44} {statistics.median(times):7.3f} s / step (first step {first:.1f} s)", flush=True)
            del opt
    if not a.no_deepspeed:
        t0 = time.perf_counter()
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam([p], adamw_mode=True, **kw)
        build = time.perf_counter() - t0
        times = step_times(opt, [p], a.steps)
        rows["DeepSpeedCPUAdam"] = {"median_s": statistics.median(times), "times_s": times, "build_s": build}
        print(
            f"{'DeepSpeedCPUAdam':<44} {statistics.median(times):7.3f} s / step (construction incl. JIT build "
            f"{build:.0f} s)",
            flush=True,
        )
    result = {
        "params": n,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "chunk_arg": a.chunk,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    try:
        import deepspeed

        result["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    out = Path(a.out) / f"cpu_adam_{os.cpu_count()}cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
