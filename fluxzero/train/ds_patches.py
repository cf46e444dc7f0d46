"""Every change fluxzero makes to DeepSpeed's own objects, in one place: each function names the DeepSpeed code it
works around or replaces, why, and what stays the same. build_engine (fluxzero.train.engine) applies them.

- keep_block_states_whole: ZeRO-1/2 would slice adamw8bit-sr's 8-bit states off their 256-value blocks.
- keep_on_host: streamed blocks' weights stay in host memory through deepspeed.initialize.
- batch_grad_checks: the update's per-tensor overflow check and gradient norm as one multi-tensor call each.
- accept_host_optimizer: ZeRO's bf16-master offload lets fluxzero's host AdamW through its DeepSpeedCPUAdam check.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator


def keep_block_states_whole(optimizer) -> bool:
    """Stop ZeRO-1/2 from slicing adamw8bit-sr's 8-bit states per parameter; returns whether it was stopped.

    After its first step DeepSpeed 0.19.8's DeepSpeedZeroOptimizer links, for each parameter, a view of every
    optimizer state at the parameter's offset in the flat partition (_lazy_init_hp_params_optimizer_state ->
    tensor_fragment.set_optim_state_fragment narrows each state). torchao's 8-bit states hold one scale per
    256-value block and can only be sliced at block boundaries, which parameters do not fall on, so that step
    raised. The views serve only DeepSpeed's per-parameter optimizer-state API (safe_get_full_optimizer_state)
    and a universal-checkpoint load, which fluxzero does not use for this mode; the optimizer steps and saves the
    whole partition's states as before, so the link is marked done without being made.
    """
    client = getattr(optimizer, "optimizer", None)
    if getattr(client, "fluxzero_mode", None) != "adamw8bit-sr" or not hasattr(
        optimizer, "_hp_optimizer_states_linked"
    ):
        return False
    optimizer._hp_optimizer_states_linked = True
    return True


# ---------------------------------------------------------------------------------------------------------
# Streamed blocks stay on the host through deepspeed.initialize
# ---------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def keep_on_host(streamer):
    """Keep the streamed blocks' weights in host memory through deepspeed.initialize (nothing without a streamer).

    deepspeed 0.19.8's _configure_distributed_model moves the whole module to the accelerator
    (`self.module.to(self.device)`, engine.py, unless `dont_change_device`, which deepspeed.initialize does not
    expose), and casts it to bf16 (`self.module.bfloat16()`): the streamed blocks get an `_apply` that leaves
    their streamed weights where they are and applies the move or cast to the rest, a LoRA's adapters (Module._apply
    recurses through each child's own `_apply`). Its _broadcast_model then broadcasts every parameter from rank 0,
    which NCCL cannot do for host tensors: the streamed ones are left out of it (DeepSpeed skips a parameter with
    `ds_optim_param`, its mark for OptimizedLinear's per-rank shards) and broadcast here one block at a time through
    the device.
    """
    if streamer is None:
        yield
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    blocks = streamer.modules()
    params = [p for m in blocks for p in m.parameters() if streamer.streams(p)]
    plain = DeepSpeedEngine._broadcast_model

    def broadcast(engine):
        for p in params:
            p.ds_optim_param = True
        try:
            plain(engine)
        finally:
            for p in params:
                del p.ds_optim_param
        if engine.dist_backend is not None and dist.get_world_size() > 1:
            streamer.broadcast(src=0)

    for m in blocks:
        m._apply = functools.partial(_apply_to_resident, m, streamer)
    DeepSpeedEngine._broadcast_model = broadcast
    try:
        yield
    finally:
        DeepSpeedEngine._broadcast_model = plain
        for m in blocks:
            del m._apply


@torch.no_grad()
def _apply_to_resident(module, streamer, fn, recurse=True):
    """Module._apply for a streamed block: `fn` on its parameters that are not streamed (none in a full fine-tune),
    in place as Module._apply does by default (`param.data = fn(param)`); the model has no buffers."""
    for p in module.parameters():
        if not streamer.streams(p):
            p.data = fn(p)
    return module


# ---------------------------------------------------------------------------------------------------------
# The update's per-tensor checks, one call each
# ---------------------------------------------------------------------------------------------------------
def batch_grad_checks(optimizer) -> list[str]:
    """Replace DeepSpeed 0.19.8's per-tensor Python loops in the update's gradient checks with one multi-tensor
    call each, on this optimizer object only; returns the names of the methods replaced.

    The loops cost per tensor, not per value: a LoRA's many small adapters (FLUX.1-dev all-linear: 608 tensors)
    spend most of the update in them (a FLUX.1-dev all-linear LoRA's update took far longer than its AdamW
    kernels: benchmarks/RESULTS.md). What is replaced, and why the result is the same:
    - ZeRO-1/2 (DeepSpeedZeroOptimizer, no CPU offload): has_overflow_partitioned_grads_serial ran amin, amax,
      two isfinite, logical_and and an add per gradient (~6 kernels each); now the max |g| of every gradient
      in one torch._foreach_norm(inf) (NaN and inf propagate through a max, no sum can overflow) and one isfinite:
      True exactly when some gradient holds a NaN or an inf, as before. get_grad_norm_direct (L2) cast each
      gradient to fp32 and took its norm (two kernels and a Python step each); now torch._foreach_norm with
      dtype=fp32 over the same gradients (the same filter: padding, pipeline replicas, model-parallel rank), then
      DeepSpeed's own reduction of the per-tensor norms. Bit-identical on CPU (its foreach_norm calls the same
      vector_norm per tensor, tests/train/test_batched_grad_checks.py); on CUDA the fused kernel sums in another
      order: the norm, hence the clip factor, can differ in the last bits.
      After every step it re-pointed each bf16 parameter at its slice of the flat buffer (_update_model_bit16_
      weights: a narrow, a view and a .data assignment per tensor, which DeepSpeed's own comment there doubts is
      needed), though the all-gather writes into that same buffer; now it does so only when
      the buffer or a parameter's storage moved since the last re-pointing (one data_ptr() per tensor), as after
      a checkpoint load that assigns new tensors.
    - ZeRO-0 with DeepSpeed's bf16 (FP16_UnfusedOptimizer): its overflow check converted each gradient's check to
      a Python bool, a device sync per tensor, stopping at the first non-finite one; now one sync in all, the same
      answer. Its step (`_unfused_step`) ran four more per-tensor loops (a norm, an fp32 copy of the gradient, the
      unscale/clip multiply, the copy back into the bf16 weights): 15,214 aten ops outside the inner AdamW for
      FLUX.1-dev's 608 all-linear adapter tensors; now each loop is one multi-tensor call, 635 ops (608 of them
      allocations), with the same values (benchmarks/RESULTS.md).
    Any other optimizer (BF16_Optimizer, ZeRO-3, CPU offload, a client optimizer at ZeRO 0) is left as it is.
    """
    import types

    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    done = []
    # the exact classes whose loops were read (a subclass may step differently), and only while the methods exist
    if (
        type(optimizer) is DeepSpeedZeroOptimizer
        and not optimizer.cpu_offload
        and hasattr(optimizer, "has_overflow_partitioned_grads_serial")
    ):
        optimizer.has_overflow_partitioned_grads_serial = types.MethodType(_zero_grads_overflow, optimizer)
        plain = optimizer.get_grad_norm_direct
        optimizer.get_grad_norm_direct = types.MethodType(functools.partial(_zero_grad_norm, plain=plain), optimizer)
        done = ["has_overflow_partitioned_grads_serial", "get_grad_norm_direct"]
        if hasattr(optimizer, "_update_model_bit16_weights"):
            repoint = optimizer._update_model_bit16_weights
            optimizer._update_model_bit16_weights = functools.partial(_repoint_when_moved, optimizer, repoint, {})
            done.append("_update_model_bit16_weights")
    elif type(optimizer) is FP16_UnfusedOptimizer and hasattr(optimizer.overflow_checker, "has_overflow_serial"):
        checker = optimizer.overflow_checker
        checker.has_overflow_serial = lambda params: bool(
            _any_nonfinite([p.grad for p in params if p.grad is not None])
        )
        done = ["overflow_checker.has_overflow_serial"]
        one_device = len({p.device for group in optimizer.fp16_groups for p in group}) <= 1  # one multi-tensor call
        if (
            one_device
            and not optimizer.fused_lamb_legacy
            and optimizer.mpu is None
            and hasattr(optimizer, "unscale_and_clip_grads")
        ):
            optimizer.step = types.MethodType(_unfused_step, optimizer)
            done.append("step")
    return done


def _repoint_when_moved(self, repoint, seen: dict, group_index: int) -> None:
    """DeepSpeedZeroOptimizer._update_model_bit16_weights(group_index), skipped while the group's flat buffer and
    every parameter's data are where the last re-pointing left them (`seen`: group -> their data_ptr()s)."""

    def where():
        return (self.bit16_groups_flat[group_index].data_ptr(), *(p.data_ptr() for p in self.bit16_groups[group_index]))

    if seen.get(group_index) != where():
        repoint(group_index)
        seen[group_index] = where()  # after it: re-pointing moves the parameters' data into the buffer


def _any_nonfinite(grads: list) -> torch.Tensor:
    """(1,) bool on the gradients' device: does any of `grads` hold a NaN or an inf (one multi-tensor max |g|)."""
    if not grads:
        return torch.zeros(1, dtype=torch.bool, device=get_accelerator().current_device_name())
    if any(g.is_sparse for g in grads):
        grads = [g._values() if g.is_sparse else g for g in grads]
    peaks = torch._foreach_norm(grads, float("inf"))
    return ~torch.isfinite(torch.stack(peaks)).all().reshape(1)


def _zero_grads_overflow(self) -> torch.Tensor:
    # as DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial: every partitioned gradient of every group
    return _any_nonfinite(
        [g for i in range(len(self.bit16_groups)) for g in self.averaged_gradients[i] if g is not None]
    )


def _zero_grad_norm(self, gradients, params, norm_type=2, *, plain):
    """DeepSpeedZeroOptimizer.get_grad_norm_direct for the L2 norm, its per-tensor norms in one call."""
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if float(norm_type) != 2.0:
        return plain(gradients, params, norm_type)
    grads = [
        g
        for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params)
        if not (hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated)
        and (is_model_parallel_parameter(p) or self.model_parallel_rank == 0)
    ]
    if grads:
        norms = torch.stack(torch._foreach_norm(grads, 2.0, dtype=get_norm_dtype()))
        total_norm = norms.to(get_accelerator().current_device_name()).pow(2.0).sum().float()
    else:
        total_norm = torch.tensor(0.0, dtype=torch.float32).to(self.device)
    deepspeed.comm.all_reduce(total_norm, op=deepspeed.comm.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total_norm, op=deepspeed.comm.ReduceOp.SUM)
    total_norm = total_norm.pow(1.0 / 2.0)
    mask_nan_or_inf_with_val_inplace(total_norm, device=self.device)
    return total_norm


def _sequential_norm(grads: list) -> float:
    """deepspeed.runtime.utils.get_weight_norm(grads) without model parallelism (mpu None): the L2 norm of all
    `grads`, -1 when it is not finite. There each tensor's norm is an fp32 `g.float().norm(2)` and their squares are
    added one by one in fp32; here the norms are one torch._foreach_norm (dtype fp32: on CPU the same per-tensor norm),
    their squares one pow on the stacked norms, and the squares are added in the same order in fp32 on the host
    (numpy's add.accumulate is sequential), so the value is the same on CPU; one device sync, as before."""
    from deepspeed.runtime.constants import PIPE_REPLICATED

    grads = [g for g in grads if not (hasattr(g, PIPE_REPLICATED) and g.ds_pipe_replicated)]
    if not grads:
        return 0.0
    squares = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).pow(2.0).cpu().numpy()
    total = float(np.add.accumulate(squares, dtype=np.float32)[-1]) ** 0.5
    return total if math.isfinite(total) else -1


def _unfused_step(self, closure=None):
    """FP16_UnfusedOptimizer.step (deepspeed 0.19.8, runtime/fp16/unfused_optimizer.py) without mpu or fused LAMB,
    each per-tensor loop one multi-tensor call: the gradient norm (`_sequential_norm`), the fp32 copies of the bf16
    gradients (torch._foreach_copy_ into fresh fp32 tensors: the same cast as `.to(fp32)`), the unscale/clip multiply
    (DeepSpeed's own unscale_and_clip_grads computes the factor; torch._foreach_mul_ applies it) and the copy of the
    stepped fp32 masters into the bf16 weights (torch._foreach_copy_: the same rounding as copy_). The overflow
    check, the skip, the loss scale update and the inner optimizer's step are DeepSpeed's own calls."""
    from deepspeed.moe.utils import split_params_grads_into_shared_and_expert_params
    from deepspeed.runtime.utils import get_global_norm, is_invalid_grad_norm

    self.overflow = self.overflow_checker.check()
    if self.overflow:
        return self._skip_invalid_grad_norm()
    norm_groups = []
    for fp32_group, fp16_group in zip(self.fp32_groups, self.fp16_groups):
        grads_for_norm, _ = split_params_grads_into_shared_and_expert_params(fp16_group)
        norm_groups.append(_sequential_norm(grads_for_norm) if grads_for_norm else 0.0)
        pairs = []
        for fp32_param, fp16_param in zip(fp32_group, fp16_group):
            if fp16_param.grad is None:
                fp32_param.grad = torch.zeros(fp16_param.size(), dtype=fp32_param.dtype, device=fp32_param.device)
            else:
                fp32_param.grad = torch.empty_like(fp32_param)
                pairs.append((fp32_param.grad, fp16_param.grad))
        if pairs:
            torch._foreach_copy_([a for a, _ in pairs], [b for _, b in pairs])
    self._global_grad_norm = get_global_norm(norm_list=norm_groups)
    if is_invalid_grad_norm(self._global_grad_norm):
        return self._skip_invalid_grad_norm()
    self._update_scale(False)
    combined_scale = self.unscale_and_clip_grads(self._global_grad_norm, apply_scale=False)
    grads = [p.grad for group in self.fp32_groups for p in group if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, 1.0 / combined_scale)
    self.optimizer.step()
    for fp32_group, fp16_group in zip(self.fp32_groups, self.fp16_groups):
        for fp32_param in fp32_group:
            fp32_param.grad = None
        if fp16_group:
            with torch.no_grad():  # as `.data.copy_`, without a detach per tensor
                torch._foreach_copy_(fp16_group, fp32_group)
    return self.overflow


@contextlib.contextmanager
def accept_host_optimizer(optimizer):
    """Let ZeRO offload bf16 master weights for a client optimizer that steps them on the host (fluxzero.train.
    optim.host.HostAdamW), for the length of deepspeed.initialize; any other optimizer: nothing changes.

    deepspeed 0.19.8 offloads bf16 masters (bf16_master_weights_and_grads) only after asserting that the optimizer's
    class is exactly DeepSpeedCPUAdam: `type(self.optimizer) in [DeepSpeedCPUAdam]` (runtime/zero/stage_1_and_2.py
    _enforce_cpu_offload) and `type(self.optimizer) == DeepSpeedCPUAdam` (runtime/zero/stage3.py
    _enforce_optimizer_offload), so a subclass fails too. Its offload step itself calls only optimizer.step() on
    the host partition, like torch's optimizers. The class name those modules look up is rebound to the
    optimizer's class while the engine is built; the other uses of that name there are a comment, the hybrid
    (partial_offload < 1) branch that fluxzero never writes, and an unused deepspeed_adam_offload flag.
    """
    from fluxzero.train.optim.host import HostAdamW

    if not isinstance(optimizer, HostAdamW):
        yield
        return
    modules = [importlib.import_module(f"deepspeed.runtime.zero.{m}") for m in ("stage_1_and_2", "stage3")]
    saved = [m.DeepSpeedCPUAdam for m in modules]
    for m in modules:
        m.DeepSpeedCPUAdam = type(optimizer)
    try:
        yield
    finally:
        for m, cls in zip(modules, saved):
            m.DeepSpeedCPUAdam = cls
