"""Rectified-flow helpers: each small function against a hand-computed or independent value."""

import math

import pytest
import torch

from fluxzero.config import FlowConfig
from fluxzero.model.packing import pack
from fluxzero.train import flow


def test_noisy_endpoints_and_target():
    x0, noise = torch.randn(3, 16, 4, 4), torch.randn(3, 16, 4, 4)
    assert torch.equal(flow.noisy(x0, noise, torch.zeros(3)), x0)
    assert torch.equal(flow.noisy(x0, noise, torch.ones(3)), noise)
    mid = flow.noisy(x0, noise, torch.tensor([0.25, 0.5, 0.75]))
    assert torch.allclose(mid[1], 0.5 * x0[1] + 0.5 * noise[1])
    # the target is the time derivative of x_t
    t, dt = torch.full((3,), 0.3, dtype=torch.float64), 1e-6
    x0d, nd = x0.double(), noise.double()
    fd = (flow.noisy(x0d, nd, t + dt) - flow.noisy(x0d, nd, t)) / dt
    assert torch.allclose(fd, flow.target(x0d, nd), atol=1e-6)


def test_loss_is_mse_in_fp32():
    a, b = torch.randn(2, 3, 4).bfloat16(), torch.randn(2, 3, 4)
    out = flow.loss(a, b)
    assert out.dtype == torch.float32
    assert torch.allclose(out, ((a.float() - b) ** 2).mean())


def test_timestep_sampling():
    g = torch.Generator().manual_seed(0)
    u = flow.sample_timesteps(20000, "uniform", generator=g)
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    ln = flow.sample_timesteps(20000, "logit_normal", mean=1.0, std=0.5, generator=g)
    logit = torch.log(ln / (1 - ln))
    assert abs(logit.mean() - 1.0) < 0.02 and abs(logit.std() - 0.5) < 0.02
    with pytest.raises(ValueError):
        flow.sample_timesteps(1, "beta")


def test_shift_formula_values():
    # resolution mu: linear through (256, 0.5) and (4096, 1.15)
    assert flow.resolution_mu(256) == pytest.approx(0.5)
    assert flow.resolution_mu(4096) == pytest.approx(1.15)
    assert flow.resolution_mu(2176) == pytest.approx(0.825)
    t = torch.tensor([0.0001, 0.25, 0.5, 0.9999], dtype=torch.float64)
    mu = 1.15
    hand = [math.exp(mu) / (math.exp(mu) + 1 / v - 1) for v in t.tolist()]
    assert torch.allclose(flow.time_shift(t, mu), torch.tensor(hand, dtype=torch.float64))
    # t = 0.5 maps to sigmoid(mu); a fixed shift s equals s t / (1 + (s - 1) t) (SD3's form)
    assert flow.time_shift(torch.tensor(0.5), mu).item() == pytest.approx(1 / (1 + math.exp(-mu)))
    s = 3.0
    assert torch.allclose(flow.shift_timesteps(t, "fixed", 0, s), s * t / (1 + (s - 1) * t))
    assert torch.equal(flow.shift_timesteps(t, "none", 0), t)
    assert flow.shift_timesteps(torch.tensor([0.5]), "resolution", 4096).item() == pytest.approx(
        1 / (1 + math.exp(-1.15))
    )


def _batch(index, hw=(4, 6), ctx=8, vec=5):
    n = len(index)
    return {
        "latents": torch.randn(n, 16, *hw),
        "t5": torch.randn(n, 3, ctx),
        "clip": torch.randn(n, vec),
        "index": torch.tensor(index),
    }


def test_prepare_batch_shapes_and_consistency():
    cfg = FlowConfig(guidance=3.5)
    batch = _batch([5, 9])
    inputs, tgt = flow.prepare_batch(batch, cfg, seed=1, epoch=0, guidance_embed=True)
    assert inputs["img"].shape == (2, 6, 64) and tgt.shape == (2, 6, 64)
    assert inputs["img_ids"].shape == (2, 6, 3) and inputs["txt_ids"].shape == (2, 3, 3)
    assert inputs["guidance"].tolist() == [3.5, 3.5]
    t = inputs["timesteps"]
    assert ((t > 0) & (t < 1)).all()
    # img and target are consistent with one noise draw: x_t + (1 - t) target = noise, x_t - t target = x0
    x0 = pack(batch["latents"])
    tt = t[:, None, None]
    assert torch.allclose(inputs["img"] - tt * tgt, x0, atol=1e-5)
    assert flow.prepare_batch(batch, cfg, seed=1, epoch=0, guidance_embed=False)[0]["guidance"] is None


def test_noise_is_keyed_per_sample_not_per_layout():
    cfg = FlowConfig()
    batch = _batch([3, 4])
    both, tgt_both = flow.prepare_batch(batch, cfg, seed=7, epoch=2, guidance_embed=False)
    one = {k: v[1:] for k, v in batch.items()}
    single, tgt_single = flow.prepare_batch(one, cfg, seed=7, epoch=2, guidance_embed=False)
    assert torch.equal(both["img"][1:], single["img"]) and torch.equal(tgt_both[1:], tgt_single)
    # different samples (as on different ranks), epochs and seeds draw different noise
    assert not torch.equal(tgt_both[0], tgt_both[1])
    other_epoch, _ = flow.prepare_batch(batch, cfg, seed=7, epoch=3, guidance_embed=False)
    assert not torch.equal(other_epoch["timesteps"], both["timesteps"])


def test_mu_matches_diffusers_flux_pipeline():
    """diffusers' FluxPipeline is an independent implementation of the same conventions."""
    pipe = pytest.importorskip("diffusers.pipelines.flux.pipeline_flux")
    for tokens in (256, 1024, 4096):
        assert flow.resolution_mu(tokens) == pytest.approx(pipe.calculate_shift(tokens))
