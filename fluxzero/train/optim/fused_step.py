"""The fused optimizer modes: each parameter is stepped during backward as soon as its gradient is complete, so no
whole-model gradient buffer ever exists (fluxzero.config.optim_modes: `fused`).

`FusedStep` turns an optimizer with a per-tensor `step_param` into one driven by a
`register_post_accumulate_grad_hook` on every trained parameter: the hook averages the gradient over the
data-parallel ranks, checks it is finite, steps the tensor with its param group's lr (as DeepSpeed's lr scheduler
set it for this step) and sets `p.grad = None`. It is the client optimizer handed to deepspeed.initialize at ZeRO
stage 0; DeepSpeed's engine.step() then calls `step()`, which ends the optimizer step: it waits for the streamed
blocks' write-backs (fluxzero.train.block_stream), reports the step's gradient norm (`_global_grad_norm`) and
whether any tensor was skipped (`overflow`: DeepSpeed then counts a skipped step and holds its lr scheduler).

What an earlier per-parameter attempt under DeepSpeed got wrong, and how this answers it:
- DeepSpeed's allreduce re-created every freed gradient as zeros after backward: the engine builder turns the
  engine's backward all-reduce off (`enable_backward_allreduce = False`); this hook all-reduces instead.
- Ranks stepped their own un-averaged gradients: the gradients are averaged before any is stepped, in the same
  order on every rank (autograd's order is the graph's), so the replicas stay identical. On more than one rank
  they are averaged a bucket at a time (`attach(buckets=)`: one per transformer block, one per other top-level
  module): a bucket's tensors wait in their hooks until its last gradient is complete, then one all_reduce of
  their flattened gradients averages them all and each is stepped, so a step makes one collective per block
  instead of one per tensor. Gloo and NCCL sum elementwise, so the average is the per-tensor one, bit for bit
  on two ranks (tests/train/test_fused_step.py); it costs one block's gradients held, twice while flattened.
- Gradient accumulation and clipping were bypassed: both are refused for these modes (config/ds_check.py), since
  the update happens before a later micro batch or a global norm exists; Adafactor clips each update's RMS.
- The whole step is no longer all-or-nothing: a tensor whose gradient is not finite is left as it is (and its
  states; only its step count moves, since the check stays on the device), the others are stepped. The trainer checks the loss before backward in these modes (train/step.py), so
  a non-finite loss never reaches any weight.

Rounding noise is keyed on (seed, the parameter's place, its step) (fluxzero.train.optim.rounding), so backward's order
and a resume leave it unchanged: a resumed run is bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist


class FusedStep:
    """Mixin before an optimizer with `step_param(group, p, finite=)` (fluxzero.train.optim.optimizers.FusedAdafactorSR is
    AdafactorSR's): stepped per parameter in backward; `attach()` registers the hooks (the engine builder calls
    it). It imports no optimizer, so fluxzero.train.optim.optimizers can build on it."""

    steps_in_backward = True  # train/step.py reads it: the loss is checked before backward
    bucket_grads = True  # on more than one rank, average a bucket's gradients in one all_reduce (attach's buckets)

    def __init__(self, params, lr: float, weight_decay: float = 0.0, *, noise_seed: int, **kw):
        super().__init__(params, lr=lr, weight_decay=weight_decay, noise_seed=noise_seed, **kw)
        self.overflow = False  # DeepSpeed's engine reads it after step(): a skipped step, lr scheduler held
        self._global_grad_norm = None  # DeepSpeed's engine copies it after step() (engine.get_global_grad_norm)
        self.skipped_tensors = 0  # over the run: tensors left unstepped for a non-finite gradient
        # param -> index of its group: load_state_dict replaces the group dicts (whose lr the scheduler then sets)
        self._group = {p: i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._norm_sq, self._nonfinite, self._new_step = 0.0, 0, True
        self._streamer, self._device, self._world, self._handles = None, None, 1, []
        self._bucket_of, self._bucket_size, self._waiting = {}, {}, {}

    def attach(self, device: torch.device, streamer=None, buckets: dict | None = None) -> None:
        """Step each trained parameter from its gradient hook; `streamer` (a block_stream.BlockStreamer) is told
        when a tensor of a streamed block has been stepped. States live on `device` (the accelerator). `buckets`:
        parameter -> the name of its bucket (grad_buckets), whose gradients are averaged together on more than
        one rank."""
        self._streamer, self._device = streamer, torch.device(device)
        self._world = dist.get_world_size() if dist.is_initialized() else 1
        if buckets:
            self._bucket_of = {p: buckets[p] for p in self._group if p in buckets}
            self._bucket_size = {}
            for name in self._bucket_of.values():
                self._bucket_size[name] = self._bucket_size.get(name, 0) + 1
        for p in self._group:
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        if self._new_step:  # the first gradient of a step: what step() reported belongs to the last one
            self._norm_sq, self._nonfinite, self._new_step = 0.0, 0, False
        if self._world == 1:
            self._step_one(p)
            return
        bucket = self._bucket_of.get(p) if self.bucket_grads else None
        if bucket is None:
            dist.all_reduce(p.grad)
            p.grad.div_(self._world)
            self._step_one(p)
            return
        waiting = self._waiting.setdefault(bucket, [])
        waiting.append(p)
        if len(waiting) == self._bucket_size[bucket]:
            self._flush(bucket)

    def _flush(self, bucket) -> None:
        """Average the waiting gradients of `bucket` in one all_reduce per dtype, then step each in arrival order."""
        params = self._waiting.pop(bucket)
        by_dtype: dict = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat.div_(self._world)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            del flat
        for p in params:
            self._step_one(p)

    def _step_one(self, p: torch.Tensor) -> None:
        """Step `p` with its (averaged) gradient and drop the gradient."""
        g = p.grad
        # the norm and the finite check stay on the device (no .item()): a host sync per tensor would drain the
        # queue of backward's kernels and the block copies behind it, hundreds of times a step
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
        finite = torch.isfinite(norm)
        self._norm_sq = self._norm_sq + torch.where(finite, norm * norm, 0.0)
        self._nonfinite = self._nonfinite + (~finite).int()
        self.step_param(self.param_groups[self._group[p]], p, finite=finite)
        p.grad = None
        if self._streamer is not None:
            self._streamer.stepped(p)

    @torch.no_grad()
    def step(self, closure=None):
        """End the optimizer step (every tensor was stepped in backward): wait for the write-backs of streamed
        blocks, so the host copies are current for a checkpoint or an export; read the step's gradient norm and
        count of skipped tensors (the step's one host sync)."""
        for bucket in list(self._waiting):  # a bucket some of whose tensors had no gradient this step: in the
            self._flush(bucket)  # order their first gradients came, the same on every rank
        if self._streamer is not None:
            self._streamer.finish()
        skipped = int(self._nonfinite)
        self.overflow = skipped > 0
        self.skipped_tensors += skipped
        self._global_grad_norm = math.sqrt(float(self._norm_sq))
        self._norm_sq, self._nonfinite, self._new_step = 0.0, 0, True
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._group:
            p.grad = None

    def state_dict(self):
        if self._streamer is not None:
            self._streamer.finish()
        return super().state_dict()

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        # the states of streamed parameters come back to the host (where their weights are between steps);
        # they are stepped on the accelerator, and the step count is read on the host every step. Keys interned as
        # the step code's literals are: pickle then memoizes them as before the resume, and the next checkpoint is
        # byte for byte the uninterrupted run's
        for p, st in list(self.state.items()):
            self.state[p] = {
                sys.intern(k): (v.cpu() if k == "step" else v.to(self._device or v.device))
                if isinstance(v, torch.Tensor)
                else v
                for k, v in st.items()
            }


def grad_buckets(model: torch.nn.Module) -> dict:
    """parameter -> its gradient bucket for FusedStep.attach: the transformer block it belongs to
    (`double_blocks.N`, `single_blocks.N`), else its top-level module (`img_in`, `final_layer`, ...)."""
    out = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        out[p] = ".".join(parts[:2]) if parts[0] in ("double_blocks", "single_blocks") else parts[0]
    return out
