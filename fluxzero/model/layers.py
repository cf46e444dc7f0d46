"""FLUX.1 building blocks. Module granularity and parameter names follow BFL's reference implementation,
so its checkpoints load without renaming; the code is written for this project.

Shapes: B batch, L tokens (L_img image, L_txt text), C hidden size, H heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .math import attention, rope


class EmbedND(nn.Module):
    """Multi-axis RoPE tables from position ids (no parameters)."""

    def __init__(self, axes_dim: tuple[int, ...], theta: int):
        super().__init__()
        self.axes_dim, self.theta = tuple(axes_dim), theta

    def forward(self, ids: Tensor) -> Tensor:
        return rope(ids, self.axes_dim, self.theta)  # (2, B, 1, L, D)


class MLPEmbedder(nn.Module):
    """Linear -> SiLU -> Linear; embeds the timestep, guidance and pooled text vectors."""

    def __init__(self, in_dim: int, hidden_dim: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden_dim)
        self.out_layer = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))  # (B, C)


class RMSNorm(nn.Module):
    """RMS norm over the last dim with a learned `scale` (eps 1e-6); statistics in float32."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.scale.shape, self.scale, eps=1e-6)


class QKNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return self.query_norm(q), self.key_norm(k)  # (B, H, L, D) each


class SelfAttention(nn.Module):
    """Parameter holder of one stream's attention in a double block (the attention itself is joint)."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = nn.Linear(dim, dim)

    def qkv_heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Shape: x (B, L, C) -> q, k, v (B, H, L, D), q and k RMS-normed."""
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).permute(2, 0, 3, 1, 4)  # (B, H, L, D) x3
        q, k = self.norm(q, k)
        return q, k, v


class Modulation(nn.Module):
    """Linear(SiLU(vec)) chunked into (shift, scale, gate), twice for a double block."""

    def __init__(self, dim: int, double: bool):
        super().__init__()
        self.multiplier = 6 if double else 3
        self.lin = nn.Linear(dim, self.multiplier * dim)

    def forward(self, vec: Tensor) -> tuple[Tensor, ...]:
        return self.lin(F.silu(vec))[:, None, :].chunk(self.multiplier, dim=-1)  # each (B, 1, C)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """(1 + scale) * x + shift as one fused kernel. Shape: x (B, L, C), shift/scale (B, 1, C)."""
    return torch.addcmul(shift, x, 1 + scale)


def _layer_norm(x: Tensor) -> Tensor:
    # LayerNorm without affine parameters, eps 1e-6 (the same in every FLUX block).
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


class DoubleStreamBlock(nn.Module):
    """Image and text streams with separate weights, joined in one attention (text tokens first)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, qkv_bias: bool, attention: str = "auto"):
        super().__init__()
        mlp_hidden = int(hidden_size * mlp_ratio)
        self.num_heads, self.hidden_size = num_heads, hidden_size
        self.attention = attention  # SDPA backend name (math.ATTENTION_BACKENDS)
        for s in ("img", "txt"):
            setattr(self, f"{s}_mod", Modulation(hidden_size, double=True))
            setattr(self, f"{s}_attn", SelfAttention(hidden_size, num_heads, qkv_bias))
            setattr(
                self,
                f"{s}_mlp",
                nn.Sequential(
                    nn.Linear(hidden_size, mlp_hidden), nn.GELU(approximate="tanh"), nn.Linear(mlp_hidden, hidden_size)
                ),
            )

    def forward(self, img: Tensor, txt: Tensor, vec: Tensor, pe: Tensor) -> tuple[Tensor, Tensor]:
        """Shape: img (B, L_img, C), txt (B, L_txt, C), vec (B, C), pe (2, B, 1, L_txt+L_img, D)."""
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = self.img_mod(vec)  # (B, 1, C) each
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = self.txt_mod(vec)

        img_q, img_k, img_v = self.img_attn.qkv_heads(modulate(_layer_norm(img), i_shift1, i_scale1))
        txt_q, txt_k, txt_v = self.txt_attn.qkv_heads(modulate(_layer_norm(txt), t_shift1, t_scale1))
        q = torch.cat((txt_q, img_q), dim=2)  # (B, H, L_txt+L_img, D)
        k = torch.cat((txt_k, img_k), dim=2)
        v = torch.cat((txt_v, img_v), dim=2)
        attn = attention(q, k, v, pe, self.attention)  # (B, L_txt+L_img, C)
        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1] :]

        img = torch.addcmul(img, i_gate1, self.img_attn.proj(img_attn))  # (B, L_img, C)
        img = torch.addcmul(img, i_gate2, self.img_mlp(modulate(_layer_norm(img), i_shift2, i_scale2)))
        txt = torch.addcmul(txt, t_gate1, self.txt_attn.proj(txt_attn))  # (B, L_txt, C)
        txt = torch.addcmul(txt, t_gate2, self.txt_mlp(modulate(_layer_norm(txt), t_shift2, t_scale2)))
        return img, txt


class SingleStreamBlock(nn.Module):
    """One stream over the joined tokens; QKV and MLP-in fused in linear1, attn-out and MLP-out in linear2."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, attention: str = "auto"):
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.attention = attention  # SDPA backend name (math.ATTENTION_BACKENDS)
        self.mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.linear1 = nn.Linear(hidden_size, 3 * hidden_size + self.mlp_hidden_dim)
        self.linear2 = nn.Linear(hidden_size + self.mlp_hidden_dim, hidden_size)
        self.norm = QKNorm(hidden_size // num_heads)
        self.modulation = Modulation(hidden_size, double=False)

    def forward(self, x: Tensor, vec: Tensor, pe: Tensor) -> Tensor:
        """Shape: x (B, L, C), vec (B, C), pe (2, B, 1, L, D) -> (B, L, C)."""
        shift, scale, gate = self.modulation(vec)  # (B, 1, C) each
        qkv, mlp = self.linear1(modulate(_layer_norm(x), shift, scale)).split(
            (3 * self.hidden_size, self.mlp_hidden_dim), dim=-1
        )  # (B, L, 3C), (B, L, M)
        q, k, v = qkv.unflatten(-1, (3, self.num_heads, -1)).permute(2, 0, 3, 1, 4)  # (B, H, L, D) x3
        q, k = self.norm(q, k)
        attn = attention(q, k, v, pe, self.attention)  # (B, L, C)
        out = self.linear2(torch.cat((attn, F.gelu(mlp, approximate="tanh")), dim=-1))  # (B, L, C)
        return torch.addcmul(x, gate, out)


class LastLayer(nn.Module):
    """adaLN (shift, scale from vec) over a parameter-free LayerNorm, then the output projection."""

    def __init__(self, hidden_size: int, out_channels: int, patch_size: int = 1):
        super().__init__()
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: Tensor, vec: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(vec)[:, None, :].chunk(2, dim=-1)  # (B, 1, C) each
        return self.linear(modulate(_layer_norm(x), shift, scale))  # (B, L_img, out_channels)
