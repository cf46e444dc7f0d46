"""Stochastic rounding to bf16 (round_with_noise) and counter-based noise for it: random bits that are a hash of (key, element index).

torch's CPU generator fills a tensor serially (17-22 ns a value on one thread however many cores), and a draw
from the global CUDA generator inside a compiled kernel would move the stream the trainer's own draws come from.
A hash of (key, index) is torch's parallel integer kernels (6 ns a value on one thread), the same on every device
and inside a compiled kernel, and needs no generator state in a checkpoint: the host optimizer modes
(fluxzero.train.optim.host) and the bf16 EMA (fluxzero.train.ema) draw their rounding noise here.
"""

from __future__ import annotations

import torch


def _i32(c: int) -> int:
    """A 32-bit constant as the int32 with the same bits."""
    c &= 0xFFFFFFFF
    return c - (1 << 32) if c >= 1 << 31 else c


def lowbias32(x: int) -> int:
    """Chris Wellons' lowbias32 integer hash of a 32-bit value, in Python ints: the reference counter_noise is
    held to."""
    x ^= x >> 16
    x = x * 0x7FEB352D & 0xFFFFFFFF
    x ^= x >> 15
    x = x * 0x846CA68B & 0xFFFFFFFF
    return x ^ (x >> 16)


def mix32(*words: int) -> int:
    """A 32-bit key from a few integers (lowbias32 over each in turn), as a Python int in int32's range."""
    h = 0
    for w in words:
        h = lowbias32((h ^ (w & 0xFFFFFFFF)) * 0x9E3779B1 & 0xFFFFFFFF)
    return _i32(h)


def counter_noise(n: int, key, device) -> torch.Tensor:
    """Shape: () -> (n,) int32 in [0, 2^16): the low 16 bits of lowbias32(i * 0x9E3779B1 + key mod 2^32) for
    element i.

    Noise for stochastic rounding that is a function of (key, index), not a generator's state: the same values
    whatever the chunking, after a resume, on any device, and inside a compiled kernel (`key` may be a 0-d int32
    tensor, so one kernel serves every key). int32 additions and products wrap modulo 2^32 and the masks make the
    arithmetic right shifts logical (tests hold it to `lowbias32`). int32, not int64: on the CPU an int64 op over a
    chunk cost several times an int32 one (a fresh temporary twice the size each; benchmarks/RESULTS.md).
    Elements from `start` of a longer stream: key noise_key(key, start)."""
    x = torch.arange(n, device=device, dtype=torch.int32)
    x.mul_(_i32(0x9E3779B1)).add_(key)
    x ^= (x >> 16) & 0xFFFF
    x.mul_(_i32(0x7FEB352D))
    x ^= (x >> 15) & 0x1FFFF
    x.mul_(_i32(0x846CA68B))
    x ^= (x >> 16) & 0xFFFF
    return x & 0xFFFF


def noise_key(key: int, start: int) -> int:
    """The key that makes counter_noise(n, noise_key(key, start)) element i the noise of element start + i under
    `key`: the low 32 bits of the index, times the hash's odd multiplier modulo 2^32 (as counter_noise's int32
    arithmetic wraps), are added to the key, and an index past 2^32 (one ZeRO-2 partition of FLUX.1-dev holds
    11.9e9 values) puts its high half into it by mix32. A chunk's kernel then takes one 0-d key and no offset."""
    return _i32((start & 0xFFFFFFFF) * 0x9E3779B1 + mix32(key, start >> 32))


def round_keyed(x32: torch.Tensor, key) -> torch.Tensor:
    """fp32 -> bf16 by stochastic rounding with counter_noise(x32.numel(), key), any shape; `key` an int or a 0-d
    int32 tensor (one compiled kernel for every key)."""
    return round_with_noise(x32, counter_noise(x32.numel(), key, x32.device).view(x32.shape))


def round_with_noise(x32: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by stochastic rounding: add 16 random low bits (`noise`, int32 in [0, 2^16)) to the fp32 bits,
    truncate. Unbiased; values already bf16 never change; inf/NaN pass through."""
    bits = x32.contiguous().view(torch.int32)
    rounded = ((bits + noise) & -65536).view(torch.float32)
    return torch.where(torch.isfinite(x32), rounded, x32).to(torch.bfloat16)
