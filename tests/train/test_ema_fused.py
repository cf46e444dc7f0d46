"""The bf16 EMA update: counter-hash noise (fluxzero.train.optim.optimizers.counter_noise) and its compiled kernel.

On a GPU the update is one compiled kernel (`ema._fused_ema_bf16`); here it is compiled for the CPU, the same graph.
"""

import pytest
import torch

from fluxzero.train import ema as ema_mod
from fluxzero.train.optim.rounding import counter_noise, mix32

M = 0xFFFFFFFF


def _lowbias32_ref(i: int, key: int) -> int:
    x = (i * 0x9E3779B1 + key) & M
    x ^= x >> 16
    x = x * 0x7FEB352D & M
    x ^= x >> 15
    x = x * 0x846CA68B & M
    x ^= x >> 16
    return x & 0xFFFF


def test_counter_noise_is_lowbias32_of_the_index_and_uniform():
    key = mix32(7, 123, 1, 0, 0)
    got = counter_noise(4096, key, "cpu")
    assert got.tolist()[:300] == [_lowbias32_ref(i, key & M) for i in range(300)]
    assert got.min() >= 0 and got.max() < 1 << 16
    big = counter_noise(1 << 20, mix32(1), "cpu").float()
    assert abs(big.mean().item() / 65535 - 0.5) < 2e-3  # uniform: the mean of 1M draws within 0.2%
    assert not torch.equal(counter_noise(64, mix32(1, 2), "cpu"), counter_noise(64, mix32(1, 3), "cpu"))


def test_bf16_ema_update_is_unbiased_where_round_to_nearest_stalls():
    """decay 0.999 moves the EMA by 1e-3 of a gap under half a bf16 ulp: round-to-nearest never moves it."""
    e = torch.full((1 << 16,), 1.0, dtype=torch.bfloat16)
    target = torch.full_like(e, 1.0 + 2**-8, dtype=torch.float32)  # half a bf16 ulp above 1.0
    exact = torch.full_like(target, 1.0)
    w = torch.tensor(1e-3)
    for step in range(50):
        ema_mod._ema_bf16_(e, target, w, torch.tensor(mix32(0, step), dtype=torch.int32))
        exact += (target - exact) * 1e-3
    assert (e.float().mean() - exact.mean()).abs() < 2e-5  # exact moved 1.9e-4: SR keeps it to ~1e-5
    rtn = torch.full_like(e, 1.0)
    for _ in range(50):
        rtn = rtn.float().lerp(target, 1e-3).to(torch.bfloat16)
    assert torch.equal(rtn.float(), torch.ones_like(target))  # the trap the noise avoids


@pytest.mark.slow  # one Inductor compile on the CPU
def test_compiled_bf16_ema_update_matches_the_eager_one():
    g = torch.Generator().manual_seed(0)
    e0 = (torch.randn(5003, generator=g) * 0.05).to(torch.bfloat16)
    m = (torch.randn(5003, generator=g) * 0.05).to(torch.bfloat16)
    w, key = torch.tensor(0.01), torch.tensor(mix32(3, 4), dtype=torch.int32)
    eager, fused = e0.clone(), e0.clone()
    ema_mod._ema_bf16_(eager, m, w, key)
    torch.compile(ema_mod._ema_bf16_, dynamic=True, fullgraph=True)(fused, m, w, key)
    assert not torch.equal(eager, e0)
    diff = (eager.float() - fused.float()).abs()
    ulp = torch.finfo(torch.bfloat16).eps * eager.float().abs()
    # same noise; a fused multiply-add may round the fp32 lerp differently, moving a value across a rounding
    # boundary in rare cases: at most one bf16 ulp, and almost never
    assert (diff <= ulp * 1.01).all() and (diff > 0).float().mean() < 1e-3
