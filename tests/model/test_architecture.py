"""fluxzero.config.architecture against the built model, for every preset: every module with parameters (name,
tensors, order), the linears' shapes (the LoRA targets), the blocks, the parameter count and inventory, and the
forward FLOPs with a Kontext model's reference tokens."""

import pytest
import torch
from torch import nn

from fluxzero.config import MODEL_PRESETS, architecture, get_model_config
from fluxzero.model import build_model
from fluxzero.model.packing import with_reference
from fluxzero.plan import param_inventory
from tests.model.test_model import make_inputs
from tests.model.test_model_flops import counted


def _own_params(module: nn.Module) -> tuple[int, ...]:
    return tuple(p.numel() for p in module.parameters(recurse=False))


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_table_is_the_built_model(name):
    cfg = get_model_config(name)
    model = build_model(cfg, device="meta")  # shapes only: the 12B presets never exist
    mods = dict(model.named_modules())
    owners = [n for n, m in model.named_modules() if _own_params(m)]
    table = architecture.layers(cfg)
    assert [n for n, _ in table] == owners  # every module with parameters, in registration order
    assert all(_own_params(mods[n]) == lay.tensors for n, lay in table)
    assert [p.numel() for p in model.parameters()] == [n for _, lay in table for n in lay.tensors]
    assert all(isinstance(mods[n], nn.Linear) == (lay.kind == "linear") for n, lay in table)

    shapes = architecture.linear_shapes(cfg)  # what LoRA targets: every linear, in module order
    assert list(shapes) == [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert all(shapes[n] == (mods[n].in_features, mods[n].out_features) for n in shapes)

    total = sum(p.numel() for p in model.parameters())
    inv = param_inventory(cfg)
    assert cfg.num_params() == architecture.num_params(cfg) == inv.total == total
    for blocks, block in ((model.double_blocks, inv.double_block), (model.single_blocks, inv.single_block)):
        assert all(sum(p.numel() for p in b.parameters()) == block for b in blocks)
    assert inv.outside_blocks == total - sum(
        p.numel() for b in (*model.double_blocks, *model.single_blocks) for p in b.parameters()
    )
    assert inv.largest_layer == max(sum(_own_params(m)) for m in model.modules())

    # FLOPs: the math backend's matmuls, on the target's tokens and a Kontext model's reference tokens
    h, w, txt = 2, 4, 3
    x = make_inputs(cfg, batch=2, h=h, w=w, txt_len=txt)
    ref = architecture.reference_tokens(cfg, h * w)
    if ref:
        reference = torch.randn(2, cfg.latent_channels, 2 * h, 2 * w)  # at the target's size
        x["img"], x["img_ids"] = with_reference(x["img"], x["img_ids"], reference)
    assert x["img"].shape[1] == h * w + ref
    x = {k: (v.to("meta") if v is not None else None) for k, v in x.items()}
    assert counted(model, x, "math") == 2 * cfg.flops_per_sample(h * w + ref, txt)


def test_presets_follow_the_table():
    assert list(MODEL_PRESETS) == list(architecture.PRESETS)
    dev = get_model_config("flux-dev")
    assert dev.num_params() == 11_901_408_320 and get_model_config("flux-schnell").num_params() == 11_891_178_560
    for name, (base, changes) in architecture.PRESETS.items():
        cfg = MODEL_PRESETS[name]
        assert cfg.name == name and all(getattr(cfg, k) == v for k, v in changes.items())
        assert base is None or cfg.same_shape(MODEL_PRESETS[base].replace(**changes))
    kontext = get_model_config("flux-kontext-dev")  # FLUX.1-dev's tensors, twice the image tokens
    assert architecture.layers(kontext) == architecture.layers(dev) and kontext.kontext
    assert architecture.reference_tokens(kontext, 1024) == 1024 and architecture.reference_tokens(dev, 1024) == 0
