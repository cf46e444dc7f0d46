"""Training metrics: TensorBoard scalars, a JSON-lines file and a progress bar on rank 0; other ranks quiet.

Per-rank step time and peak memory are gathered to rank 0 at every log step (one tiny all_gather).
MFU is reported on GPUs with a known peak: 3 x forward FLOPs (forward + backward, recomputation not
counted, the usual convention) x samples/s / (peak FLOP/s x ranks).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# Dense peak FLOP/s by GPU name fragment: (bf16/fp16, fp32 via TF32). From NVIDIA's data sheets (SXM).
PEAK_FLOPS = {
    "H200": (989.4e12, 494.7e12),
    "H100": (989.4e12, 494.7e12),
    "A100": (312e12, 156e12),
    "L40S": (362e12, 183e12),
    "A10G": (70e12, 35e12),
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak dense FLOP/s of one device, FLUXZERO_PEAK_TFLOPS overrides; None on CPU or unknown GPUs."""
    if os.environ.get("FLUXZERO_PEAK_TFLOPS"):
        return float(os.environ["FLUXZERO_PEAK_TFLOPS"]) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, single) in PEAK_FLOPS.items():
        if key in name:
            return single if dtype == torch.float32 else half
    return None


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated (GPU) or peak resident set size of the process (CPU), in GB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    return kb * 1024 / 1e9


class Metrics:
    """Collects one record per logged step; writes only on rank 0."""

    def __init__(self, output_dir: str, rank: int, world_size: int, device: torch.device, total_steps: int,
                 start_step: int, global_batch: int, flops_per_sample, dtype: torch.dtype):
        """flops_per_sample(img_tokens, txt_tokens) -> forward FLOPs of one sample (ModelConfig's method)."""
        self.rank, self.world_size, self.device = rank, world_size, device
        self.global_batch = global_batch
        self.peak = peak_flops(device, dtype)
        self.flops_per_sample = flops_per_sample
        self._t = time.perf_counter()
        self.writer = self.jsonl = self.bar = None
        if rank == 0:
            from tqdm import tqdm

            out = Path(output_dir)
            out.mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(out / "tensorboard"))
            except ImportError:  # tensorboard is in the train extra; without it the JSON lines remain
                print("tensorboard is not installed: logging to metrics.jsonl only", file=sys.stderr)
            self.jsonl = open(out / "metrics.jsonl", "a")
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr, disable=os.environ.get("FLUXZERO_NO_PROGRESS") == "1")

    def step_started(self) -> None:
        self._t = time.perf_counter()

    def log(self, step: int, loss: float, lr: float, grad_norm: float | None, skipped_steps: int,
            img_tokens: int, txt_tokens: int, log: bool = True) -> dict | None:
        """Record optimizer step `step` (1-based). Collective: every rank must call it at every step."""
        step_time = time.perf_counter() - self._t
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        if not log:
            return None
        mine = torch.tensor([step_time, peak_memory_gb(self.device)], dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        times = [float(t[0]) for t in every]
        mems = [float(t[1]) for t in every]
        slowest = max(times)
        record = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "skipped_steps": skipped_steps,
            "step_time_s": slowest, "samples_per_s": self.global_batch / slowest,
            "tokens_per_s": self.global_batch * (img_tokens + txt_tokens) / slowest,
            "peak_memory_gb": max(mems), "step_time_s_per_rank": times, "peak_memory_gb_per_rank": mems,
        }
        if self.peak and self.flops_per_sample:  # the batch's bucket sets the tokens, hence the FLOPs
            flops = 3 * self.flops_per_sample(img_tokens, txt_tokens)
            record["mfu"] = flops * record["samples_per_s"] / (self.peak * self.world_size)
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and value is not None and key != "step":
                    self.writer.add_scalar(f"train/{key}", value, step)
            for r, (t, m) in enumerate(zip(times, mems)):  # one line per rank: an uneven rank stands out
                self.writer.add_scalar(f"per_rank/step_time_s/rank{r}", t, step)
                self.writer.add_scalar(f"per_rank/peak_memory_gb/rank{r}", m, step)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        return record

    def close(self) -> None:
        for handle in (self.bar, self.writer, self.jsonl):
            if handle is not None:
                handle.close()
