"""ModelConfig.flops_per_sample against torch's FlopCounterMode (which counts matmul-like ops only)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fluxzero.config import get_model_config
from fluxzero.model import build_model
from tests.model.test_model import make_inputs


def counted(model, x, backend):
    model.set_attention(backend)
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            model(**x)
    finally:
        model.set_attention("auto")
    return fc.get_total_flops()


@pytest.mark.parametrize("name", ["flux-tiny", "flux-tiny-schnell"])
@pytest.mark.parametrize("batch, h, w, txt_len", [(1, 4, 4, 3), (3, 2, 6, 9)])
def test_flops_exact_on_tiny(name, batch, h, w, txt_len):
    cfg = get_model_config(name)
    model = build_model(cfg)
    x = make_inputs(cfg, batch=batch, h=h, w=w, txt_len=txt_len)
    I, T = h * w, txt_len
    # The math backend decomposes SDPA into bmm's, which FlopCounterMode counts: exact agreement, since our
    # formula counts exactly the matmuls (biases, norms, softmax and elementwise ops are left out by both).
    assert counted(model, x, "math") == batch * cfg.flops_per_sample(I, T)
    # On CPU "auto" picks the fused flash kernel for CPU, which FlopCounterMode has no formula for: it
    # then sees everything but QK^T and AV (4 L^2 C per block).
    attn = 4 * (I + T) ** 2 * cfg.hidden_size * (cfg.depth + cfg.depth_single_blocks)
    assert counted(model, x, "auto") == batch * (cfg.flops_per_sample(I, T) - attn)


def test_flops_scale_sensibly():
    cfg = get_model_config("flux-dev")
    f512, f1024 = cfg.flops_per_sample(1024, 512), cfg.flops_per_sample(4096, 512)
    assert 2 < f1024 / f512 < 4  # more image tokens: linear part ~ 3x, attention part ~ 8.6x
    # per-token linear work can never exceed 2 FLOPs per parameter per token
    assert f512 < 2 * cfg.num_params() * 1536 + 4 * 1536**2 * cfg.hidden_size * 57


def trained(model, x) -> int:
    """FLOPs FlopCounterMode counts for one forward and backward with the math attention backend."""
    model.set_attention("math")
    try:
        with FlopCounterMode(display=False) as fc:
            model(**x).float().square().mean().backward()
    finally:
        model.set_attention("auto")
    return fc.get_total_flops()


@pytest.mark.parametrize("lora", [False, True])
def test_training_flops_count_no_weight_gradients_for_a_frozen_base(lora):
    """What MFU divides by: 3x the forward for a full fine-tune; for a LoRA the frozen linears take no weight
    gradient (2x), attention still 3x. The old count, 3x for both, was half again too high for a LoRA."""
    from fluxzero.config.lora import LoraConfig
    from fluxzero.model.lora import apply_lora

    cfg = get_model_config("flux-tiny")
    torch.manual_seed(0)
    model = build_model(cfg)
    if lora:
        apply_lora(model, LoraConfig(rank=2, targets="all-linear"))
    x = make_inputs(cfg, batch=2, h=4, w=6, txt_len=16)
    I, T = 24, 16
    got = trained(model, x)
    want = 2 * cfg.train_flops_per_sample(I, T, frozen_linears=lora)
    # left out by the formula: the adapters' rank-2 matmuls (LoRA), and the embedders' and modulations' input
    # gradients that nothing needs (per sample, or on the few image and text tokens of the embedders)
    assert got == pytest.approx(want, rel=0.04)
    if lora:
        assert got < 0.8 * 2 * 3 * cfg.flops_per_sample(I, T)  # the old count fails
