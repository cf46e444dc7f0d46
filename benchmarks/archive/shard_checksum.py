"""Read throughput of ShardSource.get with and without its per-sample CRC-32 check.

Samples of a 1024 px FLUX.1 image at realistic size, stored in bf16 as `fluxzero cache` writes them:
latents 16x128x128 (512 KiB) + T5 512x4096 (4 MiB) + CLIP 768, so 4.5 MiB a sample. The shards are read
from the page cache after a warm-up pass, the worst case for the checksum's share (a read from disk is
slower, the CRC the same). One torch thread, as in a DataLoader worker. Passes with and without the check
alternate, so the drift of a shared machine hits both; the ratio of medians is the figure to quote.

    python benchmarks/archive/shard_checksum.py --samples 64 --per-shard 16 --repeats 3 --dir /tmp/shard-bench
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from fluxzero.data.shards import ShardSource, ShardWriter


def write(d: Path, n: int, per_shard: int) -> None:
    g = torch.Generator().manual_seed(0)
    with ShardWriter(d, samples_per_shard=per_shard, dtype="bfloat16") as w:
        for i in range(n):
            w.add(
                torch.randn(16, 128, 128, generator=g),
                torch.randn(512, 4096, generator=g),
                torch.randn(768, generator=g),
                caption=f"sample {i}",
            )


def read_all(src: ShardSource) -> float:
    t = time.perf_counter()
    for i in range(len(src)):
        src.get(i)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--per-shard", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dir", default="/tmp/fluxzero-shard-bench")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    d = Path(a.dir)
    shutil.rmtree(d, ignore_errors=True)
    t = time.perf_counter()
    write(d, a.samples, a.per_shard)
    write_s = time.perf_counter() - t
    on, off = ShardSource(d, checksums=True), ShardSource(d, checksums=False)
    read_all(on), read_all(off)  # warm the page cache and the open shards
    times = {"checked": [], "unchecked": []}
    for _ in range(a.repeats):  # interleaved so that drift of a shared machine hits both alike
        times["checked"].append(read_all(on))
        times["unchecked"].append(read_all(off))
    mib = a.samples * (16 * 128 * 128 + 512 * 4096 + 768) * 2 / 2**20
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        json.dumps(
            {
                "samples": a.samples,
                "sample_mib": round(mib / a.samples, 3),
                "threads": a.threads,
                "write_s": round(write_s, 2),
                "checked_s": [round(x, 3) for x in times["checked"]],
                "unchecked_s": [round(x, 3) for x in times["unchecked"]],
                "checked_mib_s_median": round(mib / med["checked"], 1),
                "unchecked_mib_s_median": round(mib / med["unchecked"], 1),
                "ms_per_sample_checked_median": round(1e3 * med["checked"] / a.samples, 2),
                "ms_per_sample_unchecked_median": round(1e3 * med["unchecked"] / a.samples, 2),
                "ratio_of_medians": round(med["checked"] / med["unchecked"], 3),
                "ratio_of_minima": round(min(times["checked"]) / min(times["unchecked"]), 3),
                "ratios_per_pair": [round(c / u, 3) for c, u in zip(times["checked"], times["unchecked"])],
            }
        )
    )
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
