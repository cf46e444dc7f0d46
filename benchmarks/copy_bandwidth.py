"""Host <-> GPU copy bandwidth, the ceiling of every mode that streams weights between host memory and the GPU.

Measures, for a block-sized buffer (FLUX.1-dev's double block is ~0.68 GB in bf16, a single block ~0.28 GB):
  h2d, d2h        one direction alone, from host memory pinned by torch's allocator and by cudaHostRegister
                  (the latter pins an ordinary allocation of the exact size: torch's pinned allocator rounds
                  each block up to a power of two)
  both            H2D and D2H at once on two streams (what a step that fetches the next block while it writes
                  back the last update does)
  h2d_under_mm    H2D on a side stream while bf16 matmuls run on the default stream: how much a copy slows the
                  compute it hides behind, and the reverse
Each figure is the median of --repeats timed copies after a warm-up, in GB/s (1e9 bytes).

    PYTHONPATH=. python3 benchmarks/copy_bandwidth.py --out $OUT/copy_bandwidth.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runner  # noqa: E402


def _time(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs after one warm-up, each timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def registered(nbytes: int) -> torch.Tensor:
    """An ordinary host allocation of exactly nbytes, pinned in place with cudaHostRegister."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed with {err}")
    return t


def main() -> None:
    ap = runner.parser(__doc__)
    ap.add_argument("--mbytes", type=int, default=680, help="buffer size in MB (1e6 bytes)")
    ap.add_argument("--repeats", type=int, default=10)
    runner.add_out(ap, None, "JSON file (default: print only)")
    args = ap.parse_args()
    nbytes = args.mbytes * 10**6
    gpu_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    gpu_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    hosts = {"pinned": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "registered": registered(nbytes)}
    host_b = registered(nbytes)
    side = torch.cuda.Stream()
    rows: dict[str, float] = {}
    for kind, host in hosts.items():
        rows[f"h2d_{kind}"] = nbytes / _time(lambda h=host: gpu_a.copy_(h, non_blocking=True), args.repeats) / 1e9
        rows[f"d2h_{kind}"] = nbytes / _time(lambda h=host: h.copy_(gpu_a, non_blocking=True), args.repeats) / 1e9

    host = hosts["registered"]

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host_b.copy_(gpu_b, non_blocking=True)
        gpu_a.copy_(host, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    rows["both_each_direction"] = nbytes / _time(both, args.repeats) / 1e9

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    n_mm = 8

    def mm():
        for _ in range(n_mm):
            a @ a

    def mm_and_copy():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            gpu_a.copy_(host, non_blocking=True)
        mm()
        torch.cuda.current_stream().wait_stream(side)

    t_mm = _time(mm, args.repeats)
    t_both = _time(mm_and_copy, args.repeats)
    t_copy = nbytes / rows["h2d_registered"] / 1e9
    rows["matmul_tflops_alone"] = n_mm * 2 * 8192**3 / t_mm / 1e12
    rows["matmul_and_h2d_s"] = t_both
    rows["matmul_alone_s"] = t_mm
    rows["h2d_alone_s"] = t_copy
    rows["overlap_efficiency"] = (t_mm + t_copy) / t_both - 1.0  # 1.0: the copy hid entirely behind the matmuls
    result = {
        "mbytes": args.mbytes,
        "repeats": args.repeats,
        "gbps": rows,
        "gpu": torch.cuda.get_device_name(),
        **runner.provenance_fields("torch"),
    }
    for k, v in rows.items():
        print(f"{k:24s} {v:10.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
