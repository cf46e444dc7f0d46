"""The FLUX.1 transformer (BFL parameter names) and its constructor."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..config import ModelConfig, get_model_config
from .layers import DoubleStreamBlock, EmbedND, LastLayer, MLPEmbedder, SingleStreamBlock
from .math import check_attention_backend, timestep_embedding


class Flux(nn.Module):
    """FLUX.1 flow transformer on packed latents.

    Single-device PyTorch: activation checkpointing and ZeRO are applied from outside, per block of
    `double_blocks` / `single_blocks`. `attention` names the SDPA kernels the blocks may use
    (math.ATTENTION_BACKENDS: auto = flash, efficient, math; cuDNN only when asked for).
    """

    def __init__(self, config: ModelConfig, attention: str = "auto"):
        super().__init__()
        self.config = c = config
        self.attention = check_attention_backend(attention)
        self.pe_embedder = EmbedND(c.axes_dim, c.theta)
        self.img_in = nn.Linear(c.in_channels, c.hidden_size)
        self.time_in = MLPEmbedder(256, c.hidden_size)
        self.vector_in = MLPEmbedder(c.vec_in_dim, c.hidden_size)
        self.guidance_in = MLPEmbedder(256, c.hidden_size) if c.guidance_embed else nn.Identity()
        self.txt_in = nn.Linear(c.context_in_dim, c.hidden_size)
        self.double_blocks = nn.ModuleList(
            DoubleStreamBlock(c.hidden_size, c.num_heads, c.mlp_ratio, c.qkv_bias, attention) for _ in range(c.depth)
        )
        self.single_blocks = nn.ModuleList(
            SingleStreamBlock(c.hidden_size, c.num_heads, c.mlp_ratio, attention) for _ in range(c.depth_single_blocks)
        )
        self.final_layer = LastLayer(c.hidden_size, c.out_channels)

    def set_attention(self, name: str) -> None:
        """Switch every block's SDPA backend (auto, flash, efficient, cudnn, math)."""
        self.attention = check_attention_backend(name)
        for block in (*self.double_blocks, *self.single_blocks):
            block.attention = name

    def forward(
        self, img: Tensor, img_ids: Tensor, txt: Tensor, txt_ids: Tensor, timesteps: Tensor, y: Tensor,
        guidance: Tensor | None = None,
    ) -> Tensor:
        """Predict the flow velocity of packed image tokens.

        Shape: img (B, L_img, in_channels), img_ids (B, L_img, 3), txt (B, L_txt, context_in_dim),
        txt_ids (B, L_txt, 3), timesteps (B,) in [0, 1], y (B, vec_in_dim), guidance (B,) or None
        -> (B, L_img, out_channels), in the parameters' dtype.
        """
        if img.ndim != 3 or txt.ndim != 3:
            raise ValueError(f"img and txt must be (B, L, C); got {tuple(img.shape)} and {tuple(txt.shape)}")
        if img_ids.ndim != 3 or txt_ids.ndim != 3:  # diffusers passes (L, 3): catching it here beats a wrong RoPE
            raise ValueError(
                f"img_ids and txt_ids must be (B, L, 3); got {tuple(img_ids.shape)} and {tuple(txt_ids.shape)}"
            )
        dtype = self.img_in.weight.dtype  # inputs follow the weights (no-op when they already match)
        img = self.img_in(img.to(dtype))  # (B, L_img, C)
        vec = self.time_in(timestep_embedding(timesteps).to(dtype))  # (B, C)
        if self.config.guidance_embed:
            if guidance is None:
                raise ValueError(f"model {self.config.name!r} embeds guidance: pass guidance=(B,) tensor")
            vec = vec + self.guidance_in(timestep_embedding(guidance).to(dtype))  # (B, C)
        vec = vec + self.vector_in(y.to(dtype))  # (B, C)
        txt = self.txt_in(txt.to(dtype))  # (B, L_txt, C)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))  # (2, B, 1, L_txt+L_img, D) float32

        for block in self.double_blocks:
            img, txt = block(img, txt, vec, pe)  # (B, L_img, C), (B, L_txt, C)
        x = torch.cat((txt, img), dim=1)  # (B, L_txt+L_img, C)
        for block in self.single_blocks:
            x = block(x, vec, pe)  # (B, L_txt+L_img, C)
        return self.final_layer(x[:, txt.shape[1]:], vec)  # (B, L_img, out_channels)


def build_model(cfg: ModelConfig | str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                attention: str = "auto") -> Flux:
    """A randomly initialised Flux, created directly on `device` in `dtype` (device="meta": shapes only)."""
    if isinstance(cfg, str):
        cfg = get_model_config(cfg)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are born in `dtype`: no float32 copy of a 12B model
    try:
        with torch.device(device):
            model = Flux(cfg, attention)
    finally:
        torch.set_default_dtype(previous)
    return model
