"""The FLUX.1 transformer (BFL parameter names) and its constructor."""

from __future__ import annotations

from collections.abc import Callable

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
        self,
        img: Tensor,
        img_ids: Tensor,
        txt: Tensor,
        txt_ids: Tensor,
        timesteps: Tensor,
        y: Tensor,
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
        return self.final_layer(x[:, txt.shape[1] :], vec)  # (B, L_img, out_channels)


def build_model(
    cfg: ModelConfig | str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    attention: str = "auto",
    finish: Callable[[str, nn.Module], None] | None = None,
) -> Flux:
    """A randomly initialised Flux, born in `dtype` on `device` (device="meta": shapes only).

    Built on the meta device, then materialised one module at a time in construction order: each module's
    parameters are initialised on `device` in float32 (`reset_parameters`, drawing the generator as an eager build
    draws it) and rounded to `dtype`. So one seed gives the same weights in every dtype (the float32 model's,
    rounded) and no float32 copy of the model ever exists: the float32 values live in one scratch buffer the size
    of the largest module, reused by every module (FLUX.1-dev: 0.26 GB next to the 23.8 GB bf16 model; no
    allocation and free of a float32 tensor per module for an allocator to fragment on). `finish(name, module)`,
    when given, runs on each materialised module right away (the trainer copies its pretrained weights in and
    quantizes it there). Under deepspeed.zero.Init, which makes every tensor itself (on the accelerator, in its
    dtype, partitioned as each module is built), the model is returned as that built it.
    """
    if isinstance(cfg, str):
        cfg = get_model_config(cfg)
    with torch.device("meta"):
        model = Flux(cfg, attention)
    if torch.device(device).type == "meta":
        return model.to(dtype)
    if next(model.parameters()).device.type != "meta":  # a context placed the tensors itself (deepspeed.zero.Init)
        return model
    modules = [(name, m) for name, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None]
    if any(next(m.buffers(recurse=False), None) is not None for m in model.modules()):
        raise NotImplementedError("build_model materialises parameters only; a module with buffers needs it here")
    scratch = None
    if dtype != torch.float32:
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for _, m in modules)
        scratch = torch.empty(largest, dtype=torch.float32, device=device)
    for name, module in modules:
        _materialize(module, device, dtype, scratch)
        if finish is not None:
            finish(name, module)
    return model


def _materialize(module: nn.Module, device, dtype: torch.dtype, scratch: Tensor | None) -> None:
    """`module`'s own meta parameters -> initialised on `device` in `dtype` (float32 values in `scratch` first)."""
    if scratch is None:
        module.to_empty(device=device, recurse=False)
        module.reset_parameters()
        return
    offset, params = 0, module._parameters
    for key, p in params.items():
        params[key] = nn.Parameter(scratch[offset : offset + p.numel()].view(p.shape), requires_grad=p.requires_grad)
        offset += p.numel()
    module.reset_parameters()
    for key, p in params.items():
        params[key] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
