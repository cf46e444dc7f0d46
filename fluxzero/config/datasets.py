"""The run file's `data:` as several datasets: pure Python, no torch.

`data:` is either one source (a shard folder from `fluxzero cache`, or a synthetic spec), as always, or a list
of datasets, each a mapping:

    data:
      - path: shards/subject      # a shard folder (or synthetic spec); required
        repeats: 10               # times each sample appears in an epoch (1)
        loss_weight: 1.0          # multiplies this dataset's loss (1.0)
        caption_dropout: 0.1      # share of its samples trained with the empty caption (0.0)
      - path: shards/regularization
        loss_weight: 0.5          # a prior-preservation set: its own weight

Trigger words and caption prefixes are `fluxzero cache --caption-prefix` (captions are encoded there).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from fluxzero.config.keys import check_types, section_from_dict
from fluxzero.config.user_files import excerpt

MAX_REPEATS = 1_000_000
# keys users of other trainers give a dataset for what `fluxzero cache --caption-prefix` does
CAPTION_KEYS = ("caption_prefix", "trigger_word", "trigger", "prefix", "instance_prompt", "class_prompt")


@dataclass(frozen=True)
class DatasetConfig:
    """One dataset of a run that trains on several (see the module docstring)."""

    path: str
    repeats: int = 1
    loss_weight: float = 1.0
    caption_dropout: float = 0.0

    def __post_init__(self):
        check_types(self, "data[].")
        if not self.path.strip():
            raise ValueError("data[].path is empty; set it to a shard folder made by `fluxzero cache`")
        object.__setattr__(self, "path", os.path.expanduser(self.path))
        if self.repeats < 1:
            raise ValueError(
                f"data: {self.path} has repeats {self.repeats}; set repeats to 1 or more, or remove "
                f"that dataset from data:"
            )
        if self.repeats > MAX_REPEATS:
            raise ValueError(
                f"data: {self.path} has repeats {self.repeats}; set repeats from 1 to {MAX_REPEATS} (an "
                f"epoch lists every repeated sample)"
            )
        if not (math.isfinite(self.loss_weight) and self.loss_weight >= 0):
            raise ValueError(f"data: {self.path} has loss_weight {self.loss_weight}; set a finite number >= 0")
        if not 0.0 <= self.caption_dropout < 1.0:
            raise ValueError(f"data: {self.path} has caption_dropout {self.caption_dropout}; set a share in [0, 1)")


def parse_data(value):
    """The run file's `data:` as a source string (one dataset, as always) or a list of DatasetConfig."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("data is empty; set it to a shard folder made by `fluxzero cache`, or a list of datasets")
        return os.path.expanduser(value)
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("data is an empty list; list at least one dataset (a mapping with path:)")
        out = []
        for i, d in enumerate(value):
            if isinstance(d, DatasetConfig):
                out.append(d)
            elif isinstance(d, dict):
                if "path" not in d:
                    raise ValueError(f"data[{i}] has no path; give each dataset a path: to its shard folder")
                cached = next((k for k in CAPTION_KEYS if k in d), None)
                if cached is not None:
                    raise ValueError(
                        f"data[{i}].{cached}: captions are encoded into the shards by `fluxzero cache`, so a "
                        f"trigger word or caption prefix is given there: cache that dataset with "
                        f"--caption-prefix 'ohwx ' and remove {cached}"
                    )
                out.append(section_from_dict(DatasetConfig, f"data[{i}]", d))
            else:
                raise ValueError(
                    f"data[{i}] must be a mapping with path: (and repeats:, loss_weight:, "
                    f"caption_dropout:), got {excerpt(d)}"
                )
        if all(d.loss_weight == 0 for d in out):
            raise ValueError(
                "every dataset of data: has loss_weight 0, so nothing would train; give at least one a "
                "loss_weight above 0"
            )
        paths = [d.path for d in out]
        dup = next((p for p in paths if paths.count(p) > 1), None)
        if dup is not None:
            raise ValueError(f"data lists {dup} twice; list each dataset once and raise its repeats instead")
        return out
    raise ValueError(f"data must be a shard folder (text) or a list of datasets, got {excerpt(value)}")
