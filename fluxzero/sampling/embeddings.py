"""Pre-encoded prompts: a .safetensors file of T5 and CLIP embeddings, so sampling needs no text encoder.

Format (version 1):
  tensors   t5           (N, L, D)  T5 last hidden states, padded to L tokens (no mask: FLUX.1 uses none)
            clip_pooled  (N, V)     CLIP-L pooled outputs
            neg_t5, neg_clip_pooled (1, L, D), (1, V)  optional: the negative prompt for true CFG
  metadata  format "fluxzero-prompt-embeddings", version "1", prompts (JSON list of the N prompt texts),
            negative_prompt (its text, when the negative tensors are present)
`fluxzero encode-prompts` writes one on a machine that has the encoders; `fluxzero sample --embeddings`
and the trainer read it with `load_embeddings`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from fluxzero.config.user_files import parse_json

FORMAT, VERSION = "fluxzero-prompt-embeddings", "1"


class EmbeddingsError(ValueError):
    """A prompt-embeddings file that cannot be used (the message says what to change)."""


@dataclass(frozen=True)
class PromptEmbeddings:
    prompts: list[str]
    t5: Tensor  # (N, L, D)
    clip_pooled: Tensor  # (N, V)
    negative_prompt: str | None = None
    neg_t5: Tensor | None = None  # (1, L, D)
    neg_clip_pooled: Tensor | None = None  # (1, V)

    def __post_init__(self):
        n = len(self.prompts)
        if self.t5.ndim != 3 or self.clip_pooled.ndim != 2 or self.t5.shape[0] != n or self.clip_pooled.shape[0] != n:
            raise EmbeddingsError(
                f"prompt embeddings need t5 (N, L, D) and clip_pooled (N, V) for N={n} prompts, got "
                f"{tuple(self.t5.shape)} and {tuple(self.clip_pooled.shape)}; encode them again"
            )
        if (self.neg_t5 is None) != (self.neg_clip_pooled is None):
            raise EmbeddingsError("a negative prompt needs both neg_t5 and neg_clip_pooled; encode it again")
        if self.neg_t5 is not None and (
            tuple(self.neg_t5.shape) != (1, *self.t5.shape[1:])
            or tuple(self.neg_clip_pooled.shape) != (1, self.clip_pooled.shape[1])
        ):
            raise EmbeddingsError(
                f"the negative prompt's embeddings {tuple(self.neg_t5.shape)}, "
                f"{tuple(self.neg_clip_pooled.shape)} do not match one row of the prompts' "
                f"{tuple(self.t5.shape[1:])}, {self.clip_pooled.shape[1]}; encode them again together"
            )
        if self.t5.shape[1] == 0 or self.t5.shape[2] == 0 or self.clip_pooled.shape[1] == 0:
            raise EmbeddingsError(
                f"the prompt embeddings are empty (t5 {tuple(self.t5.shape)}, clip_pooled "
                f"{tuple(self.clip_pooled.shape)}): FLUX.1 needs T5 tokens and a CLIP vector; "
                "encode them again"
            )
        for name in ("t5", "clip_pooled", "neg_t5", "neg_clip_pooled"):
            t = getattr(self, name)
            if t is None:
                continue
            if not t.is_floating_point():  # an integer file would be cast and sampled as if it were embeddings
                raise EmbeddingsError(
                    f"{name} holds {str(t.dtype).replace('torch.', '')} values, but prompt "
                    "embeddings are floating point (the encoders' outputs); encode them again"
                )
            if not bool(torch.isfinite(t).all()):  # NaN samples black images without a word
                raise EmbeddingsError(
                    f"{name} holds NaN or infinite values (an encoder that overflowed, e.g. T5 in "
                    "fp16); encode them again in bf16 or fp32"
                )

    def check_model(self, cfg) -> None:
        """EmbeddingsError unless these embeddings fit a model of this shape (a ModelConfig): its T5 and CLIP widths."""
        if self.t5.shape[-1] != cfg.context_in_dim or self.clip_pooled.shape[-1] != cfg.vec_in_dim:
            raise EmbeddingsError(
                f"the prompt embeddings are T5 {self.t5.shape[-1]} / CLIP {self.clip_pooled.shape[-1]} wide but "
                f"model {cfg.name!r} takes {cfg.context_in_dim} / {cfg.vec_in_dim}; encode the prompts with this "
                "model's T5 and CLIP encoders."
            )

    @property
    def has_negative(self) -> bool:
        return self.neg_t5 is not None


def save_embeddings(path: str | os.PathLike, emb: PromptEmbeddings) -> Path:
    """Write `emb` (through fluxzero's safetensors writer: the same bytes each time, the usual permissions, whole
    or not at all)."""
    from ..model.weights import save_tensors

    tensors = {"t5": emb.t5, "clip_pooled": emb.clip_pooled}
    meta = {"format": FORMAT, "version": VERSION, "prompts": json.dumps(emb.prompts, ensure_ascii=False)}
    if emb.has_negative:
        tensors |= {"neg_t5": emb.neg_t5, "neg_clip_pooled": emb.neg_clip_pooled}
        meta["negative_prompt"] = emb.negative_prompt or ""
    path = Path(path)
    save_tensors(path, tensors, meta)
    return path


def load_embeddings(path: str | os.PathLike) -> PromptEmbeddings:
    """Read a file `save_embeddings` wrote; anything else -> EmbeddingsError naming the fix."""
    from safetensors import safe_open

    fix = "write it with fluxzero encode-prompts"
    path = Path(path)
    if not path.is_file():
        raise EmbeddingsError(f"{path} does not exist; {fix}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise EmbeddingsError(
                    f"{path} is not a fluxzero prompt-embeddings file (no format {FORMAT!r} in its metadata); {fix}"
                )
            if meta.get("version") != VERSION:
                raise EmbeddingsError(
                    f"{path} is prompt-embeddings version {meta.get('version')!r}, this fluxzero "
                    f"reads version {VERSION}; {fix}"
                )
            t = {k: f.get_tensor(k) for k in f.keys()}
    except EmbeddingsError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise EmbeddingsError(f"{path} is not a readable safetensors file ({str(e).splitlines()[0]}); {fix}") from None
    try:
        prompts = parse_json(meta.get("prompts", ""))
    except ValueError:
        prompts = None
    if not (isinstance(prompts, list) and all(isinstance(p, str) for p in prompts)) or not {"t5", "clip_pooled"} <= set(
        t
    ):
        raise EmbeddingsError(f"{path} lacks the t5 / clip_pooled tensors or the prompts list; {fix}")
    if not prompts:
        raise EmbeddingsError(f"{path} holds no prompts; {fix} and at least one --prompt")
    try:
        return PromptEmbeddings(
            prompts=prompts,
            t5=t["t5"],
            clip_pooled=t["clip_pooled"],
            negative_prompt=meta.get("negative_prompt"),
            neg_t5=t.get("neg_t5"),
            neg_clip_pooled=t.get("neg_clip_pooled"),
        )
    except EmbeddingsError as e:
        raise EmbeddingsError(f"{path}: {e}") from None


def encode_prompts(encoders, prompts: list[str], negative_prompt: str | None = None) -> PromptEmbeddings:
    """Run the T5 / CLIP encoders (fluxzero.data.encode.Encoders) over prompts and an optional negative."""
    t5, _, clip = encoders.encode_text(list(prompts))
    neg_t5 = neg_clip = None
    if negative_prompt is not None:
        neg_t5, _, neg_clip = encoders.encode_text([negative_prompt])
    return PromptEmbeddings(list(prompts), t5, clip, negative_prompt, neg_t5, neg_clip)
