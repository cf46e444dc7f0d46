"""Transformer blocks whose bf16 weights live in host memory and are streamed to the accelerator one block ahead
(DeepSpeed config "fluxzero": {"offload_blocks": K}: the LAST K blocks, double then single, one index): a fused
mode's weights, or a LoRA's frozen base weights.

Applied from outside the model, like compile and checkpointing (fluxzero.train.engine builds it):
- Host storage: one plain CPU tensor per streamed block, exactly its parameters' bytes (each tensor's start
  aligned to ALIGN bytes), pinned with cudaHostRegister (torch's pinned allocator rounds every allocation up to
  a power of two: about a third more host memory for FLUX.1's blocks). The block's parameters are views into
  it between uses; `place()` puts each module's freshly built (and pretrained) tensors there as the model is
  built, so the streamed weights never sit on the accelerator all at once.
- Forward: each streamed block is run under non-reentrant activation checkpointing (otherwise autograd would
  keep its accelerator weights alive until backward). Entering it waits for its copy (host -> device on a side
  CUDA stream, ordered by events) and starts the next streamed block's copy; leaving it points the parameters
  back at the host (the last streamed block stays: backward needs it first).
- Backward: the recompute of block j fetches it again (and starts block j-1's copy: reverse order). Once every
  trained tensor of the block has been stepped (fluxzero.train.optim.fused_step calls `stepped`), the updated bytes
  are copied back to the host on a second side stream and the device copy is released to the allocator.
- `finish()` (the optimizer's step and state_dict) writes back and releases anything still on the device and
  waits for the write-backs, so the host copies are what a checkpoint saves.
- A LoRA's frozen base (no fused step; its adapters inside streamed blocks stay on the device, DeepSpeed's like
  the others): nothing is written back. A block's device copy is released when the next block in reverse order
  starts its recompute (its own backward is then done), the last one's at the end of the backward pass.
On the CPU the "host" and "device" copies are both CPU memory (no pinning, no streams); the same fetch, write-back
and release happen, so the logic is tested there.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from fluxzero.train.host_memory import host_available, within

ALIGN = 256  # bytes: each tensor's start in a block's buffer (the copies are one memcpy per block either way)

# Pinned host buffers stay registered for the life of the process: unregistering memory that views still reference
# would leave the copies reading pageable memory, and a process holds one streamed model.
_REGISTERED: list[torch.Tensor] = []


def host_shortfall(need: int, available: int | None, k: int) -> str | None:
    """The sentence refusing `need` bytes of streamed weights when the host has not `available`
    (fluxzero.train.host_memory: with 10% kept free), or None. The trainer checks the run's whole host need first
    (host_memory.check_run); this check holds for any other caller of plan()."""
    if within(need, available):
        return None
    return (
        f"fluxzero.offload_blocks {k} keeps {need / 2**30:.1f} GiB of block weights in host memory, but "
        f"{available / 2**30:.1f} GiB is available on this machine: lower offload_blocks, or let `fluxzero "
        f"gen-config --fit --host-memory GIB` choose it for the memory this machine has"
    )


def streamed_names(n_double: int, n_single: int, k: int) -> list[str]:
    """Module names of the last `k` blocks in forward order (double blocks first, single blocks after)."""
    names = [f"double_blocks.{i}" for i in range(n_double)] + [f"single_blocks.{i}" for i in range(n_single)]
    return names[len(names) - k :] if k > 0 else []


@dataclass
class _Block:
    name: str
    host: torch.Tensor  # uint8, the block's bytes
    slots: dict  # parameter name inside the block -> (byte offset, shape, dtype)
    module: nn.Module | None = None  # filled by attach()
    params: list = field(default_factory=list)  # (parameter, its host view), filled by attach()
    trained: int = 0  # parameters with requires_grad: stepped() counts down from it in backward
    pending: int = 0
    device_buf: torch.Tensor | None = None
    device_views: list | None = None
    ready: object = None  # CUDA event: the host -> device copy is done
    written: object = None  # CUDA event: the last write-back is done
    dirty: bool = False  # the device copy holds updates the host has not


def _pin(t: torch.Tensor) -> bool:
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(rc) != 0:
        return False
    _REGISTERED.append(t)
    return True


class BlockStreamer:
    """Host storage and streaming of the last K blocks; plan with `plan()`, fill with `place()`, then `attach()`."""

    def __init__(self, blocks: list[_Block], device: torch.device):
        self.blocks, self.device = blocks, torch.device(device)
        self._by_name = {b.name: b for b in blocks}
        self._of_param: dict = {}
        self._end_queued = False  # a frozen block's release is queued for the end of this backward pass
        self.cuda = self.device.type == "cuda"
        self._h2d = torch.cuda.Stream(self.device) if self.cuda else None
        self._d2h = torch.cuda.Stream(self.device) if self.cuda else None

    # ---- building -------------------------------------------------------------------------------------------
    @classmethod
    def plan(cls, meta_model: nn.Module, k: int, device: torch.device) -> BlockStreamer:
        """Host buffers for the last `k` blocks of `meta_model` (a model on the meta device, in its training
        dtype: only shapes and dtypes are read), pinned when `device` is CUDA."""
        names = streamed_names(len(meta_model.double_blocks), len(meta_model.single_blocks), k)
        cuda = torch.device(device).type == "cuda"
        layouts = []
        for name in names:
            slots, offset = {}, 0
            for pname, p in meta_model.get_submodule(name).named_parameters():
                slots[pname] = (offset, tuple(p.shape), p.dtype)
                offset += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
            layouts.append((name, slots, offset))
        short = host_shortfall(sum(n for _, _, n in layouts), host_available(), k)
        if short:  # before anything is allocated
            raise MemoryError(short)
        blocks, unpinned = [], 0
        for name, slots, offset in layouts:
            # zeros, not empty: a checkpoint saves the whole buffer (its tensors are views), padding included
            host = torch.zeros(offset, dtype=torch.uint8)
            if cuda and not _pin(host):
                unpinned += host.numel()
            blocks.append(_Block(name, host, slots))
        if unpinned:
            warnings.warn(
                f"cudaHostRegister refused {unpinned / 2**30:.1f} GiB of streamed block weights: their "
                f"copies run from pageable memory, synchronously and slower",
                stacklevel=2,
            )
        return cls(blocks, device)

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.blocks]

    @property
    def host_bytes(self) -> int:
        return sum(b.host.numel() for b in self.blocks)

    def _view(self, block: _Block, pname: str) -> torch.Tensor:
        offset, shape, dtype = block.slots[pname]
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return block.host[offset : offset + n].view(dtype).view(shape)

    @torch.no_grad()
    def place(self, name: str, module: nn.Module) -> None:
        """Move `module`'s own parameters (module name `name` in the model) into their block's host buffer, if
        the module is inside a streamed block (build_model's per-module finish step calls this)."""
        block = next((b for b in self.blocks if name.startswith(b.name + ".")), None)
        if block is None:
            return
        inner = name[len(block.name) + 1 :]
        for pname, p in module.named_parameters(recurse=False):
            view = self._view(block, f"{inner}.{pname}")
            view.copy_(p.detach())
            p.data = view

    def attach(self, model: nn.Module) -> None:
        """Check every streamed parameter is its host view, checkpoint and wrap the streamed blocks' forwards, and
        start the first streamed block's copy as the model's forward begins."""
        for j, block in enumerate(self.blocks):
            module = block.module = model.get_submodule(block.name)
            # by address: adapters wrapping a linear rename its weight (`.base_layer.weight`) but keep the tensor
            views = {v.data_ptr(): v for v in (self._view(block, s) for s in block.slots)}
            for p in module.parameters():
                view = views.pop(p.data_ptr(), None)
                if view is not None:
                    block.params.append((p, view))
                    self._of_param[p] = block
                elif not p.requires_grad:
                    raise AssertionError(f"a frozen parameter of {block.name} is outside its host buffer")
            if views:
                raise AssertionError(
                    f"{len(views)} parameters of {block.name} are not in its host buffer: place() missed them"
                )
            block.trained = sum(1 for p, _ in block.params if p.requires_grad)
            module.forward = functools.partial(self._forward, j, module.forward)
        if self.blocks:
            model.register_forward_pre_hook(lambda m, args: self._begin())

    def _begin(self) -> None:
        self._end_queued = False  # a backward that raised never ran its queued release
        self._fetch(self.blocks[0])

    def modules(self) -> list[nn.Module]:
        return [b.module for b in self.blocks]

    def streams(self, p: torch.Tensor) -> bool:
        """Whether parameter `p` is streamed (a LoRA's adapters inside a streamed block are not: they stay on the
        device)."""
        return p in self._of_param

    @torch.no_grad()
    def broadcast(self, src: int = 0) -> None:
        """Rank `src`'s streamed weights to every rank, one block at a time through the device (NCCL cannot send
        host tensors)."""
        import torch.distributed as dist

        for block in self.blocks:
            buf = block.host.to(self.device) if self.cuda else block.host
            dist.broadcast(buf, src=src)
            if buf is not block.host:
                block.host.copy_(buf)

    # ---- forward and recompute ------------------------------------------------------------------------------
    def _forward(self, j: int, forward, *args):
        if not torch.is_grad_enabled():  # sampling, validation: no backward follows
            with self._entered(j, ahead=1, keep=False):
                return forward(*args)
        return torch.utils.checkpoint.checkpoint(
            forward,
            *args,
            use_reentrant=False,
            context_fn=lambda: (
                self._entered(j, ahead=1, keep=j == len(self.blocks) - 1),
                self._entered(j, ahead=-1, keep=True, recompute=True),
            ),
        )

    def _entered(self, j: int, ahead: int, keep: bool, recompute: bool = False):
        streamer = self

        class _Ctx:
            def __enter__(self):
                block = streamer.blocks[j]
                streamer._acquire(block)
                if recompute:
                    block.pending = block.trained
                    if not block.trained:
                        streamer._frozen_recompute(j)
                if 0 <= j + ahead < len(streamer.blocks):
                    streamer._fetch(streamer.blocks[j + ahead])

            def __exit__(self, *exc):
                if not keep:
                    streamer._release(streamer.blocks[j])
                return False

        return _Ctx()

    # ---- copies ---------------------------------------------------------------------------------------------
    def _fetch(self, block: _Block) -> None:
        """Start copying `block` to the device (nothing if it is there or on its way)."""
        if block.device_buf is not None:
            return
        if not self.cuda:
            block.device_buf = block.host.clone()
        else:
            with torch.cuda.stream(self._h2d):
                if block.written is not None:
                    self._h2d.wait_event(block.written)  # the last write-back of this block went first
                block.device_buf = torch.empty_like(block.host, device=self.device)
                block.device_buf.copy_(block.host, non_blocking=True)
                block.ready = torch.cuda.Event()
                block.ready.record(self._h2d)
        buf, base = block.device_buf, block.host.data_ptr()
        block.device_views = [
            buf[v.data_ptr() - base : v.data_ptr() - base + v.numel() * v.element_size()].view(v.dtype).view(v.shape)
            for _, v in block.params
        ]

    def _acquire(self, block: _Block) -> None:
        """Point the block's parameters at its device copy, once the copy is done (on the current stream)."""
        self._fetch(block)
        if self.cuda and block.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(block.ready)
            block.device_buf.record_stream(current)  # freed only once the work queued here is done
            block.ready = None
        for (p, _), view in zip(block.params, block.device_views):
            p.data = view

    def _release(self, block: _Block) -> None:
        """Point the block's parameters back at the host and drop the device copy (written back first if it
        holds updates)."""
        if block.device_buf is None:
            return
        if block.dirty:
            self._write_back(block)
        for p, view in block.params:
            p.data = view
        block.device_buf = block.device_views = block.ready = None

    def _write_back(self, block: _Block) -> None:
        if not self.cuda:
            block.host.copy_(block.device_buf)
        else:
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))  # after the step that wrote it
            with torch.cuda.stream(self._d2h):
                block.host.copy_(block.device_buf, non_blocking=True)
                block.device_buf.record_stream(self._d2h)
                block.written = torch.cuda.Event()
                block.written.record(self._d2h)
        block.dirty = False

    def _frozen_recompute(self, j: int) -> None:
        """Block j (its streamed weights frozen: a LoRA's base) is recomputed in backward, so the backward of
        block j+1, recomputed before it, is done: release that one. The end of the backward pass releases the
        rest (nothing is written back: frozen weights never change)."""
        if j + 1 < len(self.blocks):
            self._release(self.blocks[j + 1])
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._end_queued = False
        for block in self.blocks:
            if not block.trained:
                self._release(block)

    # ---- the fused step's side ------------------------------------------------------------------------------
    def stepped(self, p: torch.Tensor) -> None:
        """Parameter `p` was updated in place; once its whole block is, write the block back and release it."""
        block = self._of_param.get(p)
        if block is None:
            return
        if block.device_buf is None:
            raise AssertionError(f"a parameter of {block.name} was stepped while the block was not on the device")
        block.dirty = True
        block.pending -= 1
        if block.pending <= 0:
            self._release(block)

    def finish(self) -> None:
        """Release every block still on the device (written back when updated) and wait for the write-backs."""
        for block in self.blocks:
            self._release(block)
        if self.cuda:
            self._d2h.synchronize()
