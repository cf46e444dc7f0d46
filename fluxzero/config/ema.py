"""The run file's `ema:` section (EmaConfig): an exponential moving average of the trained weights.

Pure Python, no torch: `fluxzero gen-config` / `estimate` may read it. The average itself lives in
fluxzero.train.ema (ShardedEMA), which keeps on each rank only the EMA of that rank's ZeRO partition.

    ema:
      decay: 0.9999      # per update: ema = decay * ema + (1 - decay) * weights
      warmup: false      # true: the decay used at optimizer step s is min(decay, (1 + s) / (10 + s))
      every: 1           # update after every N-th optimizer step (decay then counts per update)
      device: gpu        # gpu: beside the fp32 master partition; cpu: in host memory (a copy per update)
      dtype: fp32        # fp32 | bf16 (bf16 updates are stochastically rounded, so tiny increments survive)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fluxzero.config.keys import did_you_mean
from fluxzero.config.user_files import excerpt
from fluxzero.dtypes import BYTES

EMA_DEVICES = ("gpu", "cpu")
EMA_DTYPES = ("fp32", "bf16")


@dataclass
class EmaConfig:
    """EMA options; see the module docstring for the YAML form."""

    decay: float = 0.9999
    warmup: bool = False
    every: int = 1
    device: str = "gpu"
    dtype: str = "fp32"

    def __post_init__(self):
        d = self.decay
        if isinstance(d, bool) or not isinstance(d, (int, float)):
            raise ValueError(
                f"ema.decay must be a number between 0 and 1 (exclusive), for example 0.9999, got {excerpt(d)}"
            )
        if not 0.0 < d < 1.0:  # 1 would never move, 0 would be the weights themselves
            raise ValueError(f"ema.decay must be between 0 and 1 (exclusive), for example 0.9999, got {d}")
        self.decay = float(d)
        if not isinstance(self.warmup, bool):
            raise ValueError(f"ema.warmup must be true or false, got {excerpt(self.warmup)}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(
                f"ema.every must be a whole number of optimizer steps, at least 1, got {excerpt(self.every)}"
            )
        if self.device not in EMA_DEVICES:
            raise ValueError(f"ema.device must be 'gpu' or 'cpu', got {excerpt(self.device)}")
        if self.dtype not in EMA_DTYPES:
            raise ValueError(f"ema.dtype must be 'fp32' or 'bf16', got {excerpt(self.dtype)}")

    @classmethod
    def from_dict(cls, d) -> EmaConfig:
        """The `ema:` mapping of a run file; unknown keys are refused with a did-you-mean."""
        if not isinstance(d, dict):
            raise ValueError(
                f"ema must be a mapping of EMA options (decay, warmup, every, device, dtype), got {excerpt(d)}"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(map(str, d)) - set(names))
        if unknown:
            raise ValueError(
                f"unknown ema keys {unknown}{did_you_mean(unknown, names)}; valid keys: {', '.join(names)}"
            )
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def updates_at(self, step: int) -> bool:
        """Whether optimizer step `step` (1 = the first step taken) is on the `every` grid."""
        return step >= 1 and step % self.every == 0

    def decay_at(self, step: int) -> float:
        """The decay used by the update after optimizer step `step` (warmup: min(decay, (1+s)/(10+s)))."""
        if self.warmup:
            return min(self.decay, (1 + step) / (10 + step))
        return self.decay

    def bytes_per_param(self, world_size: int, partitioned: bool) -> float:
        """EMA bytes per trained parameter on one rank, for the memory model.

        partitioned: the fp32 masters are split over the data-parallel ranks (ZeRO-1/2/3, and DeepSpeed's
        BF16_Optimizer at stage 0), so each rank averages 1/world_size of them. At ZeRO-0 in fp32, or bf16
        with bf16 gradient accumulation, every rank holds all masters and so the whole EMA.
        (Partition padding adds at most a few elements per rank; it is left out.)
        """
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        return BYTES[self.dtype] / (world_size if partitioned else 1)
