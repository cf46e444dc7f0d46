"""Model shapes: ModelConfig, the named presets and reshaped variants (pure Python).

No torch import here: `fluxzero gen-config`, `fluxzero estimate` and friends must stay instant.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a FLUX.1 transformer. Field names follow BFL's `FluxParams`."""

    name: str
    in_channels: int = 64  # 16 latent channels x 2x2 patch
    out_channels: int = 64
    vec_in_dim: int = 768  # CLIP-L pooled
    context_in_dim: int = 4096  # T5-XXL hidden
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19  # double-stream blocks
    depth_single_blocks: int = 38
    axes_dim: tuple[int, int, int] = (16, 56, 56)
    theta: int = 10_000
    qkv_bias: bool = True
    guidance_embed: bool = True

    def __post_init__(self):
        for f in ("in_channels", "out_channels", "vec_in_dim", "context_in_dim", "hidden_size", "num_heads"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model {self.name!r}: {f} must be positive, got {getattr(self, f)}")
        if self.depth < 0 or self.depth_single_blocks < 0:
            raise ValueError(f"model {self.name!r}: depth and depth_single_blocks must be >= 0")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model {self.name!r}: hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}"
            )
        if sum(self.axes_dim) != self.head_dim:
            raise ValueError(
                f"model {self.name!r}: axes_dim {self.axes_dim} must sum to the head dim {self.head_dim}"
            )
        if any(d % 2 for d in self.axes_dim):
            raise ValueError(f"model {self.name!r}: every entry of axes_dim {self.axes_dim} must be even (RoPE pairs)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def latent_channels(self) -> int:
        """Channels of the VAE latent before 2x2 packing (16 for FLUX.1)."""
        return self.in_channels // 4

    def num_params(self) -> int:
        """Parameter count of the transformer (flux-dev: 11,901,408,320), from the architecture alone."""
        C, M, D = self.hidden_size, self.mlp_hidden_dim, self.head_dim

        def linear(n_in: int, n_out: int, bias: bool = True) -> int:
            return n_in * n_out + (n_out if bias else 0)

        embed = linear(self.in_channels, C) + linear(self.context_in_dim, C)  # img_in, txt_in
        embed += linear(256, C) + linear(C, C) + linear(self.vec_in_dim, C) + linear(C, C)  # time_in, vector_in
        if self.guidance_embed:
            embed += linear(256, C) + linear(C, C)  # guidance_in
        stream = (linear(C, 6 * C) + linear(C, 3 * C, self.qkv_bias) + 2 * D  # mod, qkv, q/k norm scales
                  + linear(C, C) + linear(C, M) + linear(M, C))  # proj, mlp
        single = linear(C, 3 * C + M) + linear(C + M, C) + 2 * D + linear(C, 3 * C)  # linear1/2, norm, mod
        final = linear(C, self.out_channels) + linear(C, 2 * C)
        return embed + self.depth * 2 * stream + self.depth_single_blocks * single + final

    def flops_per_sample(self, img_tokens: int, txt_tokens: int) -> float:
        """Forward FLOPs of one sample (multiply-add = 2 FLOPs); training step is about 3x this.

        Counted: every linear layer on the tokens that pass through it, attention's QK^T and AV, and the
        per-sample work (modulation, embedders, final adaLN) once per sample. Not counted (memory-bound,
        < 1% at FLUX sizes): norms, RoPE, softmax, activations, biases, residual adds.
        With C hidden, M mlp hidden, I img tokens, T txt tokens, L = I + T:
          double block: 2 (I + T) (3C^2 + C^2 + 2CM)   qkv, proj, mlp per stream
                        + 4 L^2 C                      QK^T (2 L^2 D per head) + AV (the same), H heads
                        + 2 * 2 * 6 C^2                img and txt modulation, per sample
          single block: 2 L (C (3C + M) + (C + M) C) + 4 L^2 C + 2 * 3 C^2
          embedders:    2 I in C + 2 T ctx C + 2 (256 C + C^2) (time, guidance) + 2 (vec C + C^2)
          final layer:  2 I C out + 2 * 2 C^2
        """
        C, M, I, T = self.hidden_size, self.mlp_hidden_dim, img_tokens, txt_tokens
        L = I + T
        attn = 4 * L * L * C
        double = 2 * L * (4 * C * C + 2 * C * M) + attn + 2 * 2 * 6 * C * C
        single = 2 * L * (C * (3 * C + M) + (C + M) * C) + attn + 2 * 3 * C * C
        embed = 2 * I * self.in_channels * C + 2 * T * self.context_in_dim * C
        embed += 2 * (256 * C + C * C) * (2 if self.guidance_embed else 1) + 2 * (self.vec_in_dim * C + C * C)
        final = 2 * I * C * self.out_channels + 2 * 2 * C * C
        return float(self.depth * double + self.depth_single_blocks * single + embed + final)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


_FLUX_DEV = ModelConfig(name="flux-dev")

MODEL_PRESETS: dict[str, ModelConfig] = {
    "flux-dev": _FLUX_DEV,
    "flux-schnell": _FLUX_DEV.replace(name="flux-schnell", guidance_embed=False),
    # Full width (so per-block kernels and MFU are representative), a quarter of the depth: fits one GPU
    # with plain data parallelism and AdamW, for benchmarks.
    "flux-dev-lite": _FLUX_DEV.replace(name="flux-dev-lite", depth=5, depth_single_blocks=10),
    # Tiny presets for tests and the CPU quick start: every code path of the real model, in milliseconds.
    "flux-tiny": _FLUX_DEV.replace(
        name="flux-tiny", hidden_size=64, num_heads=4, axes_dim=(4, 6, 6), depth=2, depth_single_blocks=2,
        context_in_dim=64, vec_in_dim=32,
    ),
}
MODEL_PRESETS["flux-tiny-schnell"] = MODEL_PRESETS["flux-tiny"].replace(name="flux-tiny-schnell", guidance_embed=False)


def get_model_config(name: str) -> ModelConfig:
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(MODEL_PRESETS)}") from None


def reshaped(base: ModelConfig, *, depth: int | None = None, depth_single_blocks: int | None = None,
             hidden_size: int | None = None, num_heads: int | None = None) -> ModelConfig:
    """`base` with another block count or width (what-if sizing); RoPE axes follow the new head dim.

    Raises ValueError with one sentence when the shape cannot exist.
    """
    changes = {k: v for k, v in dict(depth=depth, depth_single_blocks=depth_single_blocks,
                                     hidden_size=hidden_size, num_heads=num_heads).items() if v is not None}
    if not changes:
        return base
    hidden, heads = changes.get("hidden_size", base.hidden_size), changes.get("num_heads", base.num_heads)
    if hidden % heads or (hidden // heads) % 2:
        raise ValueError(f"hidden size {hidden} / {heads} heads must give an even whole head dim")
    head_dim = hidden // heads
    if head_dim != base.head_dim:  # FLUX splits 128 as (16, 56, 56): keep the proportions, even entries
        side = 2 * max(1, round(head_dim * base.axes_dim[1] / base.head_dim / 2))
        if head_dim - 2 * side < 2:
            raise ValueError(f"head dim {head_dim} is too small for 3-axis RoPE")
        changes["axes_dim"] = (head_dim - 2 * side, side, side)
    desc = ", ".join(f"{k}={v}" for k, v in changes.items() if k != "axes_dim")
    return dataclasses.replace(base, name=f"{base.name} ({desc})", **changes)


