"""Training metrics: TensorBoard scalars, a JSON-lines file and a progress bar on rank 0; other ranks quiet.

Per-rank step time and peak memory are gathered to rank 0 at every log step (one tiny all_gather).
MFU is reported on GPUs with a known peak: 3 x forward FLOPs (forward + backward, recomputation not
counted, the usual convention) x samples/s / (peak FLOP/s x ranks).

A resumed run starts its logs at the checkpoint's step: metrics.jsonl rows after it are dropped and
TensorBoard purges its later events (purge_step), so steps repeated after a resume appear once.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

import torch

from fluxzero.config.user_files import parse_json
from fluxzero.fsutil import atomic_write
from fluxzero.train.distributed import all_gather

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


class LogWriteError(RuntimeError):
    """A log file could not be written (a full disk, most often); the message names the file and the reason."""

    def __init__(self, what: str, error: OSError):
        super().__init__(f"cannot write {what} ({error.strerror or error})")


def _writing(what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except OSError as e:
        raise LogWriteError(what, e) from None


def _quiet_tensorboard_thread() -> None:
    """TensorBoard writes events on a thread that keeps a failed write (a full disk) for the next add_scalar or
    flush to raise in the training thread, where _writing turns it into LogWriteError; the thread's own
    "Exception in thread" traceback would only repeat it. Installed once per process."""
    previous = threading.excepthook
    if getattr(previous, "fluxzero", False):
        return

    def hook(args):
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            previous(args)

    hook.fluxzero = True
    threading.excepthook = hook


def truncate_jsonl(path: Path, last_step: int) -> int:
    """Drop the rows of metrics.jsonl after `last_step` (and a torn last line); returns how many were dropped.

    Rewritten atomically, and only when something is dropped.
    """
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return 0
    keep = []
    for line in lines:
        try:
            if parse_json(line)["step"] <= last_step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):  # a line cut short by a crash: not a record
            pass
    if len(keep) < len(lines):
        atomic_write(path, "".join(f"{line}\n" for line in keep))
    return len(lines) - len(keep)


class Metrics:
    """Collects one record per logged step; writes only on rank 0."""

    def __init__(
        self,
        output_dir: str,
        rank: int,
        world_size: int,
        device: torch.device,
        total_steps: int,
        start_step: int,
        global_batch: int,
        train_flops,
        dtype: torch.dtype,
    ):
        """train_flops(img_tokens, txt_tokens) -> FLOPs of one sample's training step (ModelConfig's
        train_flops_per_sample), the work that MFU counts."""
        self.rank, self.world_size, self.device = rank, world_size, device
        self.global_batch = global_batch
        self.peak = peak_flops(device, dtype)
        self.train_flops = train_flops
        self._t, self._dt = time.perf_counter(), None
        self.writer = self.jsonl = self.bar = None
        if rank == 0:
            from tqdm import tqdm

            out = Path(output_dir)
            out.mkdir(parents=True, exist_ok=True)
            jsonl, tb = out / "metrics.jsonl", out / "tensorboard"
            self._what = {"writer": f"TensorBoard logs in {tb}", "jsonl": str(jsonl), "bar": "the progress bar"}
            # the steps after the resumed checkpoint are trained again: log them once
            _writing(self._what["jsonl"], truncate_jsonl, jsonl, start_step)
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is in the train extra; without it the JSON lines remain
                print("tensorboard is not installed: logging to metrics.jsonl only", file=sys.stderr)
            else:
                _quiet_tensorboard_thread()
                self.writer = _writing(self._what["writer"], SummaryWriter, str(tb), purge_step=start_step + 1)
            self.jsonl = _writing(self._what["jsonl"], open, jsonl, "a")
            self.bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                # nothing left to train (a finished run started again): no bar drawn twice at 100%
                disable=os.environ.get("FLUXZERO_NO_PROGRESS") == "1" or start_step >= total_steps,
            )

    def step_started(self) -> None:
        self._t, self._dt = time.perf_counter(), None

    def step_finished(self) -> None:
        """The step's own time ends here: validation or sampling after it does not count as step time."""
        self._dt = time.perf_counter() - self._t

    def add_images(self, tag: str, paths: list, step: int) -> None:
        """PNG files (rank 0) into TensorBoard as one (N, H, W, 3) image batch."""
        if self.writer is None or not paths:
            return
        import numpy as np
        from PIL import Image

        images = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in paths])
        _writing(self._what["writer"], self.writer.add_images, tag, images, step, dataformats="NHWC")

    def log(
        self,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float | None,
        skipped_steps: int,
        img_tokens: int,
        txt_tokens: int,
        log: bool = True,
        extra: dict | None = None,
    ) -> dict | None:
        """Record optimizer step `step` (1-based). Collective: every rank must call it at every step.

        extra: further values of this step (val_loss, sample_s, ...): the step is then logged whatever `log` says.
        """
        step_time = self._dt if self._dt is not None else time.perf_counter() - self._t
        log = log or bool(extra)
        if self.bar is not None:  # postfix first: update() draws the bar with this step's loss
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
            self.bar.update(1)
        if not log:
            return None
        mine = torch.tensor([step_time, peak_memory_gb(self.device)], dtype=torch.float64, device=self.device)
        every = all_gather(mine)
        times = [float(t[0]) for t in every]
        mems = [float(t[1]) for t in every]
        slowest = max(times)
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "skipped_steps": skipped_steps,
            "step_time_s": slowest,
            "samples_per_s": self.global_batch / slowest,
            "tokens_per_s": self.global_batch * (img_tokens + txt_tokens) / slowest,
            "peak_memory_gb": max(mems),
            "step_time_s_per_rank": times,
            "peak_memory_gb_per_rank": mems,
            **(extra or {}),
        }
        if self.peak and self.train_flops:  # the batch's bucket sets the tokens, hence the FLOPs
            flops = self.train_flops(img_tokens, txt_tokens)
            record["mfu"] = flops * record["samples_per_s"] / (self.peak * self.world_size)
        if self.writer is not None:
            _writing(self._what["writer"], self._add_scalars, record, times, mems, step)
        if self.jsonl is not None:
            _writing(self._what["jsonl"], self._append, json.dumps(record) + "\n")
        return record

    def _add_scalars(self, record: dict, times: list, mems: list, step: int) -> None:
        for key, value in record.items():
            if isinstance(value, (int, float)) and value is not None and key != "step":
                # val_loss is the validation curve, val/loss in TensorBoard; the rest are the step's own
                self.writer.add_scalar("val/loss" if key == "val_loss" else f"train/{key}", value, step)
        for r, (t, m) in enumerate(zip(times, mems)):  # one line per rank: an uneven rank stands out
            self.writer.add_scalar(f"per_rank/step_time_s/rank{r}", t, step)
            self.writer.add_scalar(f"per_rank/peak_memory_gb/rank{r}", m, step)

    def _append(self, line: str) -> None:
        self.jsonl.write(line)
        self.jsonl.flush()

    def close(self, strict: bool = True) -> None:
        """Close every handle (again: a no-op). strict: raise LogWriteError when the last writes fail;
        otherwise (cleanup after another error) ignore that."""
        error = None
        for name in ("bar", "writer", "jsonl"):
            handle = getattr(self, name)
            setattr(self, name, None)
            if handle is None:
                continue
            try:
                handle.close()
            except OSError as e:
                error = error or LogWriteError(self._what[name], e)
        if error is not None and strict:
            raise error
