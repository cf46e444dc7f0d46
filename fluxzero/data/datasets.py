"""Several datasets as one source: repeats, a loss weight and train-time caption dropout per dataset.

The source's samples are the datasets' samples, each repeated `repeats` times, concatenated in the run file's
order: sample v of the combined source is copy v // n_d of sample v % n_d of its dataset (n_d its samples).
The loader's epoch plan works on these indices as on any source's, so each repeat is a sample of its own
(its own noise and timestep, keyed on v), batches stay within one latent size across datasets, and resume
is exact because the plan is a function of (seed, epoch) only.

Caption dropout here is drawn per combined index from the run's seed: a repeat of a sample may keep its
caption while another drops it; each is the same in every epoch (as `fluxzero cache --caption-dropout`).
"""

from __future__ import annotations

import bisect
import hashlib
import json

from fluxzero.data.errors import DataError

MAX_EPOCH_SAMPLES = 100_000_000  # an epoch's sample list and shuffle are held in memory (~16 bytes a sample)


def _unit(*parts) -> float:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") / 2**64


class MultiSource:
    """The datasets of a run file's `data:` list (fluxzero.config.datasets.DatasetConfig, or any object with
    path, repeats, loss_weight, caption_dropout) as one source for the loader."""

    def __init__(self, datasets, seed: int, open_one):
        self.datasets = list(datasets)
        self.seed = seed
        self.sources = []
        for d in self.datasets:
            if d.repeats < 1:
                raise DataError(f"dataset {d.path} has repeats {d.repeats}; set repeats to 1 or more, or remove it")
            self.sources.append(open_one(d.path))
        first = self.sources[0].dims
        for d, s in zip(self.datasets, self.sources):
            if ("reference" in s.dims) != ("reference" in first):
                pairs, plain = (
                    (d.path, self.datasets[0].path) if "reference" in s.dims else (self.datasets[0].path, d.path)
                )
                raise DataError(
                    f"dataset {pairs} holds FLUX.1 Kontext pairs but {plain} holds no reference latents; "
                    f"every dataset of a run must be pairs or none (cache {plain} from a folder whose "
                    f"metadata.jsonl gives each image a control_file_name, docs/kontext.md)"
                )
            if s.dims != first:
                raise DataError(
                    f"dataset {d.path} has dims {s.dims} but {self.datasets[0].path} has {first}; "
                    f"cache every dataset of a run with the same encoders and --t5-max-length"
                )
        self.dims = dict(first)
        self._starts, total = [], 0
        for d, s in zip(self.datasets, self.sources):
            self._starts.append(total)
            total += len(s) * d.repeats
        if total > MAX_EPOCH_SAMPLES:
            raise DataError(
                f"data: an epoch of {total:,} samples (each dataset's samples x its repeats) is more than "
                f"the {MAX_EPOCH_SAMPLES:,} the loader lists; lower the repeats"
            )
        self.num_samples = total
        # read now, so that a dataset without its empty caption stops the run before the first step
        self._empty = {
            k: s.empty_caption() for k, (d, s) in enumerate(zip(self.datasets, self.sources)) if d.caption_dropout
        }

    def __len__(self) -> int:
        return self.num_samples

    def _locate(self, v: int) -> tuple[int, int]:
        """(dataset, its sample index) of combined index v."""
        if not 0 <= v < self.num_samples:
            raise IndexError(f"sample index {v} out of range [0, {self.num_samples})")
        k = bisect.bisect_right(self._starts, v) - 1
        return k, (v - self._starts[k]) % len(self.sources[k])

    def latent_sizes(self) -> list[tuple[int, int]]:
        out = []
        for d, s in zip(self.datasets, self.sources):
            out += s.latent_sizes() * d.repeats
        return out

    def fingerprint(self) -> str:
        rows = [
            [s.fingerprint() if hasattr(s, "fingerprint") else d.path, d.repeats, d.loss_weight, d.caption_dropout]
            for d, s in zip(self.datasets, self.sources)
        ]
        return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]

    def describe(self, v: int) -> str:
        k, i = self._locate(v)
        return self.sources[k].describe(i)

    def caption(self, v: int) -> str:
        k, i = self._locate(v)
        return self.sources[k].caption(i)

    def summary(self) -> str:
        """One line for the start of training: each dataset's samples, repeats and weight."""
        parts = [
            f"{d.path}: {len(s)} samples x {d.repeats}"
            + (f", loss weight {d.loss_weight:g}" if d.loss_weight != 1 else "")
            + (f", caption dropout {d.caption_dropout:g}" if d.caption_dropout else "")
            for d, s in zip(self.datasets, self.sources)
        ]
        many = f"{len(parts)} datasets" if len(parts) > 1 else "1 dataset"
        return f"data: {self.num_samples} samples an epoch from {many} ({'; '.join(parts)})"

    def get(self, v: int) -> dict:
        """Its dataset's sample, with index v and, where set, "loss_weight" and the empty caption."""
        k, i = self._locate(v)
        d = self.datasets[k]
        out = self.sources[k].get(i)
        out["index"] = v
        if d.loss_weight != 1.0:
            out["loss_weight"] = float(d.loss_weight)
        if d.caption_dropout and _unit(self.seed, "caption", v) < d.caption_dropout:
            empty = self._empty[k]
            out["t5"], out["clip"] = empty["t5"].clone(), empty["clip"].clone()
        return out
