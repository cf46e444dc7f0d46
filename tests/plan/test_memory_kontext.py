"""The memory model counts a FLUX.1 Kontext model's reference tokens: its activation inventory, checked against
what autograd saves in the model's real forward with reference tokens, and `estimate` / `--fit` on the longer
sequence."""

from __future__ import annotations

import torch

from fluxzero import plan as memory
from fluxzero.config import get_model_config
from fluxzero.model import build_model
from fluxzero.model.packing import img_ids, with_reference
from tests.plan.test_memory_activations import saved_bytes


def test_reference_tokens_are_image_tokens_of_the_estimate():
    plain = memory.RunSpec("flux-dev", height=512, width=512, lora_rank=16, stage=2)
    kontext = plain.replace(model=get_model_config("flux-kontext-dev"))
    assert (plain.img_tokens, kontext.reference_tokens, kontext.img_tokens) == (1024, 1024, 2048)
    assert memory.activation_bytes(kontext)["stored"] > memory.activation_bytes(plain)["stored"]
    assert memory.estimate(kontext).gpu_total > memory.estimate(plain).gpu_total
    # --fit on a GPU the plain run fits with a larger micro batch than the Kontext run
    hw = memory.Hardware(gpu_memory_gib=40)
    a, b = (memory.fit(s, hw, fixed={"stage": 2, "offload_blocks": 0}) for s in (plain, kontext))
    assert a.spec is not None and b.spec is not None and b.spec.micro_batch < a.spec.micro_batch


def test_kontext_forward_saves_what_the_inventory_counts():
    """As test_whole_model_saved_bytes_within_5_percent, with the reference tokens after the target's."""
    cfg = get_model_config("flux-tiny-kontext")
    model = build_model(cfg, dtype=torch.float32)
    B, h, w, T = 2, 128, 96, 24
    spec = memory.RunSpec(
        cfg, height=h, width=w, txt_len=T, micro_batch=B, precision="fp32", checkpoint_every=0, stage=0, device="cpu"
    )
    g = torch.Generator().manual_seed(0)
    target = torch.randn(B, spec.img_tokens - spec.reference_tokens, cfg.in_channels, generator=g)
    img, ids = with_reference(target, img_ids(B, h // 8, w // 8), torch.randn(B, 16, h // 8, w // 8, generator=g))
    assert img.shape[1] == spec.img_tokens
    txt = torch.randn(B, T, cfg.context_in_dim, generator=g)
    args = (
        img,
        ids,
        txt,
        torch.zeros(B, T, 3),
        torch.rand(B, generator=g),
        torch.randn(B, cfg.vec_in_dim, generator=g),
        torch.ones(B),
    )
    got = saved_bytes(model, args, list(model.parameters()))
    _, head = memory.outside_blocks_saved(cfg, spec.img_tokens, T, 4)
    want = memory.activation_bytes(spec)["stored"] + B * head
    assert abs(got - want) / got < 0.05, (got, want)
