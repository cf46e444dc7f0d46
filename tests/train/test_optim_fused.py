"""KahanAdamW's fused (compiled) update computes what its eager update computes.

The fused kernel is what runs on a GPU; here it is compiled for the CPU (Inductor's C++ backend), which is the
same graph. After one step from the same state, the Kahan sum (weight + carry, the value the optimizer tracks)
must agree to fp32 rounding, and the stochastically rounded m and v must lie within one bf16 ulp of each other
(their rounding draws differ between the two paths).
"""

import copy

import pytest
import torch

from fluxzero.train.optim.optimizers import KahanAdamW


def _state(n=4099, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, generator=g) * 0.05).to(torch.bfloat16)
    grads = [(torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16) for _ in range(3)]
    return w, grads


def _run(fused: bool, steps: int = 3):
    w, grads = _state()
    p = torch.nn.Parameter(w.clone())
    opt = KahanAdamW([p], lr=1e-5, weight_decay=0.01, fused=fused)
    for g in grads[:steps]:
        p.grad = g.clone()
        opt.step()
    st = opt.state[p]
    return p.detach().float() + st["comp"].float(), st["exp_avg"].float(), st["exp_avg_sq"].float()


@pytest.mark.slow  # one Inductor compile on the CPU (~10-30 s)
def test_fused_kahan_step_matches_the_eager_step():
    torch.manual_seed(0)
    exact_e, m_e, v_e = _run(fused=False, steps=1)
    exact_f, m_f, v_f = _run(fused=True, steps=1)
    w0, _ = _state()
    moved = (exact_e - w0.float()).abs().max()
    assert moved > 0  # the step did something (lr 1e-5 is far under a bf16 ulp of these weights)
    # the weight + carry after one step is deterministic (the update uses m, v before rounding)
    assert torch.allclose(exact_f, exact_e, rtol=0, atol=1e-9), (exact_f - exact_e).abs().max()
    for a, b in ((m_f, m_e), (v_f, v_e)):
        ulp = torch.finfo(torch.bfloat16).eps * b.abs().clamp_min(torch.finfo(torch.float32).tiny)
        assert ((a - b).abs() <= ulp * 1.01).all()


def test_kahan_update_formula_is_adamw_in_float64():
    """The eager update (the one the CPU and the quality tests run) against AdamW written out in float64."""
    w, grads = _state(n=257, seed=3)
    p = torch.nn.Parameter(w.clone())
    opt = KahanAdamW([p], lr=1e-4, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, fused=False)
    p.grad = grads[0].clone()
    before = copy.deepcopy(p.detach()).double()
    opt.step()
    g = grads[0].double()
    m = 0.1 * g
    v = 0.01 * g * g
    ref = before - 1e-4 / 0.1 * m / ((v / 0.01).sqrt() + 1e-8) - 1e-4 * 0.1 * before
    got = p.detach().double() + opt.state[p]["comp"].double()
    # the carry is bf16: up to half a weight ulp (2.4e-4 for |w| < 0.125), held to 2^-9 of itself: 4.8e-7;
    # the update is ~1e-4, so the bound is 0.6% of it (a missing bias correction is off by 10x)
    assert torch.allclose(got, ref, rtol=0, atol=6e-7), (got - ref).abs().max()
    assert (got - before).abs().max() > 5e-5
