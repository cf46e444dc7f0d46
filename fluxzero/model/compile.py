"""Compiled transformer blocks, applied from outside the model: the one helper the trainer (fluxzero.train.engine)
and `fluxzero sample --compile` share. Torch only, so sampling compiles without importing DeepSpeed."""
from __future__ import annotations

import functools

import torch


def apply_compile(model, mode: str = "default", backend: str = "inductor") -> int:
    """torch.compile every transformer block (double and single); returns how many. The trainer calls it
    before fluxzero.train.engine.apply_activation_checkpointing; `fluxzero sample --compile` on the loaded model.

    Applied from outside, like checkpointing: each block's forward is replaced by a compiled callable, so
    parameter names, state dicts and checkpoints do not change and the model stays plain PyTorch. One
    compiled function per block class, with the block as its first argument: all blocks of a class share
    its graphs (Dynamo treats the module and its parameters as inputs), two graphs for the whole model.

    Order with checkpointing: checkpoint(compiled block). torch.utils.checkpoint (non-reentrant) and
    deepspeed.checkpointing then recompute through the compiled code, at every ZeRO stage. Under ZeRO-3 call
    fluxzero.train.engine.zero3_leaf_blocks too, or DeepSpeed's per-submodule hooks split every block's graph.
    """
    kwargs = {"backend": backend}
    if backend == "inductor":
        kwargs["mode"] = mode
    blocks = list(model.double_blocks) + list(model.single_blocks)
    compiled = {}
    for block in blocks:
        cls = type(block)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, **kwargs)
        block.forward = functools.partial(compiled[cls], block)
    return len(blocks)
