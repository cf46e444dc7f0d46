"""The run file's sections for what happens around the steps: `checkpoint:`, `sample:`, `validation:`, `export:`.

Pure Python, no torch. Each room of the trainer gets only its section (the checkpoint code cfg.checkpoint, the
previews cfg.sample, the validation cfg.validation, the end-of-run export cfg.export). Every section may be left
out for its defaults:

    checkpoint:
      every: 0            # optimizer steps between checkpoints; 0 = only at the end
      keep: 0             # keep the newest N checkpoints, deleting older ones after each save; 0 = all
      resume: true        # continue from output_dir/checkpoints/latest when it exists
    sample:
      every: 0            # optimizer steps between sample images; 0 = never
      prompts: null       # prompt-embeddings file from `fluxzero encode-prompts` (no T5 needed here)
      vae: null           # diffusers VAE folder to decode with (the one `fluxzero cache` used)
      size: 512x512       # WIDTHxHEIGHT in pixels, multiples of 16
      steps: 28
      guidance: 3.5       # the guidance embedding's value (FLUX.1-dev); ignored by schnell
      seeds: [0]          # one image per prompt and seed
      weights: live       # live | ema (needs an ema: section)
      reference: null     # FLUX.1 Kontext: the image every prompt edits (or a .safetensors of its latents, as
                          # `fluxzero sample --reference` takes); null = the first validation.data pair's reference
    validation:
      data: null          # held-out shard folder (or synthetic spec); null = no validation
      every: 0            # optimizer steps; 0 = once, at the end of the run
      timesteps: [0.1, 0.3, 0.5, 0.7, 0.9]
    export:
      format: bfl         # bfl | diffusers | comfyui | null (no export at the end)
      dtype: bf16         # bf16 | fp32
      merged: false       # LoRA runs: also the base (`weights`) with the LoRA merged, in format's full layout
      weights: live       # live | ema (needs an ema: section)

Run files before these sections had the keys flat (checkpoint_every, sample_vae, export_format, ...): MOVED_TO_SECTIONS
says where each went. A run file or override that still has one is refused in one sentence naming the new place;
a run.yaml saved beside an older checkpoint is read with them moved into place (nest_moved_keys).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass

from fluxzero.config.keys import and_list, check_types, section_from_dict
from fluxzero.config.user_files import excerpt

# flat key of an older run file -> section.key where it lives now
MOVED_TO_SECTIONS = {
    "checkpoint_every": "checkpoint.every",
    "keep_checkpoints": "checkpoint.keep",
    "resume": "checkpoint.resume",
    **{
        f"sample_{k}": f"sample.{k}"
        for k in ("every", "prompts", "vae", "size", "steps", "guidance", "seeds", "weights")
    },
    **{f"validation_{k}": f"validation.{k}" for k in ("data", "every", "timesteps")},
    **{f"export_{k}": f"export.{k}" for k in ("format", "dtype", "merged", "weights")},
}
WEIGHTS = ("live", "ema")


def _set(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)  # a frozen section normalises its own fields once, in __post_init__


def _at_least(obj, prefix: str, names, low: int) -> None:
    for f in names:
        if getattr(obj, f) < low:
            raise ValueError(
                f"{prefix}.{f} must be {'0 or more' if low == 0 else f'at least {low}'}, got {getattr(obj, f)}"
            )


def _weights(obj, prefix: str) -> None:
    if obj.weights not in WEIGHTS:
        raise ValueError(f"{prefix}.weights must be live or ema, got {excerpt(obj.weights)}")


@dataclass(frozen=True)
class CheckpointConfig:
    """When the trainer saves, how many checkpoints it keeps, and whether it continues the latest one."""

    every: int = 0
    keep: int = 0
    resume: bool = True

    def __post_init__(self):
        check_types(self, "checkpoint.")
        _at_least(self, "checkpoint", ("every", "keep"), 0)

    @classmethod
    def from_dict(cls, d) -> CheckpointConfig:
        return section_from_dict(cls, "checkpoint", d)


@dataclass(frozen=True)
class SampleConfig:
    """Sample images during training, of prompts encoded beforehand (see the module docstring for the keys)."""

    every: int = 0
    prompts: str | None = None
    vae: str | None = None
    size: str = "512x512"
    steps: int = 28
    guidance: float = 3.5
    seeds: list = dataclasses.field(default_factory=lambda: [0])
    weights: str = "live"
    reference: str | None = None

    def __post_init__(self):
        check_types(self, "sample.")
        for f in ("prompts", "vae", "reference"):
            if getattr(self, f):
                _set(self, f, os.path.expanduser(getattr(self, f)))
        _at_least(self, "sample", ("every",), 0)
        if self.every and not (self.prompts and self.vae):
            raise ValueError(
                "sample.every needs sample.prompts (a file from `fluxzero encode-prompts`) and "
                "sample.vae (a diffusers VAE folder); set both, or set sample.every to 0"
            )
        m = re.fullmatch(r"(\d+)x(\d+)", str(self.size))
        if not m or int(m[1]) % 16 or int(m[2]) % 16 or not int(m[1]) or not int(m[2]):
            raise ValueError(
                f"sample.size must be WIDTHxHEIGHT in pixels, multiples of 16 (e.g. 512x512), got {excerpt(self.size)}"
            )
        _at_least(self, "sample", ("steps",), 1)
        if not math.isfinite(self.guidance) or self.guidance < 0:
            raise ValueError(f"sample.guidance must be a finite number >= 0, got {self.guidance}")
        if isinstance(self.seeds, tuple):
            _set(self, "seeds", list(self.seeds))
        if not (
            isinstance(self.seeds, list)
            and self.seeds
            and all(isinstance(x, int) and not isinstance(x, bool) for x in self.seeds)
        ):
            raise ValueError(f"sample.seeds must be a list of whole numbers such as [0, 1], got {excerpt(self.seeds)}")
        _weights(self, "sample")

    @property
    def wh(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        width, height = (int(v) for v in self.size.split("x"))
        return width, height

    @classmethod
    def from_dict(cls, d) -> SampleConfig:
        return section_from_dict(cls, "sample", d)


@dataclass(frozen=True)
class ValidationConfig:
    """A held-out loss at fixed timesteps and fixed noise (fluxzero.train.evaluate.Validation)."""

    data: str | None = None
    every: int = 0
    timesteps: list = dataclasses.field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])

    def __post_init__(self):
        check_types(self, "validation.")
        if self.data:
            _set(self, "data", os.path.expanduser(self.data))
        _at_least(self, "validation", ("every",), 0)
        if self.every and not self.data:
            raise ValueError(
                "validation.every needs validation.data (a held-out shard folder); set it, or set validation.every to 0"
            )
        ts = self.timesteps
        if isinstance(ts, tuple):
            ts = list(ts)
            _set(self, "timesteps", ts)
        if not (
            isinstance(ts, list)
            and ts
            and all(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= 1 for t in ts)
        ):
            raise ValueError(
                f"validation.timesteps must be a list of numbers in (0, 1] such as [0.25, 0.5, 0.75], got {excerpt(ts)}"
            )

    @classmethod
    def from_dict(cls, d) -> ValidationConfig:
        return section_from_dict(cls, "validation", d)


EXPORT_FORMATS = ("bfl", "diffusers", "comfyui")


@dataclass(frozen=True)
class ExportConfig:
    """The export written at the end of the run (fluxzero.train.export.full.final_export)."""

    format: str | None = "bfl"
    dtype: str = "bf16"
    merged: bool = False
    weights: str = "live"

    def __post_init__(self):
        check_types(self, "export.")
        if self.format not in (None, *EXPORT_FORMATS):
            raise ValueError(f"export.format must be bfl, diffusers, comfyui or null, got {excerpt(self.format)}")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"export.dtype must be bf16 or fp32, got {excerpt(self.dtype)}")
        _weights(self, "export")

    @classmethod
    def from_dict(cls, d) -> ExportConfig:
        if d is None:  # the defaults export; a user writing `export: null` means no export
            raise ValueError(
                "export: null would still export with the defaults; write export.format: null (in "
                "YAML `export: {format: null}`) to skip the export at the end"
            )
        return section_from_dict(cls, "export", d)


SECTIONS = {
    "checkpoint": CheckpointConfig,
    "sample": SampleConfig,
    "validation": ValidationConfig,
    "export": ExportConfig,
}


def moved_to_sections_message(keys) -> str:
    """The one sentence for flat keys of an older run file that live in a section now."""
    keys = [k for k in MOVED_TO_SECTIONS if k in keys]
    new = [MOVED_TO_SECTIONS[k] for k in keys]
    sections = list(dict.fromkeys(n.split(".")[0] for n in new))
    section, leaf = new[0].split(".")
    one = len(keys) == 1
    return (
        f"{and_list(keys)} {'is' if one else 'are'} {and_list(new)} now: write {'it' if one else 'them'} in the "
        f"run file's {and_list([s + ':' for s in sections])} section{'' if len(sections) == 1 else 's'} "
        f"(`{section}:` with `{leaf}:` indented under it), or as {new[0]}=VALUE on the command line"
    )


def nest_moved_keys(d: dict) -> dict:
    """A run-file dict of any age with the flat keys of older run files moved into their sections (a value
    already in the section wins); for the run.yaml an older checkpoint saved."""
    flat = [k for k in MOVED_TO_SECTIONS if k in d]
    if not flat:
        return d
    out = {k: v for k, v in d.items() if k not in flat}
    for k in flat:
        section, leaf = MOVED_TO_SECTIONS[k].split(".")
        if not isinstance(out.get(section), dict):
            out[section] = {}
        out[section] = {leaf: d[k], **out[section]}
    return out
