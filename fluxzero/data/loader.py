"""Distributed, bucketed, resumable loader over a shard directory or a synthetic source.

Epoch plan (the same on every rank, computed from seed, epoch and the latent size of every sample):
  1. group sample indices by latent size (bucket) and shuffle each bucket with a generator seeded by
     (seed, epoch, bucket);
  2. cut each bucket into GLOBAL batches of micro_batch x world_size samples; the bucket's remainder is
     either filled by wrapping around to the start of the same shuffled bucket (remainder="wrap", the
     default: every sample is seen at least once per epoch and each bucket adds fewer than
     micro_batch x world_size repeats, cycling through the bucket again if it is smaller than that) or
     dropped (remainder="drop": no sample twice, fewer than micro_batch x world_size per bucket skipped,
     a different random set each epoch; a bucket smaller than that is skipped entirely);
  3. shuffle the order of the global batches (buckets interleave);
  4. rank r takes rows [r*micro_batch, (r+1)*micro_batch) of every global batch.
So every rank runs exactly len(loader) batches per epoch, all ranks work on the same latent size at each
step, and within one epoch the ranks' samples are disjoint (apart from the stated wrap-around).
"""

from __future__ import annotations

import hashlib

from fluxzero.data.errors import DataError
from fluxzero.data.synthetic import SyntheticSource, is_synthetic

REMAINDER = ("wrap", "drop")


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:7], "little")


def epoch_plan(
    sizes: list[tuple[int, int]], global_batch: int, seed: int, epoch: int, remainder: str = "wrap"
) -> list[list[int]]:
    """Global batches (lists of `global_batch` sample indices, one latent size each) for one epoch."""
    import torch

    buckets: dict[tuple[int, int], list[int]] = {}
    for i, hw in enumerate(sizes):
        buckets.setdefault(tuple(hw), []).append(i)
    batches = []
    for hw in sorted(buckets):
        idx = buckets[hw]
        g = torch.Generator().manual_seed(_seed(seed, epoch, *hw))
        order = [idx[j] for j in torch.randperm(len(idx), generator=g).tolist()]
        if remainder == "drop":
            order = order[: len(order) - len(order) % global_batch]
        else:
            pad = -len(order) % global_batch
            order = order + [order[k % len(order)] for k in range(pad)]
        batches += [order[k : k + global_batch] for k in range(0, len(order), global_batch)]
    g = torch.Generator().manual_seed(_seed(seed, epoch, "order"))
    return [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]


def _collate(samples: list[dict]) -> dict:
    """Shape: latents (B,C,h,w), t5 (B,L,D), clip (B,V), index (B,) long; reference (B,C,h,w) for FLUX.1 Kontext
    pairs; and only where some sample has one: mask (B,h/2,w/2) (ones for a sample without) and loss_weight (B,) (1 for a sample without)."""
    import torch

    batch = {
        "latents": torch.stack([s["latents"] for s in samples]),
        "t5": torch.stack([s["t5"] for s in samples]),
        "clip": torch.stack([s["clip"] for s in samples]),
        "index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
    }
    if "reference" in samples[0]:  # FLUX.1 Kontext pairs: a source holds references for all samples or none
        batch["reference"] = torch.stack([s["reference"] for s in samples])
    if any("mask" in s for s in samples):
        _, _, h, w = batch["latents"].shape
        batch["mask"] = torch.stack([s.get("mask", torch.ones(h // 2, w // 2)) for s in samples])
    if any("loss_weight" in s for s in samples):
        batch["loss_weight"] = torch.tensor([s.get("loss_weight", 1.0) for s in samples], dtype=torch.float32)
    return batch


class _Dataset:
    """Map-style dataset over a source (torch's DataLoader only needs __getitem__/__len__)."""

    def __init__(self, source):
        self.source = source

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        return self.source.get(int(i))


class _PlanSampler:
    """Batch sampler whose batches the loader sets right before each epoch's iteration."""

    def __init__(self):
        self.batches: list[list[int]] = []

    def __iter__(self):
        return iter(list(self.batches))

    def __len__(self):
        return len(self.batches)


def _clean_worker_error(e: DataError) -> DataError:
    # DataLoader workers re-raise as DataError("Caught DataError in DataLoader worker ... Traceback ...");
    # keep only our original one-sentence message.
    msg = str(e)
    if msg.startswith("Caught DataError"):
        for line in reversed(msg.strip().splitlines()):
            if "DataError: " in line:
                return DataError(line.split("DataError: ", 1)[1])
    return e


class ShardLoader:
    """Iterable of batches for one rank. See the module docstring for the epoch plan.

    Resume: `state_dict()` -> {"epoch", "batches_done"} counts batches handed to the caller in the current
    epoch; `load_state_dict(sd)` makes the next iteration continue right after them. Finishing an
    iteration advances to the next epoch; `set_epoch(e)` with a different epoch starts epoch e from batch 0,
    with the current epoch it keeps the position (so `set_epoch` after `load_state_dict` is safe).
    """

    def __init__(
        self,
        source,
        *,
        micro_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        num_workers: int = 0,
        pin_memory: bool = False,
        remainder: str = "wrap",
        multiprocessing_context=None,
        prefetch_factor: int = 2,
    ):
        import torch
        from torch.utils.data import DataLoader

        self.source = source
        self.micro_batch, self.rank, self.world_size, self.seed = micro_batch, rank, world_size, seed
        self.remainder = remainder
        self.dims = dict(source.dims)
        self._sizes = source.latent_sizes()
        self.dims["latent_sizes"] = sorted(set(self._sizes))
        self.epoch, self.batches_done = 0, 0
        self._plan_cache: tuple[int, list[list[int]]] | None = None
        self._len = len(self._plan(0))
        if self._len == 0:
            raise DataError(
                f"the data has {len(source)} samples but every latent-size bucket is smaller than micro_batch x "
                f"world_size = {micro_batch * world_size}, so remainder='drop' leaves no batch; use remainder='wrap' or a smaller batch."
            )
        self._sampler = _PlanSampler()
        kwargs = {}
        if num_workers > 0:
            kwargs = {
                "persistent_workers": True,
                "prefetch_factor": prefetch_factor,
                "multiprocessing_context": multiprocessing_context,
            }
        # its own generator: each iterator draws a base seed, and from torch's global one that draw would move
        # the global stream (which stochastic rounding in the optimizer modes reads) whenever an iterator is
        # made, so a resumed run, which makes one mid-epoch, would round differently from the uninterrupted one
        self._dl = DataLoader(
            _Dataset(source),
            batch_sampler=self._sampler,
            num_workers=num_workers,
            collate_fn=_collate,
            pin_memory=bool(pin_memory and torch.cuda.is_available()),
            generator=torch.Generator().manual_seed(_seed("loader", seed, rank)),
            **kwargs,
        )

    def _plan(self, epoch: int) -> list[list[int]]:
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            G = self.micro_batch * self.world_size
            self._plan_cache = (epoch, epoch_plan(self._sizes, G, self.seed, epoch, self.remainder))
        return self._plan_cache[1]

    def rank_batches(self, epoch: int) -> list[list[int]]:
        """The sample indices of this rank's batches in `epoch` (what iteration will yield)."""
        r, mb = self.rank, self.micro_batch
        return [b[r * mb : (r + 1) * mb] for b in self._plan(epoch)]

    def __len__(self) -> int:
        return self._len

    @property
    def num_samples(self) -> int:
        """Samples in the source (every rank's loader sees the same source)."""
        return len(self._sizes)

    def check_model(self, model_cfg) -> None:
        """DataError when this data does not fit `model_cfg` (see check_model_fit)."""
        check_model_fit(self.dims, model_cfg)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.batches_done = int(epoch), 0

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "micro_batch": self.micro_batch,
            "world_size": self.world_size,
            "seed": self.seed,
            "data": self._fingerprint(),
            "num_samples": len(self.source),
        }

    def _fingerprint(self) -> str | None:
        fp = getattr(self.source, "fingerprint", None)
        return fp() if fp else None

    def load_state_dict(self, sd: dict, allow_data_change: bool = False) -> None:
        """Continue right after the saved position. The samples must be the ones it was saved with (the same
        shards, wherever they now live); allow_data_change starts the saved epoch's plan of the new data
        from its beginning instead."""
        now = self._fingerprint()
        if sd.get("data") is not None and now is not None and sd["data"] != now:
            if not allow_data_change:
                raise DataError(
                    f"the training data changed since the checkpoint ({sd.get('num_samples', '?')} "
                    f"samples then, {len(self.source)} now, or other shard contents); resume on the "
                    f"same data, or add allow_config_change=true to continue on this data from the "
                    f"start of an epoch"
                )
            sd = {**sd, "batches_done": 0}
        # The position counts batches of one epoch plan, which micro batch, world size and seed define:
        # under other values it would silently point at other samples (some repeated, some skipped).
        for key in ("micro_batch", "world_size", "seed"):
            if key in sd and sd[key] != getattr(self, key):
                raise DataError(
                    f"the checkpoint's data position was saved with {key}={sd[key]} but this run "
                    f"uses {key}={getattr(self, key)}; resume with {key}={sd[key]}, or start a new "
                    f"output_dir"
                )
        epoch, done = int(sd["epoch"]), int(sd["batches_done"])
        if not 0 <= done <= self._len:
            raise DataError(
                f"loader state batches_done={done} is outside [0, {self._len}]; the data or batch size changed since the checkpoint."
            )
        self.epoch, self.batches_done = epoch, done

    def __iter__(self):
        self._sampler.batches = self.rank_batches(self.epoch)[self.batches_done :]
        import torch

        threads = torch.get_num_threads()
        try:
            for i, batch in enumerate(self._dl):
                if i == 0:
                    # A pin-memory thread has started by now, and its torch.set_num_threads(1) set the count that
                    # threads started later take (not this one's), autograd's CUDA device thread among them, where
                    # checkpointed blocks recompute: their compiled code is guarded on the count, so every block
                    # compiled twice ("GLOBAL_STATE changed: num_threads") and backward's CPU work ran on one thread.
                    torch.set_num_threads(threads)
                self.batches_done += 1
                yield batch
        except DataError as e:
            raise _clean_worker_error(e) from None
        self.epoch, self.batches_done = self.epoch + 1, 0


def open_source(source, seed: int = 0):
    """A shard directory path, a synthetic spec string, or a list of datasets (fluxzero.data.datasets) -> source
    object; `seed` draws the datasets' caption dropout."""
    if isinstance(source, (list, tuple)):
        from fluxzero.data.datasets import MultiSource

        return MultiSource(source, seed, open_source)
    if is_synthetic(source):
        return SyntheticSource(source)
    if isinstance(source, str) and not source.strip():
        raise DataError(
            "the data source is empty; pass a folder made by `fluxzero cache` or a synthetic spec such as 'synthetic:n=64,hw=32x32'."
        )
    from fluxzero.data.shards import ShardSource

    return ShardSource(source)


def build_dataloader(
    source,
    *,
    micro_batch: int,
    rank: int,
    world_size: int,
    seed: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    remainder: str = "wrap",
    multiprocessing_context=None,
) -> ShardLoader:
    """Loader yielding {"latents": (B,16,h,w) f32, "t5": (B,L,D) f32, "clip": (B,V) f32, "index": (B,) long}.

    `source`: a shard directory (str or Path), "synthetic:n=64,hw=32x32,txt=16,ctx=64,vec=32", or a list of
    datasets (fluxzero.config.datasets.DatasetConfig); batches may then carry "mask" and "loss_weight" too.
    len(loader) is the same on every rank; see the module docstring for partitioning and remainders.
    """
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if remainder not in REMAINDER:
        raise ValueError(f"remainder must be one of {REMAINDER}, got {remainder!r}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    return ShardLoader(
        open_source(source, seed),
        micro_batch=micro_batch,
        rank=rank,
        world_size=world_size,
        seed=seed,
        num_workers=num_workers,
        pin_memory=pin_memory,
        remainder=remainder,
        multiprocessing_context=multiprocessing_context,
    )


def check_model_fit(dims: dict, model_cfg) -> None:
    """DataError when the data's dims do not fit a ModelConfig (channels, T5/CLIP widths, even latent sides)."""
    if dims["latent_channels"] != model_cfg.latent_channels:
        raise DataError(
            f"the data has {dims['latent_channels']} latent channels but model {model_cfg.name!r} needs {model_cfg.latent_channels}; re-cache with a matching VAE."
        )
    if dims["t5_dim"] != model_cfg.context_in_dim:
        raise DataError(
            f"the data's T5 width is {dims['t5_dim']} but model {model_cfg.name!r} has context_in_dim {model_cfg.context_in_dim}; re-cache with a matching T5 or pick a matching model."
        )
    if dims["clip_dim"] != model_cfg.vec_in_dim:
        raise DataError(
            f"the data's CLIP width is {dims['clip_dim']} but model {model_cfg.name!r} has vec_in_dim {model_cfg.vec_in_dim}; re-cache with a matching CLIP or pick a matching model."
        )
    if bool(dims.get("reference")) != model_cfg.kontext:
        if model_cfg.kontext:
            raise DataError(
                f"model {model_cfg.name!r} is FLUX.1 Kontext, which trains on (reference, target) pairs, but "
                f"the data holds no reference latents; cache a folder whose metadata.jsonl gives each image a "
                f"control_file_name (docs/kontext.md)."
            )
        raise DataError(
            f"the data holds FLUX.1 Kontext pairs (reference latents) but model {model_cfg.name!r} is not "
            f"a Kontext model; train flux-kontext-dev (or a model spec with kontext: true)."
        )
    for h, w in dims.get("latent_sizes", []):
        if h % 2 or w % 2:
            raise DataError(
                f"latent size {h}x{w} is odd but FLUX packs 2x2 latent patches; re-cache with image sides that are multiples of 16 pixels."
            )
