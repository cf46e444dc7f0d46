"""Pure-Python configuration: model presets and their derived quantities.

No torch import here: `fluxzero gen-config`, `fluxzero estimate` and friends must stay instant.
"""
from __future__ import annotations

import dataclasses
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
