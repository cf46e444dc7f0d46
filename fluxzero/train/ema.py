"""EMA of the trained weights, sharded like DeepSpeed shards the fp32 master weights (ShardedEMA).

Each rank averages only the fp32 masters its optimizer updates, so the EMA costs 4 B x P / N per rank
under ZeRO-1/2/3 (fp32; 2 B in bf16) and is updated without any communication:

    ZeRO-3        optimizer.fp32_partitioned_groups_flat[i]: its partition of every parameter of sub group
                  i, concatenated (param.ds_tensor's layout: partition_numel elements each, the last rank
                  padded); offsets from optimizer.grad_position, the same table DeepSpeed's own
                  get_local_fp32_param reads.
    ZeRO-1/2      optimizer.single_partition_of_fp32_groups[i]: a 1/N slice of the flattened param group;
                  which parameter elements it holds comes from each param's DeepSpeed `_hp_mapping`
                  (the lp <-> hp fragment table behind deepspeed.utils.safe_get_full_fp32_param).
    BF16_Optimizer (bf16 with fp32 gradient accumulation): fp32_groups_flat_partition[i], same mapping.
    ZeRO-0        bf16: the fp16/bf16 wrapper's fp32 copies (fp32_groups_flat / fp32_groups); fp32: the
                  parameters themselves. Every rank then holds (and averages) all of them.

Only parameters with requires_grad are averaged (DeepSpeed's groups hold only those), so with LoRA it is
the adapter alone. This module reads the engine and optimizer objects it is given and imports torch only.

Per-rank state (state_dict) is tensors only: one flat buffer per master group, the step, and the layout
(which elements of which parameter each buffer holds) as JSON bytes in a uint8 tensor, so a shard file is
self-describing. The consolidated EMA comes two ways:
  - ShardedEMA.full_state_dict(): a collective (bucketed reduce to rank 0, every rank calls it);
  - consolidate(files): offline from the per-rank files, one shard in memory at a time, on the CPU.

Trainer integration (after the trainer split), on every rank:
    ema = ShardedEMA(engine, cfg.ema, seed=cfg.seed)          # after deepspeed.initialize and weight load
    engine.step(); ema.update(engine.global_steps)            # idempotent per step: fine after every micro-step
    save_file(ema.state_dict(), ckpt / tag / shard_name(rank))  # beside DeepSpeed's files, per rank
    ema.load_state_dict(load_shard(ckpt / tag / shard_name(rank)))  # same world size; else consolidate() +
                                                               # load_full_state_dict()
    full = ema.full_state_dict()                              # rank 0: name -> CPU tensor, for any export layout
    with ema.swap(): sample(...)                              # sample from the EMA
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fluxzero.config.ema import EmaConfig
from fluxzero.config.user_files import parse_json
from fluxzero.dtypes import torch_dtype
from fluxzero.train.distributed import all_reduce, reduce

# the project's one bf16 stochastic rounding (fp32 bits + uniform 16-bit noise, truncated): an EMA with decay
# 0.9999 moves by 1e-4 of the gap per update, far below half a bf16 ulp, which round-to-nearest would drop
from fluxzero.train.optim.rounding import mix32, round_keyed

LAYOUT_VERSION = 1
_CHUNK = 1 << 24  # elements per slice of a bf16 or cross-device update: bounds the temporaries (64 MB fp32)
_BUCKET = 1 << 26  # elements per collective bucket when full tensors are assembled (256 MB fp32)


def _ema_bf16_(e, m, weight, key) -> None:
    """e (a bf16 slice of the EMA) <- lerp(e, m, weight) rounded stochastically, in place; `weight` a 0-d fp32
    tensor, `key` a 0-d int32 tensor (fluxzero.train.optim.rounding.round_keyed: a resume draws the same noise).

    Eagerly (CPU) a pass over the slice per line; on CUDA compiled into one kernel (`_fused_ema_bf16`): the eager
    bf16 update was several times the fp32 one (a plain lerp_) on FLUX.1-dev (benchmarks/RESULTS.md)."""
    x = e.float().lerp(m.float(), weight)
    e.copy_(round_keyed(x, key))


@functools.cache
def _fused_ema_bf16():
    return torch.compile(_ema_bf16_, dynamic=True, fullgraph=True)


@dataclass(frozen=True)
class Piece:
    """`numel` elements of parameter `name` (flattened, from element `start`) held by this rank in master /
    EMA buffer `buffer` from element `offset`; `local`: where they start in param.ds_tensor (ZeRO-3), else -1."""

    name: str
    buffer: int
    offset: int
    start: int
    numel: int
    local: int = -1


class ShardedEMA:
    """EMA of this rank's share of the fp32 master weights of a DeepSpeed engine.

    Call update(step) on every rank after engine.step(), with step = optimizer steps taken so far (1 after
    the first). It is a no-op off the config's `every` grid. Every method that assembles full tensors
    (full_state_dict, swap) is a collective: all ranks of the data-parallel group call it together.
    """

    def __init__(self, engine, config: EmaConfig, seed: int = 0):
        self.config, self.seed, self.step = config, int(seed), 0
        opt = engine.optimizer
        if opt is None:
            raise ValueError("the DeepSpeed engine has no optimizer; build it with one before the EMA")
        self._opt, self._module = opt, engine.module
        self._group = getattr(opt, "dp_process_group", None) if dist.is_initialized() else None
        self._rank = dist.get_rank(self._group) if dist.is_initialized() else 0
        self._world = dist.get_world_size(self._group) if dist.is_initialized() else 1
        self._comm_device = torch.device(getattr(engine, "device", "cpu"))
        self.kind, self._masters, pieces, self._replicated = _layout(opt, self._module)
        self._params = {n: p for n, p in self._module.named_parameters() if p.requires_grad}
        self._shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in self._params.items()}
        self._pieces = [pc for pc in pieces if pc.name in self._params]
        self._by_name: dict[str, list[Piece]] = {}
        for pc in self._pieces:
            self._by_name.setdefault(pc.name, []).append(pc)
        device = torch.device("cpu") if config.device == "cpu" else self._comm_device
        dtype = torch_dtype(config.dtype)
        with torch.no_grad():  # the EMA starts at the current weights (step 0)
            self._ema = [m.detach().reshape(-1).to(device=device, dtype=dtype, copy=True) for m in self._masters()]
        self._check_coverage()
        self.use_graphs = True  # CUDA: replay the update as one CUDA graph (_replay)
        self._graph, self._warm = None, None

    # ----- what this rank holds -------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        """EMA elements on this rank (partition padding included)."""
        return sum(e.numel() for e in self._ema)

    @property
    def nbytes(self) -> int:
        return sum(e.numel() * e.element_size() for e in self._ema)

    def layout(self) -> dict:
        """JSON-able description of this rank's shard: which elements of which parameter each buffer holds."""
        return {
            "version": LAYOUT_VERSION,
            "kind": self.kind,
            "rank": self._rank,
            "world": self._world,
            "replicated": self._replicated,
            "dtype": self.config.dtype,
            "buffers": [e.numel() for e in self._ema],
            "shapes": {n: list(s) for n, s in self._shapes.items()},
            "pieces": [[pc.name, pc.buffer, pc.offset, pc.start, pc.numel] for pc in self._pieces],
        }

    # ----- update -------------------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, step: int) -> bool:
        """ema = d * ema + (1 - d) * masters after optimizer step `step`; returns whether it updated."""
        if not self.config.updates_at(step) or step == self.step:  # off the grid, or this step already done
            return False
        weight = 1.0 - self.config.decay_at(step)
        masters = [m.detach().reshape(-1) for m in self._masters()]
        keys = self._keys(step)
        dev = self._ema[0].device if self._ema else torch.device("cpu")
        if self.use_graphs and dev.type == "cuda" and all(m.device == dev for m in masters):
            self._replay(masters, weight, keys)
        else:
            self._apply(
                masters,
                torch.tensor(weight, dtype=torch.float32).to(dev),
                None if keys is None else torch.tensor(keys, dtype=torch.int32).to(dev),
            )
        self.step = step
        return True

    def _keys(self, step: int) -> list[int] | None:
        """The bf16 EMA's rounding keys, one per slice: noise is a hash of (seed, step, rank, buffer, slice,
        element), so a resumed run draws exactly what the uninterrupted one drew, with no generator state to
        save. None for an fp32 EMA."""
        if not self._ema or self._ema[0].dtype != torch.bfloat16:
            return None
        return [
            mix32(self.seed, step, self._rank, i, lo)
            for i, e in enumerate(self._ema)
            for lo in range(0, e.numel(), _CHUNK)
        ]

    def _apply(self, masters: list[torch.Tensor], w: torch.Tensor, keys: torch.Tensor | None) -> None:
        """The update's kernels: `w` the 0-d fp32 weight and `keys` the slices' int32 keys (bf16), both on the
        EMA's device, so that a CUDA graph captured from this call replays any step after their values change."""
        bf16 = keys is not None
        update = _fused_ema_bf16() if bf16 and w.is_cuda else _ema_bf16_
        k = 0
        for ema, master in zip(self._ema, masters):
            if not bf16 and master.device == ema.device and master.dtype == ema.dtype:
                ema.lerp_(master, w)  # in place, no temporary
                continue
            # else slice by slice: an fp32 EMA of bf16 masters (the bf16 optimizer modes at ZeRO-0 step the bf16
            # weights themselves, and lerp_ takes no mixed dtypes), a bf16 EMA, or an EMA on another device
            for lo in range(0, ema.numel(), _CHUNK):
                e = ema[lo : lo + _CHUNK]
                if bf16:
                    update(e, master[lo : lo + _CHUNK].to(ema.device), w, keys[k])
                    k += 1
                else:
                    e.lerp_(master[lo : lo + _CHUNK].to(ema.device, torch.float32), w)

    def _replay(self, masters: list[torch.Tensor], weight: float, keys: list[int] | None) -> None:
        """_apply on CUDA as one CUDA graph: FLUX.1-dev's EMA is ~780 tensors in ~1,500 slices, and launching
        their kernels one by one from Python cost more than the memory traffic (benchmarks/RESULTS.md). The first update on a set of tensors runs
        eagerly (it compiles the kernels), the next captures the graph; every later one writes the step's weight
        and keys into the graph's inputs and replays it. A graph is only replayed over the tensors it was captured
        on: if DeepSpeed rebinds a master or the EMA buffers move, the next update captures again."""
        dev = self._ema[0].device
        sig = tuple(t.data_ptr() for t in (*self._ema, *masters))
        if self._graph is not None and sig == self._graph[0]:
            _, graph, w, k = self._graph
            w.fill_(weight)
            if k is not None:
                k.copy_(torch.tensor(keys, dtype=torch.int32))
            graph.replay()
            return
        w = torch.full((), weight, dtype=torch.float32, device=dev)
        k = None if keys is None else torch.tensor(keys, dtype=torch.int32).to(dev)
        if sig != self._warm:  # first update over these tensors: compile and run eagerly
            self._graph, self._warm = None, sig
            self._apply(masters, w, k)
            return
        graph = torch.cuda.CUDAGraph()
        # thread_local: the trainer's prefetch thread may copy the next batch to the GPU meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._apply(masters, w, k)
        self._graph = (sig, graph, w, k)
        graph.replay()

    # ----- per-rank state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shard as tensors only (safetensors / torch.load(weights_only=True) safe)."""
        sd = {f"ema.{i}": e for i, e in enumerate(self._ema)}
        sd["step"] = torch.tensor(self.step, dtype=torch.int64)
        sd["layout"] = torch.frombuffer(bytearray(json.dumps(self.layout()).encode()), dtype=torch.uint8)
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Restore this rank's shard saved by state_dict() at the same world size and partitioning."""
        theirs, ours = _read_layout(sd), self.layout()
        keys = ("kind", "rank", "world", "buffers", "shapes", "pieces")
        if any(theirs.get(k) != ours[k] for k in keys):
            raise ValueError(
                f"this EMA shard was saved by rank {theirs.get('rank')} of {theirs.get('world')} with another "
                f"partitioning than rank {ours['rank']} of {ours['world']} now ({theirs.get('kind')} vs "
                f"{ours['kind']}); consolidate the saved shards with fluxzero.train.ema.consolidate() and load "
                f"the result with load_full_state_dict()"
            )
        for i, e in enumerate(self._ema):
            e.copy_(sd[f"ema.{i}"].reshape(-1))
        self.step = int(sd["step"])

    @torch.no_grad()
    def load_full_state_dict(self, full: dict[str, torch.Tensor], step: int) -> None:
        """Take this rank's pieces from a consolidated EMA (any world size or ZeRO stage saved it)."""
        missing = sorted(set(self._shapes) - set(full))
        if missing:
            raise ValueError(
                f"the consolidated EMA lacks {len(missing)} trained parameters (e.g. {missing[0]!r}); "
                f"load one saved from this model"
            )
        for name, shape in self._shapes.items():
            if tuple(full[name].shape) != shape:
                raise ValueError(
                    f"the consolidated EMA has {name} of shape {tuple(full[name].shape)} but the "
                    f"model's is {shape}; load one saved from this model"
                )
        for pc in self._pieces:
            src = full[pc.name].reshape(-1)[pc.start : pc.start + pc.numel]
            self._ema[pc.buffer][pc.offset : pc.offset + pc.numel].copy_(src)
        self.step = int(step)

    # ----- full tensors (collectives) ---------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The consolidated EMA, name -> full CPU tensor, on group rank 0 ({} on the others). Collective.

        Parameters are assembled bucket by bucket on the engine's device (at most ~256 MB there at a time)
        and moved to the CPU, so a 12B export needs 4 B x P of host memory on rank 0 and no GPU copy.
        """
        out = {}
        for name, full in self._full_tensors(self._ema, list(self._shapes), to_all=False):
            out[name] = full.to("cpu", dtype, copy=True)
        return out

    @contextlib.contextmanager
    def swap(self):
        """Within the block the model's weights are the EMA (e.g. to sample from it); restored on exit.

        Collective, all ranks enter it together. Writes the EMA into what the model computes with: every full
        parameter a rank holds (ZeRO-0/1/2, and ZeRO-3's persistent small params) and ZeRO-3's local
        partitions (param.ds_tensor, gathered again at each forward). The optimizer's masters are untouched,
        except where DeepSpeed lets them alias the weights (fp32 at ZeRO-0 and ZeRO-3): those are copied to
        host memory first. On exit the weights are re-derived from the masters, as DeepSpeed's step does.
        """
        with torch.no_grad():
            masters = [m.detach() for m in self._masters()]
            backup = [m.to("cpu", copy=True) for m in masters] if self._aliased(masters) else None
            self._write_model(self._ema)
        try:
            yield self
        finally:
            with torch.no_grad():
                if backup is not None:
                    for m, b in zip(masters, backup):
                        m.copy_(b)
                self._write_model(masters)

    # ----- internals ----------------------------------------------------------------------------------
    def _check_coverage(self) -> None:
        """Every element of every trained parameter is held by exactly one rank (or by all, replicated)."""
        local = torch.tensor([sum(pc.numel for pc in self._pieces)], dtype=torch.float64)
        if self._world > 1 and not self._replicated:
            local = local.to(self._comm_device)
            all_reduce(local, group=self._group)
        total = sum(math.prod(s) for s in self._shapes.values())
        if int(local.item()) != total:
            raise RuntimeError(
                f"EMA layout of {self.kind} covers {int(local.item())} of {total} parameter elements; "
                f"this DeepSpeed version partitions differently than fluxzero.train.ema expects"
            )

    def _full_tensors(self, sources, names: list[str], to_all: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full fp32 tensor on the comm device) from `sources` (buffers laid out like the masters).

        Pieces are disjoint across ranks, so a bucket holding each rank's pieces and zeros elsewhere, summed
        over ranks, is the full tensor exactly (x + 0 = x in floating point; only -0.0 becomes +0.0).
        """
        start = 0
        while start < len(names):
            bucket, total = [], 0
            while start < len(names) and (not bucket or total + math.prod(self._shapes[names[start]]) <= _BUCKET):
                bucket.append(names[start])
                total += math.prod(self._shapes[names[start]])
                start += 1
            flat = torch.zeros(total, dtype=torch.float32, device=self._comm_device)
            bases, base = {}, 0
            for name in bucket:
                bases[name] = base
                for pc in self._by_name.get(name, ()):
                    src = sources[pc.buffer].reshape(-1)[pc.offset : pc.offset + pc.numel]
                    flat[base + pc.start : base + pc.start + pc.numel].copy_(src)
                base += math.prod(self._shapes[name])
            if self._world > 1 and not self._replicated:
                if to_all:
                    all_reduce(flat, group=self._group)
                else:
                    reduce(flat, group=self._group, group_dst=0)
            if to_all or self._rank == 0:
                for name in bucket:
                    n = math.prod(self._shapes[name])
                    yield name, flat[bases[name] : bases[name] + n].view(self._shapes[name])

    def _write_model(self, sources) -> None:
        for pc in self._pieces:  # ZeRO-3: the local partition the next forward gathers from
            if pc.local >= 0:
                p = self._params[pc.name]
                if getattr(p, "ds_secondary_tensor", None) is not None:
                    raise ValueError(
                        "swap() cannot update ZeRO++ hpZ secondary partitions; set "
                        "zero_hpz_partition_size to 1 to sample from the EMA"
                    )
                dst = p.ds_tensor.data.view(-1)
                if dst.numel() < pc.local + pc.numel:
                    raise ValueError(
                        "swap() needs the ZeRO-3 partitions in memory, but they are offloaded to NVMe; "
                        "use offload_param device cpu or none to sample from the EMA"
                    )
                dst[pc.local : pc.local + pc.numel].copy_(
                    sources[pc.buffer].reshape(-1)[pc.offset : pc.offset + pc.numel]
                )
        # Full weights wherever a rank holds them: ZeRO-0/1/2 always, ZeRO-3 for its persistent params (the
        # same set on every rank, so every rank joins the same collectives).
        held = [n for n, p in self._params.items() if p.numel() == math.prod(self._shapes[n])]
        for name, full in self._full_tensors(sources, held, to_all=True):
            self._params[name].data.copy_(full)

    def _aliased(self, masters) -> bool:
        ptrs = {m.untyped_storage().data_ptr() for m in masters if m.numel()}
        for p in self._params.values():
            for t in (p.data, getattr(p, "ds_tensor", None)):
                if t is not None and t.numel() and t.untyped_storage().data_ptr() in ptrs:
                    return True
        return False


def _layout(opt, module):  # noqa: C901
    """(kind, masters() -> list of tensors, pieces, replicated) for a DeepSpeed optimizer wrapper."""
    names = {id(p): n for n, p in module.named_parameters()}
    pieces = []
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3
        masters = lambda: opt.fp32_partitioned_groups_flat  # noqa: E731 (re-read: DeepSpeed may rebind them)
        for i, group in enumerate(opt.fp16_groups):
            if opt.fp32_partitioned_groups_flat[i].numel() == 0 and sum(p.ds_tensor.ds_numel for p in group):
                raise ValueError(
                    "the EMA needs the fp32 master partitions in memory, but this ZeRO-3 run swaps them "
                    "to NVMe; use offload_optimizer device cpu or none with an EMA"
                )
            offset = 0
            for p in group:
                pn = p.ds_tensor.ds_numel  # partition_numel: ceil(ds_numel / world), the last rank padded
                position = getattr(opt, "grad_position", {}).get(getattr(p, "ds_id", None))
                if position is not None and list(position) != [i, offset, pn]:
                    raise RuntimeError(
                        f"ZeRO-3 places {names[id(p)]} at {position}, not [{i}, {offset}, {pn}]; "
                        f"this DeepSpeed version lays out partitions differently"
                    )
                start = p.ds_zero_partition_rank * pn
                n = max(0, min(pn, p.ds_numel - start))
                if n:
                    pieces.append(Piece(names[id(p)], i, offset, start, n, local=0))
                offset += pn
        return "zero3", masters, pieces, False
    for kind, attr, groups in (
        ("zero1_2", "single_partition_of_fp32_groups", "bit16_groups"),
        ("bf16_optimizer", "fp32_groups_flat_partition", "bf16_groups"),
    ):
        if hasattr(opt, attr):
            masters = lambda attr=attr: getattr(opt, attr)  # noqa: E731
            for i, group in enumerate(getattr(opt, groups)):
                for p in group:
                    m = getattr(p, "_hp_mapping", None)  # None: no element of p in this rank's partition
                    if m is not None:
                        pieces.append(
                            Piece(
                                names[id(p)],
                                i,
                                m.hp_fragment_address.start,
                                m.lp_fragment_address.start,
                                m.hp_fragment_address.numel,
                            )
                        )
            return kind, masters, pieces, False
    if hasattr(opt, "fp32_groups_flat"):  # FP16_Optimizer (fused) in bf16 at ZeRO-0: unaligned flat copies
        for i, group in enumerate(opt.fp16_groups):
            offset = 0
            for p in group:
                pieces.append(Piece(names[id(p)], i, offset, 0, p.numel()))
                offset += p.numel()
        return "fp16_optimizer", lambda: opt.fp32_groups_flat, pieces, True
    if hasattr(opt, "fp32_groups"):  # FP16_UnfusedOptimizer in bf16 at ZeRO-0: one fp32 copy per param
        lp = [p for group in opt.fp16_groups for p in group]
        pieces = [Piece(names[id(p)], j, 0, 0, p.numel()) for j, p in enumerate(lp)]
        return "fp16_unfused", lambda: [t for group in opt.fp32_groups for t in group], pieces, True
    if isinstance(opt, torch.optim.Optimizer):  # fp32 at ZeRO-0: the parameters are the masters
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        pieces = [Piece(names[id(p)], j, 0, 0, p.numel()) for j, p in enumerate(params)]
        return "params", lambda: params, pieces, True
    raise ValueError(
        f"the EMA does not know the optimizer wrapper {type(opt).__name__}; it supports DeepSpeed's "
        f"ZeRO-0/1/2/3, BF16_Optimizer and FP16 optimizers"
    )


def shard_name(rank: int) -> str:
    """The file name of rank `rank`'s EMA shard inside a checkpoint folder."""
    return f"ema_rank_{rank:05d}.safetensors"


def _read_layout(sd: dict) -> dict:
    if "layout" not in sd:
        raise ValueError(
            "this is not an EMA shard (no 'layout' entry); pass files written from ShardedEMA.state_dict()"
        )
    return parse_json(bytes(sd["layout"].tolist()).decode())


def load_shard(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """One per-rank EMA file: .safetensors, or a torch.save file read with weights_only=True (unchecked: a
    checkpoint's shards are read with read_shard)."""
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


# ----- shard files in a checkpoint folder ------------------------------------------------------------------
# A shard file's safetensors header holds one metadata key (safetensors writes several in a random order, and a
# checkpoint's files must be byte-reproducible), as the data shards do (fluxzero/data/shards.py): JSON with the
# checkpoint step, the rank and world size that wrote it, and the XXH3-64 of its tensors' bytes, so a shard
# deleted, damaged in place, copied from another step or from another rank is named before anything is loaded.
SHARD_FORMAT, SHARD_VERSION, SHARD_META_KEY = "fluxzero-ema-shard", 1, "fluxzero.ema"


class ShardError(ValueError):
    """An EMA shard file that cannot be used, in one sentence naming it."""


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """XXH3-64 (hex) over the names and stored bytes of `tensors`, in sorted name order."""
    import xxhash

    h = xxhash.xxh3_64()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def shard_file(ema: ShardedEMA, step: int) -> bytes:
    """This rank's EMA shard as the bytes of its file in the checkpoint of step `step` (safetensors)."""
    from safetensors.torch import save

    tensors = {k: v.detach().contiguous().cpu() for k, v in ema.state_dict().items()}
    header = {
        "format": SHARD_FORMAT,
        "version": SHARD_VERSION,
        "step": int(step),
        "rank": ema._rank,
        "world": ema._world,
        "xxh3_64": _digest(tensors),
    }
    return save(tensors, metadata={SHARD_META_KEY: json.dumps(header, sort_keys=True)})


def read_shard(path, *, rank: int, world: int, step: int, advice: str) -> tuple[dict[str, torch.Tensor], str | None]:
    """(state dict, note) of rank `rank`'s shard in the checkpoint of step `step` saved by `world` ranks, checked
    before anything is loaded from it; ShardError (one sentence naming the file and ending in `advice`) when it is
    missing, unreadable, damaged, or from another step, rank or world size.

    A shard written before shards had a header loads unchecked, with a note: its layout entry still names the rank
    and world size that wrote it (checked here and again by load_state_dict), and refusing it would throw away
    the EMA of every run saved by an earlier fluxzero, which the damage it could hide does not justify.
    """
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ShardError(f"EMA shard {path} is missing, so the run's EMA cannot be restored; {advice}")
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}
        layout = _read_layout(sd)
    except Exception:  # safetensors and json raise several kinds for a truncated or foreign file
        raise ShardError(
            f"EMA shard {path} is not a readable EMA shard (truncated, overwritten or not written by "
            f"fluxzero); {advice}"
        ) from None
    note = None
    if SHARD_META_KEY in meta:
        try:
            head = parse_json(meta[SHARD_META_KEY])
            ok = head["format"] == SHARD_FORMAT and head["version"] == SHARD_VERSION
            saved = {k: int(head[k]) for k in ("step", "rank", "world")}
        except (ValueError, TypeError, KeyError):
            ok = False
        if not ok:
            raise ShardError(f"EMA shard {path} has a header fluxzero does not read; {advice}")
        if head.get("xxh3_64") != _digest(sd):
            raise ShardError(f"EMA shard {path} fails its checksum, so its bytes changed after it was saved; {advice}")
    else:
        saved = {"step": step, "rank": layout.get("rank"), "world": layout.get("world")}
        note = f"note: EMA shard {path} predates EMA shard checksums and is loaded unchecked"
    for key, want in (("rank", rank), ("world", world), ("step", step)):
        if saved[key] != want:
            what = {
                "rank": f"rank {saved['rank']}'s EMA",
                "world": f"the EMA of a {saved['world']}-rank run",
                "step": f"the EMA of step {saved['step']}",
            }[key]
            mine = {"rank": f"rank {rank}'s", "world": f"this {world}-rank checkpoint's", "step": f"step {step}'s"}[key]
            raise ShardError(f"EMA shard {path} holds {what}, not {mine} (copied from elsewhere); {advice}")
    return sd, note


def consolidate(shards: Iterable, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The full EMA (name -> CPU tensor) from every rank's state_dict() or file, offline, no process group.

    Shards are read one at a time, so the host needs the full EMA plus one shard, and no GPU at all.
    """
    out: dict[str, torch.Tensor] = {}
    seen, world, replicated = set(), None, False
    for sd in shards:
        if isinstance(sd, (str, os.PathLike)):
            sd = load_shard(sd)
        lay = _read_layout(sd)
        if world is not None and lay["world"] != world:
            raise ValueError(
                f"the EMA shards come from runs of {world} and {lay['world']} ranks; pass the shards of one checkpoint"
            )
        world, replicated = lay["world"], replicated or lay["replicated"]
        seen.add(lay["rank"])
        for name, shape in lay["shapes"].items():
            if name not in out:
                out[name] = torch.zeros(math.prod(shape), dtype=dtype)
        for name, buf, offset, start, n in lay["pieces"]:
            src = sd.get(f"ema.{buf}")
            if (
                name not in out
                or src is None
                or min(offset, start, n) < 0
                or offset + n > src.numel()
                or start + n > out[name].numel()
            ):  # a layout that does not fit its buffers: say so, not crash
                raise ValueError(
                    f"rank {lay['rank']}'s EMA shard places {n} values of {name} at {offset} of its "
                    f"buffer {buf}, which it does not hold"
                )
            out[name][start : start + n] = src.reshape(-1)[offset : offset + n]
        del sd
        if replicated:  # ZeRO-0: any one rank holds the whole EMA
            break
    if world is None:
        raise ValueError("no EMA shards were given; pass every rank's file of one checkpoint")
    if not replicated and seen != set(range(world)):
        missing = sorted(set(range(world)) - seen)
        raise ValueError(f"the EMA shards of ranks {missing} of {world} are missing; pass every rank's file")
    shapes = lay["shapes"]
    return {name: t.view(shapes[name]) for name, t in out.items()}
