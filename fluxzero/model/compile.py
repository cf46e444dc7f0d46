"""Compiled transformer blocks, applied from outside the model: the one helper the trainer (fluxzero.train.engine)
and `fluxzero sample --compile` share. Torch only, so sampling compiles without importing DeepSpeed."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_cache_dir() -> str | None:
    """The folder of Inductor's on-disk caches (compiled graphs, autograd graphs, Triton kernels), which make a
    later run's compile of the same blocks a cache read: TORCHINDUCTOR_CACHE_DIR where the user set it, else
    $XDG_CACHE_HOME/fluxzero/inductor (~/.cache/fluxzero/inductor), which outlives the /tmp folder torch
    picks by default and, on a shared home directory, serves every node. Sets the variable for this process;
    where that folder cannot be made (a read-only home), leaves it unset and torch keeps its own."""
    if not os.environ.get(CACHE_ENV):
        folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fluxzero" / "inductor"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        os.environ[CACHE_ENV] = str(folder)
    return os.environ[CACHE_ENV]


ARTIFACTS_FILE = "compile_cache.bin"  # beside the checkpoints: torch.compiler's portable cache of a run's compile


def _keys(info) -> frozenset:
    """The (kind, key) pairs of a torch CacheInfo."""
    return frozenset((kind, key) for kind, keys in getattr(info, "artifacts", {}).items() for key in keys)


def load_artifacts(path: str | os.PathLike) -> tuple[int, frozenset] | None:
    """Hot-load a file `save_artifacts` wrote (torch.compiler.load_cache_artifacts: Inductor's graphs, AOTAutograd's
    joint graphs, Triton kernels and autotuning results, as an earlier run on any machine compiled them), so that
    compiling the same blocks reads them instead of compiling again; entries of another torch, Triton or GPU are
    not used (torch checks). Returns (the file's bytes, the entries loaded, for `save_artifacts`); None when there
    is no file or this torch has no such API. Raises ValueError for a file torch cannot read (it only logs that)."""
    path = Path(path)
    if not path.is_file() or not hasattr(torch.compiler, "load_cache_artifacts"):
        return None
    data = path.read_bytes()
    info = torch.compiler.load_cache_artifacts(data)
    if info is None:
        raise ValueError("not a compile cache this torch can read")
    return len(data), _keys(info)


def save_artifacts(path: str | os.PathLike, loaded: frozenset = frozenset()) -> frozenset | None:
    """Write what this process compiled, or loaded and used, as one file (torch.compiler.save_cache_artifacts),
    replacing `path` whole (a temporary file, then a rename: a crash leaves the old file or the new one, never half
    of one). Returns the entries written; None when nothing was written: nothing to save (eager blocks, or a
    backend that caches nothing, such as aot_eager), no such API in this torch, or `loaded` (the entries the file
    held when this process loaded it) not all used yet while nothing new was compiled -- torch saves only the
    entries a process used, so writing then would drop the buckets this run has not met yet.

    Call it once per process: torch serializes each call's new entries as one more batch per kind and, loading,
    keeps only the last batch of each kind (torch 2.11-2.13), so a second call's file would lose the first's."""
    if not hasattr(torch.compiler, "save_cache_artifacts"):
        return None
    saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[0]:
        return None
    keys = _keys(saved[1])
    if not (keys >= loaded or keys - loaded):
        return None
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(saved[0])
    os.replace(tmp, path)
    return keys


def apply_compile(
    model,
    mode: str = "default",
    backend: str = "inductor",
    dynamic_tokens: bool | None = None,
    token_counts: int = 1,
    checkpoint=None,
) -> int:
    """torch.compile every transformer block (double and single); returns how many. The trainer calls it
    before fluxzero.train.recompute.apply_activation_checkpointing; `fluxzero sample --compile` on the loaded model.

    Applied from outside, like checkpointing: each block's forward is replaced by a compiled callable, so
    parameter names, state dicts and checkpoints do not change and the model stays plain PyTorch. One
    compiled function per block class, with the block as its first argument: all blocks of a class share
    its graphs (Dynamo treats the module and its parameters as inputs), two graphs for the whole model.

    Image token counts (aspect buckets), `dynamic_tokens`:
      True   the token axis is a symbolic size from the first call on (see `_tokens_dynamic`): one graph per
             block class serves every bucket.
      False  a graph per token count with every size fixed (torch.compile(dynamic=False)); Dynamo's recompile
             limit is raised so that `token_counts` buckets all get theirs instead of falling back to eager.
      None   Dynamo's default: the first token count gets graphs for that size alone, the second compiles again
             with the axis symbolic (automatic dynamic shapes), which then serves the rest.

    Inductor's caches go to compile_cache_dir(), so a run after the first reads its graphs and kernels from disk.

    Order with checkpointing: checkpoint(compiled block). torch.utils.checkpoint (non-reentrant) and
    deepspeed.checkpointing then recompute through the compiled code, at every ZeRO stage. Under ZeRO-3 call
    fluxzero.train.engine.zero3_leaf_blocks too, or DeepSpeed's per-submodule hooks split every block's graph.
    `checkpoint` (fn, indices) puts it the other way round for the blocks at those indices (double, then single):
    compiled(fn(block forward)), as selective checkpointing needs (its policy decides, inside the graph, which
    outputs the compiled forward keeps for backward; wrapped around compiled code it sees one opaque op).
    """
    kwargs = {"backend": backend}
    if backend == "inductor":
        kwargs["mode"] = mode
        compile_cache_dir()
    fn, inside = checkpoint if checkpoint is not None else (None, frozenset())
    if dynamic_tokens is False:
        kwargs["dynamic"] = False
        # the limit counts graphs per compiled function: each token count needs its own, and each may come in a
        # few guard variants (grad mode for validation, a checkpoint's recompute); the checkpointed forward's code
        # serves both block classes
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, (4 * token_counts + 4) * (2 if inside else 1))
    blocks = list(model.double_blocks) + list(model.single_blocks)
    compiled = {}
    for i, block in enumerate(blocks):
        key = (type(block), i in inside)
        if key not in compiled:
            forward = _checkpointed_forward(fn, type(block).forward) if i in inside else type(block).forward
            compiled[key] = torch.compile(forward, **kwargs)
        block.forward = functools.partial(compiled[key], block)
        if dynamic_tokens:
            block.forward = functools.partial(_tokens_dynamic, block.forward)
    return len(blocks)


def _checkpointed_forward(checkpoint_fn, forward):
    """forward(block, *args) run under checkpoint_fn (fn(function, *args), as torch.utils.checkpoint)."""

    def checkpointed(block, *args):
        return checkpoint_fn(forward, block, *args)

    return checkpointed


def _tokens_dynamic(forward, *args):
    """Call a compiled block with its token axes marked dynamic: dim 1 of the tokens (the first argument:
    img (B, L_img, C) of a double block, x (B, L, C) of a single one) and dim 3 of the RoPE table (the last:
    pe (2, B, 1, L, D)). `maybe_mark_dynamic`, not `mark_dynamic`: Dynamo relates the two (L = L_txt + L_img)
    and may keep one size fixed where a layer needs it, which is a recompile, never an error mid-training."""
    torch._dynamo.maybe_mark_dynamic(args[0], 1)
    torch._dynamo.maybe_mark_dynamic(args[-1], 3)
    return forward(*args)
