"""Activation checkpointing of the transformer blocks, applied from outside the model (fluxzero.train.engine applies
it, around or inside the compiled blocks): which blocks are recomputed in backward (checkpointed_indices), by which
implementation (torch.utils.checkpoint or deepspeed.checkpointing) and with which policy ("full" recomputes the whole
block, "selective" keeps its matmul and attention outputs: selective_policy).
"""

from __future__ import annotations

import functools

import torch

from fluxzero.config.deepspeed.view import DSView
from fluxzero.train.distributed import TrainingError


def _checkpointed(checkpoint_fn, forward, *args):
    return checkpoint_fn(forward, *args)


def _selective_ops() -> frozenset:
    """The ops whose outputs selective checkpointing keeps: the matmuls (the linears' addmm / mm, bmm, FP8's
    _scaled_mm) and attention's kernels (SDPA dispatches to one of these), where a block's FLOPs are. Everything
    else in a block is pointwise or a reduction over one row (norms, modulation, RoPE, GELU, gates): cheap to
    recompute and, kept, most of the block's saved bytes. Names this torch build lacks are left out."""
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def selective_policy(ctx, op, *args, **kwargs):
    """torch.utils.checkpoint's policy for fluxzero.activation_checkpointing.policy selective: keep what
    _selective_ops lists, recompute the rest (the memory model counts the same: memory.double_block_kept). What
    runs without autograd (a DoRA's weight norm, fluxzero.model.lora) backward never reads: recomputed too, except
    _scaled_mm, which runs inside an autograd.Function's forward (lora.base_quant fp8-matmul's,
    fluxzero.model.fp8_matmul), where torch always turns autograd off: it is a linear's matmul, the work this policy
    keeps so as not to redo it."""
    from torch.utils.checkpoint import CheckpointPolicy

    keep = op in _SELECTIVE_OPS and (torch.is_grad_enabled() or op in _FP8_MATMULS)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


_SELECTIVE_OPS = _selective_ops()
_FP8_MATMULS = frozenset(op for op in _SELECTIVE_OPS if op.name() == "aten::_scaled_mm")


def _selective_contexts():
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(selective_policy)


def _torch_linear(forward, *args):
    """forward(*args) with torch.nn.functional.linear torch's own for its length.

    ZeRO-3's zero.Init replaces it for the whole process with DeepSpeed's LinearFunctionForZeroStage3, which adds the
    bias in place onto the matmul's output: the very tensor the selective policy keeps, so the recompute would add
    it a second time (measured: ZeRO-3 losses off by 1e-3 after one step). torch's own linear adds it out of place
    (addmm). What DeepSpeed's version saves instead of torch's (the weight, not a view of its gathered storage) does
    not matter here: inside a checkpointed block torch's saved tensors live only from the recompute to the block's
    backward, while the parameters are gathered anyway. Under torch.compile the graph is functional and the in-place
    add harmless: the compiled path does not need this.
    """
    patched = torch.nn.functional.linear
    torch.nn.functional.linear = torch._C._nn.linear
    try:
        return forward(*args)
    finally:
        torch.nn.functional.linear = patched


def _selective_checkpoint(forward, *args, compiled: bool = False):
    return torch.utils.checkpoint.checkpoint(
        forward if compiled else functools.partial(_torch_linear, forward),
        *args,
        use_reentrant=False,
        context_fn=_selective_contexts,
    )


def checkpoint_function(
    implementation: str = "torch", policy: str = "full", v: DSView | None = None, compiled: bool = False
):
    """fn(forward, *args) that runs a block checkpointed by `implementation` with `policy` (fluxzero.config.deepspeed.check's names;
    deepspeed.checkpointing's options from `v`); `compiled`: fn runs inside the compiled graph. The DeepSpeed config
    check refuses the selective policy with implementation deepspeed."""
    if implementation == "deepspeed":
        import deepspeed

        if policy != "full":
            raise TrainingError(
                "fluxzero.activation_checkpointing.policy selective needs implementation torch: "
                "deepspeed.checkpointing recomputes whole blocks"
            )
        deepspeed.checkpointing.configure(
            None,
            partition_activations=bool(v and v.partition_activations),
            checkpoint_in_cpu=bool(v and v.cpu_checkpointing),
            synchronize=False,
            profile=False,
        )
        return deepspeed.checkpointing.checkpoint
    if policy == "selective":
        return functools.partial(_selective_checkpoint, compiled=compiled)
    return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def checkpointed_indices(model, every_k: int, skip_last: int = 0) -> frozenset[int]:
    """Indices (double blocks, then single ones) of the blocks checkpointing every k-th block recomputes: block i
    iff i % every_k == 0, the last `skip_last` (streamed: the BlockStreamer checkpoints them) left out."""
    n = len(model.double_blocks) + len(model.single_blocks)
    return frozenset(i for i in range(n - skip_last) if every_k > 0 and i % every_k == 0)


def apply_activation_checkpointing(
    model, every_k: int, implementation: str, v: DSView | None = None, skip_last: int = 0, policy: str = "full"
) -> int:
    """Recompute every k-th transformer block (double then single) in backward; returns how many.

    Applied from outside: the block's bound forward is wrapped, so parameter names (and checkpoints)
    do not change. Blocks take only positional tensors, which both implementations require. The last `skip_last`
    blocks are left alone: they are streamed, and the BlockStreamer checkpoints them itself. `policy`:
    "full" recomputes the whole block, "selective" keeps its matmul and attention outputs (selective_policy).
    """
    chosen = checkpointed_indices(model, every_k, skip_last)
    if not chosen:
        return 0
    fn = checkpoint_function(implementation, policy, v)
    blocks = list(model.double_blocks) + list(model.single_blocks)
    for i in chosen:
        blocks[i].forward = functools.partial(_checkpointed, fn, blocks[i].forward)
    return len(chosen)
