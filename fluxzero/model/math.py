"""Attention, rotary position embedding and the sinusoidal timestep embedding of FLUX.1.

Shapes: B batch, H heads, L tokens, D head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

# name -> SDPA backends allowed, in priority order. cuDNN is left out of "auto" on purpose: with torch 2.11 on
# Hopper its SDPA kernel gave non-finite FLUX gradients and illegal memory accesses under ZeRO-3.
# "any" allows every kernel and lets torch pick, as a plain F.scaled_dot_product_attention user gets: on Hopper
# torch prefers cuDNN's kernel, as FluxPipeline does. For the forward only (`fluxzero sample`'s default), where
# it is faster than flash (benchmarks/RESULTS.md).
ATTENTION_BACKENDS: dict[str, list[SDPBackend]] = {
    "auto": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "any": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "math": [SDPBackend.MATH],
}
_FLAGS = (  # (backend, global getter, global setter) for the backends a name can allow
    (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
    (
        SDPBackend.EFFICIENT_ATTENTION,
        torch.backends.cuda.mem_efficient_sdp_enabled,
        torch.backends.cuda.enable_mem_efficient_sdp,
    ),
    (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
    (SDPBackend.CUDNN_ATTENTION, torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
)


def check_attention_backend(name: str) -> str:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {', '.join(ATTENTION_BACKENDS)}")
    return name


def set_process_sdpa_flags(name: str) -> None:
    """Set torch's process-wide SDPA flags to what attention backend `name` allows.

    For programs (the trainer, benchmarks), never called by the model: a model's attention takes its backend
    as an argument and is right whatever the flags say. When the flags already match, it skips entering
    `sdpa_kernel` around each call (~1 us check against ~20-90 us: the context manager reads and writes every
    flag twice through a generator), which is worth it eagerly at ~60 attention calls per forward.
    """
    allowed = ATTENTION_BACKENDS[check_attention_backend(name)]
    for backend, _, enable in _FLAGS:
        enable(backend in allowed)


def _flags_match(allowed: list[SDPBackend]) -> bool:
    return all(enabled() == (backend in allowed) for backend, enabled, _ in _FLAGS)


def attention(q: Tensor, k: Tensor, v: Tensor, pe: Tensor, backend: str = "auto") -> Tensor:
    """Rotate q and k by `pe`, attend with the SDPA kernels `backend` allows, and merge heads.

    Shape: q, k, v (B, H, L, D); pe (2, B, 1, L, D) -> (B, L, H*D)
    """
    q, k = apply_rope(q, pe), apply_rope(k, pe)  # (B, H, L, D)
    allowed = ATTENTION_BACKENDS[backend]
    # Under torch.compile, take the context-manager path: Dynamo traces sdpa_kernel but breaks the graph on
    # the flag getters, and a compiled graph pays no per-call Python cost anyway.
    if not torch.compiler.is_compiling() and _flags_match(allowed):
        x = F.scaled_dot_product_attention(q, k, v)  # (B, H, L, D)
    else:
        with sdpa_kernel(allowed):
            x = F.scaled_dot_product_attention(q, k, v)  # (B, H, L, D)
    return x.transpose(1, 2).flatten(2)  # (B, L, H*D)


def rope(ids: Tensor, axes_dim: tuple[int, ...], theta: int) -> Tensor:
    """RoPE tables of FLUX's multi-axis RoPE: axis i of the ids rotates its own axes_dim[i] channels.

    Channel pair (2j, 2j+1) turns by angle_j = pos_axis * theta^(-2j'/axis_dim). Returned as two tables
    made for `apply_rope`: C = (cos, cos) and S = (-sin, +sin) per pair, so that
    rope(x) = x * C + swap_pairs(x) * S. Angles are computed in float64 and stored in float32 (as the
    reference does), so large positions keep full float32 accuracy.
    Shape: ids (B, L, n_axes) -> (2, B, 1, L, D) float32
    """
    angles = []
    for i, dim in enumerate(axes_dim):
        omega = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim)  # (dim/2,)
        angles.append(ids[..., i].to(torch.float64)[..., None] * omega)  # (B, L, dim/2)
    angle = torch.cat(angles, dim=-1)  # (B, L, D/2)
    cos, sin = angle.cos(), angle.sin()
    tables = torch.stack((torch.stack((cos, cos), -1), torch.stack((-sin, sin), -1)))  # (2, B, L, D/2, 2)
    return tables.flatten(-2).unsqueeze(2).float()  # (2, B, 1, L, D)


def _rotate(x: Tensor, pe: Tensor, sign: float) -> Tensor:
    # x * C + sign * swap_pairs(x) * S in float32 (bf16 x promotes inside the kernels: no float32 copy of
    # x is made), cast back to x's dtype. sign = -1 applies the inverse rotation (the transpose).
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (B, H, L, D): pairs (x1, x0)
    return torch.addcmul(x * pe[0], swapped, pe[1], value=sign).to(x.dtype)


class _Rope(torch.autograd.Function):
    """RoPE with a hand-written backward: a rotation's gradient is the inverse rotation of the incoming
    gradient, 4 kernels instead of autograd's ~12, and nothing saved but the shared tables."""

    @staticmethod
    def forward(ctx, x: Tensor, pe: Tensor) -> Tensor:
        ctx.save_for_backward(pe)
        return _rotate(x, pe, 1.0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (pe,) = ctx.saved_tensors
        return _rotate(grad, pe, -1.0), None


def apply_rope(x: Tensor, pe: Tensor) -> Tensor:
    """Rotate each adjacent channel pair (2j, 2j+1) of x by its angle; computed in float32, cast back.

    Shape: x (B, H, L, D), pe (2, B, 1, L, D) -> (B, H, L, D)
    """
    return _Rope.apply(x, pe)


def timestep_embedding(t: Tensor, dim: int = 256, max_period: float = 10_000, time_factor: float = 1000.0) -> Tensor:
    """Sinusoidal embedding [cos | sin] of t * time_factor (t in [0, 1] becomes FLUX's 0..1000 scale).

    Shape: t (B,) -> (B, dim), float32
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (t.float() * time_factor)[:, None] * freqs  # (B, dim/2)
    return torch.cat((args.cos(), args.sin()), dim=-1)  # (B, dim)
