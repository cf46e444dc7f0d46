"""The FLUX.1 module: shapes, parameter names and counts, guidance handling, RoPE, backends."""

import pytest
import torch

from fluxzero.config import get_model_config
from fluxzero.model import Flux, build_model
from fluxzero.model import math as fmath


def make_inputs(cfg, batch=2, h=4, w=6, txt_len=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    img_ids = torch.stack((torch.zeros_like(rows), rows, cols), -1).reshape(1, h * w, 3).float().repeat(batch, 1, 1)
    return dict(
        img=torch.randn(batch, h * w, cfg.in_channels, generator=g),
        img_ids=img_ids,
        txt=torch.randn(batch, txt_len, cfg.context_in_dim, generator=g),
        txt_ids=torch.zeros(batch, txt_len, 3),
        timesteps=torch.rand(batch, generator=g),
        y=torch.randn(batch, cfg.vec_in_dim, generator=g),
        guidance=torch.full((batch,), 3.5) if cfg.guidance_embed else None,
    )


def test_bfl_parameter_names():
    names = set(build_model("flux-tiny", device="meta").state_dict())
    for key in [
        "img_in.weight",
        "txt_in.bias",
        "time_in.in_layer.weight",
        "time_in.out_layer.bias",
        "vector_in.in_layer.weight",
        "guidance_in.out_layer.weight",
        "double_blocks.1.img_mod.lin.weight",
        "double_blocks.0.img_attn.qkv.bias",
        "double_blocks.0.img_attn.norm.query_norm.scale",
        "double_blocks.0.txt_attn.norm.key_norm.scale",
        "double_blocks.0.img_attn.proj.weight",
        "double_blocks.0.img_mlp.0.weight",
        "double_blocks.0.txt_mlp.2.bias",
        "double_blocks.0.txt_mod.lin.bias",
        "single_blocks.1.linear1.weight",
        "single_blocks.0.linear2.bias",
        "single_blocks.0.norm.query_norm.scale",
        "single_blocks.0.norm.key_norm.scale",
        "single_blocks.0.modulation.lin.weight",
        "final_layer.linear.weight",
        "final_layer.adaLN_modulation.1.bias",
    ]:
        assert key in names, key
    schnell = set(build_model("flux-tiny-schnell", device="meta").state_dict())
    assert not any(k.startswith("guidance_in") for k in schnell)
    assert names - schnell == {k for k in names if k.startswith("guidance_in")}


def test_forward_shapes_dtype_and_block_lists():
    cfg = get_model_config("flux-tiny")
    model = build_model(cfg, dtype=torch.bfloat16)
    assert model.config is cfg and isinstance(model, Flux)
    assert len(model.double_blocks) == cfg.depth and len(model.single_blocks) == cfg.depth_single_blocks
    out = model(**make_inputs(cfg, batch=3, h=2, w=5, txt_len=7))  # float32 inputs follow the weights
    assert out.shape == (3, 10, cfg.out_channels) and out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()


def test_guidance_required_and_used():
    cfg = get_model_config("flux-tiny")
    model = build_model(cfg)
    x = make_inputs(cfg)
    with pytest.raises(ValueError, match="guidance"):
        model(**{**x, "guidance": None})
    out_a = model(**x)
    out_b = model(**{**x, "guidance": x["guidance"] * 2})
    assert not torch.allclose(out_a, out_b)
    with pytest.raises(ValueError, match=r"img_ids and txt_ids must be \(B, L, 3\)"):
        model(**{**x, "img_ids": x["img_ids"][0], "txt_ids": x["txt_ids"][0]})
    schnell = build_model("flux-tiny-schnell")
    assert schnell(**{**x, "guidance": None}).shape == out_a.shape


def test_batch_items_independent():
    # Each sample's output depends on its own inputs only (no cross-batch leakage through attention/modulation).
    torch.manual_seed(0)
    cfg = get_model_config("flux-tiny")
    model = build_model(cfg)
    x = make_inputs(cfg, batch=3)
    full = model(**x)
    one = model(**{k: v[1:2] for k, v in x.items()})
    torch.testing.assert_close(full[1:2], one, rtol=1e-5, atol=1e-6)


def test_rope_is_a_rotation_with_relative_positions():
    torch.manual_seed(0)
    axes, D = (4, 6, 6), 16
    q, k = torch.randn(1, 2, 1, D), torch.randn(1, 2, 1, D)
    ids_a = torch.tensor([[[0.0, 3, 5]]])
    pe_a = fmath.rope(ids_a, axes, 10_000)
    assert pe_a.shape == (2, 1, 1, 1, D)
    qa = fmath.apply_rope(q, pe_a)
    torch.testing.assert_close(qa.norm(dim=-1), q.norm(dim=-1))
    # q.k after rotation depends only on the difference of positions
    pe_b = fmath.rope(torch.tensor([[[0.0, 1, 2]]]), axes, 10_000)
    dot1 = (fmath.apply_rope(q, pe_b) * fmath.apply_rope(k, pe_a)).sum(-1)  # offset (0, 2, 3)
    dot_ref = (
        fmath.apply_rope(q, fmath.rope(torch.tensor([[[0.0, 0, 0]]]), axes, 10_000))
        * fmath.apply_rope(k, fmath.rope(torch.tensor([[[0.0, 2, 3]]]), axes, 10_000))
    ).sum(-1)
    torch.testing.assert_close(dot1, dot_ref, rtol=1e-5, atol=1e-5)
    dot_other = (fmath.apply_rope(q, pe_a) * fmath.apply_rope(k, pe_b)).sum(-1)  # offset (0, -2, -3)
    assert not torch.allclose(dot_other, dot_ref, rtol=1e-3, atol=1e-3)
    # zero ids (text tokens) leave vectors unchanged
    zero = fmath.rope(torch.zeros(1, 1, 3), axes, 10_000)
    torch.testing.assert_close(fmath.apply_rope(q, zero), q)


def test_attention_backends_agree_on_cpu():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 16) for _ in range(3))
    pe = fmath.rope(torch.randint(0, 5, (2, 9, 3)).float(), (4, 6, 6), 10_000)
    ref = fmath.attention(q, k, v, pe, "math")
    torch.testing.assert_close(fmath.attention(q, k, v, pe, "auto"), ref, rtol=1e-5, atol=1e-6)
    assert ref.shape == (2, 9, 64)
    with pytest.raises(ValueError, match="choose one of"):
        fmath.check_attention_backend("xformers")
    with pytest.raises(ValueError, match="choose one of"):
        build_model("flux-tiny", attention="xformers")


def test_attention_backend_is_the_models_and_survives_outside_flag_changes():
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    pe = fmath.rope(torch.zeros(1, 5, 3), (4, 6, 6), 10_000)

    def bmm_flops(backend):
        with FlopCounterMode(display=False) as fc:
            fmath.attention(q, k, v, pe, backend)
        return fc.get_total_flops()  # attention has no other matmul

    flags = [f() for _, f, _ in fmath._FLAGS]
    try:
        # math decomposes into bmm's; CPU flash is one opaque op
        assert bmm_flops("math") == 2 * 2 * (2 * 5 * 5 * 16)  # whatever the process flags say
        fmath.set_process_sdpa_flags("math")  # the fast path: flags match, SDPA is called directly
        assert torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
        assert bmm_flops("math") == 2 * 2 * (2 * 5 * 5 * 16)
        torch.backends.cuda.enable_math_sdp(False)  # someone else changes the global flags
        torch.backends.cuda.enable_flash_sdp(True)
        assert bmm_flops("math") == 2 * 2 * (2 * 5 * 5 * 16)  # still math, through sdpa_kernel
        assert torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.math_sdp_enabled()  # restored
        assert bmm_flops("auto") == 0
    finally:
        for (_, _, enable), on in zip(fmath._FLAGS, flags):
            enable(on)
    model = build_model("flux-tiny", attention="math")
    assert {b.attention for b in (*model.double_blocks, *model.single_blocks)} == {"math"}
    model.set_attention("flash")
    assert {b.attention for b in (*model.double_blocks, *model.single_blocks)} == {"flash"}


def test_blocks_trace_without_graph_breaks():
    # torch.compile of a block (applied from outside, like checkpointing) must see one graph.
    import torch._dynamo

    cfg = get_model_config("flux-tiny")
    model = build_model(cfg)
    x = make_inputs(cfg, batch=2, h=2, w=3, txt_len=4)
    pe = fmath.rope(torch.cat((x["txt_ids"], x["img_ids"]), 1), cfg.axes_dim, cfg.theta)
    img, txt, vec = torch.randn(2, 6, 64), torch.randn(2, 4, 64), torch.randn(2, 64)
    torch._dynamo.reset()
    try:
        for block, args in (
            (model.double_blocks[0], (img, txt, vec, pe)),
            (model.single_blocks[0], (torch.cat((txt, img), 1), vec, pe)),
        ):
            explained = torch._dynamo.explain(block)(*args)
            assert explained.graph_break_count == 0, explained.break_reasons
    finally:
        torch._dynamo.reset()


def test_rope_matches_complex_rotation_and_gradcheck():
    # Independent formulation: each channel pair is a complex number multiplied by e^{i angle}.
    torch.manual_seed(0)
    axes, theta = (4, 6, 6), 10_000
    ids = torch.randint(0, 40, (2, 7, 3)).double()
    x = torch.randn(2, 3, 7, 16, dtype=torch.float64, requires_grad=True)
    omega = [theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d) for d in axes]
    angle = torch.cat([ids[..., i, None] * w for i, w in enumerate(omega)], -1)[:, None]  # (B, 1, L, D/2)
    ref = torch.view_as_real(
        torch.view_as_complex(x.unflatten(-1, (-1, 2))) * torch.polar(torch.ones_like(angle), angle)
    )
    pe = fmath.rope(ids, axes, theta)
    torch.testing.assert_close(fmath.apply_rope(x, pe), ref.flatten(-2), rtol=1e-6, atol=1e-6)  # pe is float32
    assert torch.autograd.gradcheck(lambda t: fmath.apply_rope(t, pe.double()), (x,))
    # bf16 in, bf16 out, computed in float32: equals rotating the float32 copy then rounding
    xb = x.detach().bfloat16()
    torch.testing.assert_close(fmath.apply_rope(xb, pe), fmath.apply_rope(xb.float(), pe).bfloat16(), rtol=0, atol=0)


def test_one_seed_gives_the_float32_weights_rounded_in_every_dtype():
    # build_model initialises in float32 and rounds each module to its dtype: a bf16 run and an fp32 run of one
    # seed start from the same weights, and the generator is left where an fp32 build leaves it
    torch.manual_seed(3)
    fp32 = build_model("flux-tiny").state_dict()
    after = torch.rand(1)
    torch.manual_seed(3)
    bf16 = build_model("flux-tiny", dtype=torch.bfloat16).state_dict()
    assert torch.equal(torch.rand(1), after)
    assert bf16.keys() == fp32.keys()
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, fp32[k].bfloat16()) for k, v in bf16.items())
