"""FLUX.1's Euler time grid: N steps from noise (sigma 1) to data (sigma 0), shifted toward noise by image size.

The same numbers as diffusers' FlowMatchEulerDiscreteScheduler under FluxPipeline (use_dynamic_shifting,
exponential time shift) and as BFL's get_schedule (the same grid up to rounding): sigmas_i = linspace(1, 1/N, N) in float64, rounded to
float32, shifted by sigma' = e^mu / (e^mu + 1/sigma - 1) with mu from the packed image token count, and a
final 0 appended. Every operation is the float32 one diffusers performs, so the grids are bit-identical
(tests/sampling/test_sampling.py checks it for several step counts and sizes).
"""

from __future__ import annotations

import math

import torch

# BFL's get_schedule / diffusers' FluxPipeline defaults: mu = 0.5 at 256 image tokens, 1.15 at 4096, linear.
BASE_TOKENS, MAX_TOKENS, BASE_SHIFT, MAX_SHIFT = 256, 4096, 0.5, 1.15
NUM_TRAIN_TIMESTEPS = 1000  # diffusers' timestep scale: timesteps = sigmas * 1000


def image_tokens(height: int, width: int) -> int:
    """Packed image tokens of a height x width pixel image: one per 16x16 pixels (8x VAE, 2x2 packing)."""
    return (height // 16) * (width // 16)


def shift_mu(
    tokens: int,
    base_tokens: int = BASE_TOKENS,
    max_tokens: int = MAX_TOKENS,
    base_shift: float = BASE_SHIFT,
    max_shift: float = MAX_SHIFT,
) -> float:
    """mu linear in the image token count, written as diffusers' calculate_shift (slope, intercept) so the
    float64 value is the same to the last bit."""
    m = (max_shift - base_shift) / (max_tokens - base_tokens)
    b = base_shift - m * base_tokens
    return tokens * m + b


def sigmas(steps: int, tokens: int | None = None, *, shift: bool = True) -> torch.Tensor:
    """The time grid, float32, length steps + 1: sigmas[0] = 1 (pure noise) ... sigmas[-1] = 0 (data).

    `tokens` = packed image tokens (see `image_tokens`), needed when `shift` is on. FLUX.1-dev samples
    shifted; schnell does not (BFL's cli passes shift=not is_schnell, and schnell's diffusers scheduler
    config has use_dynamic_shifting false and shift 1.0, which leaves the grid unchanged).
    Shape: -> (steps + 1,)
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    # numpy's linspace (what diffusers calls): start + i * step in float64, the last point set to stop
    stop = 1.0 / steps
    step = (stop - 1.0) / (steps - 1) if steps > 1 else 0.0
    grid = [1.0 + i * step for i in range(steps)]
    grid[-1] = stop
    s = torch.tensor(grid, dtype=torch.float64).to(torch.float32)
    if shift:
        if tokens is None:
            raise ValueError("a shifted schedule needs the image token count (tokens=image_tokens(height, width))")
        # float32 throughout with float32 operands, as numpy does it: `em / x` on a tensor would be
        # reciprocal-then-multiply in PyTorch and round differently, hence the explicit torch.div
        em = torch.tensor(math.exp(shift_mu(tokens)), dtype=torch.float32)
        one = torch.tensor(1.0, dtype=torch.float32)
        s = torch.div(em, em + (torch.div(one, s) - one))
    return torch.cat([s, torch.zeros(1, dtype=torch.float32)])


def timesteps(sig: torch.Tensor) -> torch.Tensor:
    """diffusers' scheduler.timesteps for a grid: sigma * 1000 for each step (the final 0 is not a step)."""
    return sig[:-1] * NUM_TRAIN_TIMESTEPS
