"""The public train step: one optimizer step of rectified-flow training through the DeepSpeed engine.

The trainer's loop and every benchmark run this step, so what the benchmarks time is what users run:
    batch -> flow.prepare_batch -> engine(**inputs) -> flow.loss -> engine.backward, per micro batch,
    then the mean loss over micro batches and ranks, the finite check, and the update (engine.step).
It owns every engine.step() call. No deepspeed import: the engine object does the work.

The data phase runs ahead of the step (prefetch > 0, the trainer's default): a background thread takes the next
batch from the loader, draws its noise and timesteps, packs it and copies it to the device on a side CUDA stream,
while the current step computes; the step only waits on that copy's event. The numbers are the same as inside the
step (noise is keyed on the sample, never on the order of calls), and the loader position saved with a checkpoint
is that of the batches the steps consumed, not of those read ahead.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fluxzero.config import FlowConfig
from fluxzero.train import flow
from fluxzero.train.distributed import sum_across_ranks


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did. loss: the mean over its micro batches and all ranks."""

    loss: float
    lr: float  # the lr this step applied (a DeepSpeed scheduler moves on inside engine.step)
    grad_norm: float | None  # DeepSpeed's global gradient norm, None where the engine does not compute it
    skipped_steps: int  # updates DeepSpeed skipped so far (fp16 overflow): a rising count means lost updates
    img_tokens: int  # packed image tokens of the last micro batch (they vary with the bucket)
    txt_tokens: int
    stop_requested: bool = False  # some rank's stop_flag() was set when this step's loss was reduced


def batches(loader) -> Iterator[tuple[int, dict]]:
    """(epoch, batch) forever, continuing from the loader's (possibly restored) position."""
    epoch = loader.epoch
    while True:
        loader.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch
        epoch += 1


@dataclass
class Prepared:
    """One micro batch ready for the model: flow.prepare_batch's inputs and target on the device."""

    inputs: dict
    target: torch.Tensor
    index: torch.Tensor  # (B,) sample indices, for messages about non-finite losses
    position: dict | None  # the loader position once this batch is consumed ({"epoch", "batches_done"})
    weight: torch.Tensor | None = None  # (B, L_img) per-token loss weights (flow.loss_weights); None: plain mean
    ready: object = None  # a CUDA event recorded on the copy stream after the copies (None: already there)


class Prefetcher:
    """Iterator of Prepared, made by `make()` (an iterator) in a daemon thread, at most `depth` ahead.

    On CUDA the thread works on its own stream; __next__ makes the current stream wait for the batch's copies
    and records the tensors on it (so the caching allocator does not hand their memory back to the side stream
    while the step still reads them). An exception in the thread (a damaged shard) is raised by the __next__
    that would have returned that batch, as the loader would have raised it inside the step.
    """

    def __init__(self, make: Callable[[], Iterator[Prepared]], depth: int, device: torch.device):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._work, args=(make,), daemon=True, name="fluxzero-prefetch")
        self._thread.start()

    def _work(self, make) -> None:
        try:
            if self._stream is not None:
                torch.cuda.set_device(self._device)
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                for item in make():
                    if self._stream is not None:
                        item.ready = torch.cuda.Event()
                        item.ready.record(self._stream)
                    if not self._put(item):
                        return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(e)

    def _put(self, item) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        return self

    def __next__(self) -> Prepared:
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.ready is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_event(item.ready)
            for t in [*item.inputs.values(), item.target, item.weight]:
                if t is not None:
                    t.record_stream(current)
        return item

    def close(self, wait: float = 10.0) -> None:
        """Stop the thread at its next hand-over and wait for it (up to `wait` s: a batch it is preparing ends
        first), so that no thread is inside torch while the process tears down."""
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=wait)


def prepared_batches(
    source: Iterator[tuple[int, dict]],
    flow_cfg: FlowConfig,
    *,
    seed: int,
    guidance_embed: bool,
    device: torch.device,
    dtype: torch.dtype,
    position: Callable[[], dict] | None = None,
) -> Iterator[Prepared]:
    """The loader's (epoch, batch) stream as model inputs and targets on `device` (flow.prepare_batch), with the
    loss weights of masked samples; position(), when given, is read right after each batch leaves `source`."""
    for epoch, batch in source:
        pos = position() if position is not None else None
        inputs, target = flow.prepare_batch(
            batch, flow_cfg, seed, epoch, guidance_embed=guidance_embed, device=device, dtype=dtype
        )
        weight = flow.loss_weights(batch, flow_cfg.mask_floor)
        if weight is not None:
            weight = weight.to(device, non_blocking=True)
        yield Prepared(inputs, target, batch["index"], pos, weight)


def ahead(make: Callable[[], Iterator[Prepared]], prefetch: int, device: torch.device) -> Iterator[Prepared]:
    """make()'s batches, prepared `prefetch` ahead by a Prefetcher (0: in the caller's thread, as asked)."""
    return Prefetcher(make, prefetch, device) if prefetch > 0 else make()


class TrainStep:
    """Callable that runs one optimizer step and returns a StepResult.

    before_update(loss) runs once the step's loss is known and before the update is applied: the trainer's
    finite check raises there, so a non-finite loss never reaches the weights (nor a checkpoint).
    on_phase(name), when given, is called as each phase starts ("data", "forward", "backward", "update") and
    with "end": benchmarks put CUDA events there; the trainer leaves it None.
    stop_flag(), when given, is read on every rank and reduced together with the loss (no extra collective):
    StepResult.stop_requested then tells every rank, at the same step, that one of them was asked to stop.
    position(), when given, is read right after each batch leaves `source` (in the prefetch thread when there
    is one): `self.position` is then the loader position of the last batch a step consumed, what a checkpoint
    must record. prefetch: batches prepared ahead by a background thread (0: inside the step, in this thread);
    the thread starts at the first call, so `source` may be replaced before it.
    """

    def __init__(
        self,
        engine,
        source: Iterator[tuple[int, dict]],
        flow_cfg: FlowConfig,
        *,
        seed: int,
        grad_accum: int,
        guidance_embed: bool,
        device: torch.device,
        dtype: torch.dtype,
        before_update: Callable[[float], None] | None = None,
        on_phase: Callable[[str], None] | None = None,
        stop_flag: Callable[[], bool] | None = None,
        position: Callable[[], dict] | None = None,
        prefetch: int = 0,
    ):
        self.engine, self.source, self.flow_cfg = engine, source, flow_cfg
        self.seed, self.grad_accum, self.guidance_embed = seed, grad_accum, guidance_embed
        self.device, self.dtype = device, dtype
        self.world_size = dist.get_world_size()
        self.before_update = before_update
        self.on_phase = on_phase or (lambda name: None)
        self.stop_flag = stop_flag or (lambda: False)
        self._position_fn, self.prefetch = position, prefetch
        self.position: dict | None = None  # of the last consumed batch; None before the first step
        self._prepared: Iterator[Prepared] | None = None
        # DeepSpeed's wrappers (ZeRO 1-3, its bf16/fp16 optimizers) compute the global grad norm; a client
        # optimizer the engine calls directly (ZeRO 0 without bf16.enabled: fp32, and the bf16 optimizer modes)
        # leaves it None, so the step computes it from the gradients the engine has all-reduced
        self._own_norm = not hasattr(engine.optimizer, "_global_grad_norm")

    def _prepare_all(self) -> Iterator[Prepared]:
        return prepared_batches(
            self.source,
            self.flow_cfg,
            seed=self.seed,
            guidance_embed=self.guidance_embed,
            device=self.device,
            dtype=self.dtype,
            position=self._position_fn,
        )

    def _next_batch(self) -> Prepared:
        if self._prepared is None:
            self._prepared = ahead(self._prepare_all, self.prefetch, self.device)
        item = next(self._prepared)
        self.position = item.position
        return item

    def close(self) -> None:
        """Stop the prefetch thread (the trainer calls it when the loop ends, however it ends)."""
        if isinstance(self._prepared, Prefetcher):
            self._prepared.close()

    def nonfinite_samples(self) -> list[int]:
        """Sample indices (this rank) of the last step's micro batches whose loss was not finite."""
        return [int(i) for loss, index in getattr(self, "_micro", []) if not torch.isfinite(loss) for i in index]

    def __call__(self) -> StepResult:
        engine, phase = self.engine, self.on_phase
        lr = float(engine.get_lr()[0])  # before engine.step (a scheduler moves on inside it); torchao keeps a tensor
        loss_sum = torch.zeros((), device=self.device)
        self._micro = []  # (loss, sample indices) of each micro batch: which samples a non-finite loss came from
        # a fused optimizer mode (fluxzero.train.optim.fused_step) applies the update during backward: the loss is
        # reduced and checked before it (no accumulation there), so a non-finite one never reaches the weights
        in_backward = getattr(engine.optimizer, "steps_in_backward", False)
        for micro in range(self.grad_accum):
            phase("data")
            item = self._next_batch()
            inputs, target = item.inputs, item.target
            phase("forward")
            pred = engine(**inputs)  # (B, L_img, 64)
            loss = flow.loss(pred, target, item.weight)
            loss_sum += loss.detach()
            self._micro.append((loss.detach(), item.index))
            if in_backward:
                mean, stops, own_sq = self._reduce_and_check(loss_sum)
            phase("backward")
            engine.backward(loss)
            if micro < self.grad_accum - 1:
                engine.step()  # inside accumulation: DeepSpeed only counts the micro step
        if not in_backward:
            mean, stops, own_sq = self._reduce_and_check(loss_sum)
        phase("update")
        engine.step()
        phase("end")
        norm = math.sqrt(own_sq) if self._own_norm else engine.get_global_grad_norm()
        return StepResult(
            loss=mean,
            lr=lr,
            grad_norm=None if norm is None else float(norm),
            skipped_steps=int(engine.skipped_steps),
            img_tokens=inputs["img"].shape[1],
            txt_tokens=inputs["txt"].shape[1],
            stop_requested=stops > 0,
        )

    def _reduce_and_check(self, loss_sum: torch.Tensor) -> tuple[float, float, float]:
        """(mean loss over micro batches and ranks, stop flags, own squared grad norm), then before_update."""
        flag = torch.ones((), device=self.device) if self.stop_flag() else torch.zeros((), device=self.device)
        # the grad norm (squared, divided over the ranks that all hold the same reduced grads) rides on the same
        # reduction: no collective and no host sync of its own
        sq = self._grad_norm_sq() / self.world_size if self._own_norm else torch.zeros((), device=self.device)
        total, stops, own_sq = sum_across_ranks(torch.stack((loss_sum, flag, sq)))  # one host sync per step
        mean = total / (self.grad_accum * self.world_size)
        if self.before_update is not None:
            self.before_update(mean)
        return mean, stops, own_sq

    def _grad_norm_sq(self) -> torch.Tensor:
        """Squared 2-norm of all gradients (before clipping, as DeepSpeed reports it), on the device."""
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).to(self.device).square().sum()
