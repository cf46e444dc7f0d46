"""Parity with an independent implementation: diffusers' FluxTransformer2DModel, same weights through our
converter. Tolerance: both models run the same math in fp32 on CPU, but with different op orders (fused
qkv vs separate projections, addcmul vs mul+add, our RoPE formula vs theirs); each op rounds at ~6e-8
relative, and a few dozen ops deep that accumulates to ~1e-6 at worst, so rel 1e-5 leaves margin while
still catching any real mistake (a wrong split, swap, sign or eps moves outputs by > 1e-3).
"""

import pytest
import torch

from fluxzero.config import get_model_config
from fluxzero.model import build_model, layouts
from tests.model.test_model import make_inputs

diffusers = pytest.importorskip("diffusers")

RTOL = 1e-5


def diffusers_model(cfg):
    return diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=cfg.in_channels,
        out_channels=cfg.out_channels,
        num_layers=cfg.depth,
        num_single_layers=cfg.depth_single_blocks,
        attention_head_dim=cfg.head_dim,
        num_attention_heads=cfg.num_heads,
        joint_attention_dim=cfg.context_in_dim,
        pooled_projection_dim=cfg.vec_in_dim,
        guidance_embeds=cfg.guidance_embed,
        axes_dims_rope=cfg.axes_dim,
    ).eval()


def randomize(model, seed):
    # Default init leaves RMSNorm scales at 1 and the layouts would hide a scale mix-up; perturb everything.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p + 0.05 * torch.randn(p.shape, generator=g))
    return model


def pair(name, seed=0):
    cfg = get_model_config(name)
    torch.manual_seed(seed)
    ours = randomize(build_model(cfg), seed)
    theirs = diffusers_model(cfg)
    theirs.load_state_dict(layouts.bfl_to_diffusers(ours.state_dict()), strict=True)
    return cfg, ours, theirs


def run_theirs(model, x):
    return model(
        hidden_states=x["img"],
        encoder_hidden_states=x["txt"],
        pooled_projections=x["y"],
        timestep=x["timesteps"],
        img_ids=x["img_ids"][0],
        txt_ids=x["txt_ids"][0],
        guidance=x["guidance"],
        return_dict=False,
    )[0]


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_diffusers_key_set_is_exact():
    cfg, ours, theirs = pair("flux-tiny")
    converted = layouts.bfl_to_diffusers(ours.state_dict())
    assert set(converted) == set(theirs.state_dict())
    for k, v in theirs.state_dict().items():
        assert converted[k].shape == v.shape, k


@pytest.mark.parametrize("name", ["flux-tiny", "flux-tiny-schnell"])
@pytest.mark.parametrize("batch, h, w, txt_len", [(1, 4, 4, 3), (2, 3, 5, 7), (3, 6, 2, 16)])
def test_forward_matches_diffusers(name, batch, h, w, txt_len):
    cfg, ours, theirs = pair(name)
    x = make_inputs(cfg, batch=batch, h=h, w=w, txt_len=txt_len, seed=batch)
    with torch.no_grad():
        a, b = ours(**x), run_theirs(theirs, x)
    assert a.shape == b.shape == (batch, h * w, cfg.out_channels)
    err = rel_err(a, b)
    assert err <= RTOL, err
    assert b.norm() > 0.1 * b.numel() ** 0.5  # outputs are not trivially tiny


def test_gradients_match_diffusers():
    cfg, ours, theirs = pair("flux-tiny", seed=1)
    x = make_inputs(cfg, batch=2, h=3, w=4, txt_len=6, seed=3)
    target = torch.randn(2, 12, cfg.out_channels, generator=torch.Generator().manual_seed(9))
    ((ours(**x) - target) ** 2).mean().backward()
    ((run_theirs(theirs, x) - target) ** 2).mean().backward()
    ours_grads = {k: p.grad for k, p in ours.named_parameters()}
    mapped = layouts.bfl_to_diffusers(ours_grads)
    for k, p in theirs.named_parameters():
        assert p.grad is not None, k
        assert rel_err(mapped[k], p.grad) <= RTOL, (k, rel_err(mapped[k], p.grad))  # measured <= 1e-6
    # the whole gradient vector (measured 2.4e-7)
    flat_a = torch.cat([mapped[k].flatten() for k, _ in theirs.named_parameters()])
    flat_b = torch.cat([p.grad.flatten() for _, p in theirs.named_parameters()])
    assert rel_err(flat_a, flat_b) <= RTOL


def test_name_maps_are_inverse_bit_exact():
    _, ours, _ = pair("flux-tiny")
    sd = ours.state_dict()
    back = layouts.diffusers_to_bfl(layouts.bfl_to_diffusers(sd))
    assert list(back) == list(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_final_norm_halves_are_swapped():
    _, ours, theirs = pair("flux-tiny")
    C = ours.config.hidden_size
    ada = ours.state_dict()["final_layer.adaLN_modulation.1.weight"]
    dif = theirs.state_dict()["norm_out.linear.weight"]
    assert torch.equal(dif[:C], ada[C:]) and torch.equal(dif[C:], ada[:C])
