"""DoRA and LoKr (lora.type): the adapters PEFT puts on our model, their LyCORIS file read the way ComfyUI reads
it, the plain LoRA that stands for them read the way Nunchaku reads it (diffusers' FluxLoraLoaderMixin.lora_state_dict
on the tensors alone), `fluxzero convert` on other trainers' layouts, and the bad input of each.

Tolerances: RTOL 1e-5 where the same fp32 math runs in another order (as tests/model/test_lora_conformance.py);
a plain LoRA of a rank below the change's is held to the relative error its export reports.
"""

import copy

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from fluxzero import plan as memory
from fluxzero.cli import main as cli
from fluxzero.config import get_model_config
from fluxzero.config.lora import LoraConfig, lora_param_count
from fluxzero.model import adapters as AD
from fluxzero.model import build_model
from fluxzero.model import lora as L
from fluxzero.model import lora_formats as F
from fluxzero.model.lora_keys import LoraError
from tests.model.test_lora_conformance import nunchaku_read
from tests.model.test_model import make_inputs
from tests.model.test_model_parity import pair, rel_err, run_theirs

pytest.importorskip("peft")

RTOL = 1e-5
TYPES = {  # name: LoraConfig; decompose_both with factor 4: both factors low-rank, w1 4 x 4 in a 64-wide linear
    "dora": LoraConfig(rank=4, alpha=6, type="dora", targets="all-linear"),
    "lokr": LoraConfig(rank=4, alpha=8, type="lokr", targets="all-linear"),
    "lokr_both": LoraConfig(rank=1, alpha=3, type="lokr", factor=4, decompose_both=True, targets="attention"),
}


def adapted(lcfg, seed=0):
    """(config, our Flux with trained-looking adapters, diffusers twin of the base, base state dict)."""
    cfg, ours, theirs = pair("flux-tiny", seed)
    base = {k: v.clone() for k, v in ours.state_dict().items()}
    L.apply_lora(ours, lcfg)
    g = torch.Generator().manual_seed(seed + 100)
    # a LoKr's change is a product of two (or four) factors: smaller steps on each give a change of the same size
    step = 0.05 if lcfg.type == "lokr" and not lcfg.decompose_both else 0.3
    with torch.no_grad():  # move every adapter off its start (B = 0 / w1 = 0), a DoRA's magnitude by a few %,
        for n, p in ours.named_parameters():  # to changes of the size training makes (a few % to tens of % of W)
            if p.requires_grad and not (lcfg.type == "lora" and ".lora_A." in n):  # a LoRA's A is drawn already
                noise = torch.randn(p.shape, generator=g)
                p.copy_(p * (1 + 0.05 * noise) if "magnitude" in n else p + step * noise)
    return cfg, ours.eval(), theirs, base


def _x(cfg):
    return make_inputs(cfg, batch=2, h=3, w=4, txt_len=5, seed=7)


def _merged(cfg, base, deltas):
    model = build_model(cfg)
    model.load_state_dict(AD.merge_deltas(base, deltas))
    return model.eval()


# ---------------------------------------------------------------------------------------------------- config
def test_config_types_and_their_checks():
    assert LoraConfig(rank=4).type == "lora"
    bad = {"type": "loha", "factor": 0, "decompose_both": "yes"}
    for key, value in bad.items():
        with pytest.raises(ValueError, match=f"lora.{key} must be"):
            LoraConfig(rank=4, type="lokr", **{key: value}) if key != "type" else LoraConfig(rank=4, type=value)
    with pytest.raises(ValueError, match="lora.factor and lora.decompose_both shape a LoKr; set lora.type: lokr"):
        LoraConfig(rank=4, factor=4)
    with pytest.raises(ValueError, match="a LoKr .* has no lora.dropout or lora.init"):
        LoraConfig(rank=4, type="lokr", dropout=0.1)
    with pytest.raises(ValueError, match="under a plain LoRA only"):
        LoraConfig(rank=4, type="dora", base_quant="int8")
    with pytest.raises(ValueError, match="lora.weights continues a plain LoRA file"):
        LoraConfig(rank=4, type="dora", weights="x.safetensors")


def test_lokr_factor_past_a_targeted_dimension_is_refused():
    # PEFT would fall back to its automatic split on such a layer, so the factor would not mean what it says
    tiny = get_model_config("flux-tiny")
    LoraConfig(rank=4, type="lokr", factor=64, targets="attention").check_model(tiny)
    with pytest.raises(
        ValueError,
        match=r"^lora.factor 65 is larger than the smallest dimension 64 of a targeted layer "
        r"\(double_blocks.0.img_attn.qkv of flux-tiny\); set lora.factor from 1 to 64, or -1 \(automatic\)$",
    ):
        LoraConfig(rank=4, type="lokr", factor=65, targets="attention").check_model(tiny)
    with pytest.raises(ValueError, match=r"smallest dimension 32 of a targeted layer \(vector_in.in_layer of"):
        LoraConfig(rank=4, type="lokr", factor=48, targets=["img_in", "vector_in.in_layer"]).check_model(tiny)


@pytest.mark.parametrize("name", TYPES)
def test_param_count_is_what_peft_makes(name):
    lcfg = TYPES[name]
    model = build_model("flux-tiny", device="meta")
    L.apply_lora(model, lcfg)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trained == lora_param_count(get_model_config("flux-tiny"), lcfg)
    spec = memory.RunSpec(
        get_model_config("flux-tiny"),
        lora_rank=lcfg.rank,
        lora_targets=lcfg.targets,
        lora_type=lcfg.type,
        lora_factor=lcfg.factor,
        lora_decompose_both=lcfg.decompose_both,
    )
    assert memory.trained_params(spec) == trained  # what estimate and gen-config --fit count
    sd_keys = {k for k, p in model.named_parameters() if p.requires_grad}
    assert all("lokr_" in k for k in sd_keys) == name.startswith("lokr")


# ---------------------------------------------------------------------------------------------------- files
def comfy_replay(path, base):
    """The base with the LyCORIS file applied as ComfyUI's weight adapters apply it (comfy/weight_adapter/lokr.py:
    kron(w1, w2) x alpha / dim, dim the rank of the decomposed factor, 1 for two whole factors; lora.py's
    up @ down x alpha / rank), and a DoRA's dora_scale (out, 1) as LyCORIS' wd_on_out: m (W + dW) / ||W + dW||
    per row. Written from those sources, not from fluxzero.model.adapters."""
    lora, sd = load_file(str(path)), {k: v.clone() for k, v in base.items()}
    bases = {k.rsplit(".", 2 if k.endswith(".weight") else 1)[0] for k in lora}
    for b in bases:
        module = F.kohya_module(b)
        w = sd[f"{module}.weight"]
        alpha = lora.get(f"{b}.alpha")
        if f"{b}.lora_down.weight" in lora:
            down, up = lora[f"{b}.lora_down.weight"], lora[f"{b}.lora_up.weight"]
            diff = up @ down * (alpha.item() / down.shape[0] if alpha is not None else 1.0)
        else:
            w1 = lora.get(f"{b}.lokr_w1")
            w2 = lora.get(f"{b}.lokr_w2")
            dim = None
            if w1 is None:
                w1, dim = lora[f"{b}.lokr_w1_a"] @ lora[f"{b}.lokr_w1_b"], lora[f"{b}.lokr_w1_b"].shape[0]
            if w2 is None:
                w2, dim = lora[f"{b}.lokr_w2_a"] @ lora[f"{b}.lokr_w2_b"], lora[f"{b}.lokr_w2_b"].shape[0]
            diff = torch.kron(w1, w2) * (alpha.item() / dim if alpha is not None and dim is not None else 1.0)
        if f"{b}.dora_scale" in lora:
            calc = w + diff
            sd[f"{module}.weight"] = calc * (lora[f"{b}.dora_scale"] / calc.norm(dim=1, keepdim=True))
        else:
            sd[f"{module}.weight"] = w + diff
    return sd


@pytest.mark.parametrize("name", TYPES)
def test_native_file_gives_the_trained_model(tmp_path, name):
    lcfg = TYPES[name]
    cfg, ours, _, base = adapted(lcfg)
    x = _x(cfg)
    with torch.no_grad():
        want = ours(**x)
        plain = build_model(cfg)
        plain.load_state_dict(base)
        assert rel_err(plain.eval()(**x), want) > 0.03  # the adapters move the output far beyond the tolerance
    path = tmp_path / "native.safetensors"
    AD.save_lycoris(path, L.lora_state_dict(ours), lcfg, base_model="flux-tiny")
    replayed = build_model(cfg)
    replayed.load_state_dict(comfy_replay(path, base))
    parts, meta = AD.read_adapters(path)  # and our own reader of the file, which convert uses
    ours_read = _merged(cfg, base, AD.module_deltas(parts, base))
    from fluxzero.commands.sample import _apply_adapters

    sampled = build_model(cfg)  # `fluxzero sample --lora` merges the file into the weights it samples with
    sampled.load_state_dict(base)
    sampled, record = _apply_adapters(sampled, path)
    with torch.no_grad():
        assert rel_err(replayed.eval()(**x), want) <= RTOL
        assert rel_err(ours_read(**x), want) <= RTOL
        assert rel_err(sampled.eval()(**x), want) <= RTOL and record["layout"] == "lycoris"
    assert meta["fluxzero.type"] == lcfg.type and meta["fluxzero.format"] == "lycoris"
    with pytest.raises(LoraError, match="not a plain LoRA; `fluxzero convert .* --as-lora-rank R` writes it as one"):
        F.read_lora(path)  # a LoRA reader would drop the DoRA's magnitude (diffusers does) or the LoKr entirely


@pytest.mark.parametrize("name", ["dora", "lokr", "lora"])
def test_plain_lora_through_nunchakus_read_path(tmp_path, name):
    # the adapters' plain LoRA in the diffusers layout, read from its tensors alone as Nunchaku reads it, against
    # the model with the native adapters: at the full rank of flux-tiny's linears (64) exact up to fp32 order;
    # at rank 8 within the error the export reports
    lcfg = TYPES.get(name, LoraConfig(rank=12, alpha=6, targets="all-linear"))
    cfg, ours, theirs, base = adapted(lcfg, seed=1)
    x = _x(cfg)
    with torch.no_grad():
        want = ours(**x)
    deltas = AD.module_deltas(AD.trained_parts(L.lora_state_dict(ours), lcfg), base)
    for rank in (64, 8):
        plain = AD.as_plain_lora(deltas, rank)
        path = tmp_path / f"plain{rank}.safetensors"
        F.save_lora(path, plain.state_dict, plain.config, layout="diffusers")
        with torch.no_grad():
            got = run_theirs(nunchaku_read(path, copy.deepcopy(theirs)), x)
        if rank == 64:
            assert plain.overall < 1e-6 and rel_err(got, want) <= RTOL, (plain.overall, rel_err(got, want))
        else:
            assert plain.overall > 1e-3 and rel_err(got, want) <= plain.overall, (plain.overall, rel_err(got, want))
            worst = max(plain.errors.values())
            with pytest.raises(LoraError, match=f"above --max-error {worst / 2:g}"):
                AD.check_error(plain, worst / 2)
            AD.check_error(plain, worst)


# ---------------------------------------------------------------------------------------------------- convert
def _lokr_part(out_f, in_f, g, rank=2):
    """A LyCORIS LoKr on one (out_f, in_f) linear: whole w1 (4 x 4), w2 = w2_a @ w2_b of `rank`, alpha."""
    return {
        "lokr_w1": torch.randn(4, 4, generator=g),
        "lokr_w2_a": torch.randn(out_f // 4, rank, generator=g) * 0.1,
        "lokr_w2_b": torch.randn(rank, in_f // 4, generator=g) * 0.1,
        "alpha": torch.tensor(3.0),
    }


def _dora_part(w, g, rank=2, axis=0):
    """A DoRA on weight w: lora_down / lora_up / alpha and dora_scale per row (axis 0) or per column (axis 1)."""
    down, up = torch.randn(rank, w.shape[1], generator=g) * 0.1, torch.randn(w.shape[0], rank, generator=g) * 0.1
    calc = w + up @ down * 2.0 / rank
    norm = calc.norm(dim=1 - axis, keepdim=True)
    return {
        "lora_down.weight": down,
        "lora_up.weight": up,
        "alpha": torch.tensor(2.0),
        "dora_scale": norm * (1 + 0.05 * torch.randn(norm.shape, generator=g)),
    }


def _replay_diffusers(theirs, file_parts):
    """The diffusers model with each adapter applied to its own (diffusers-named) weight, per its definition."""
    model = copy.deepcopy(theirs)
    with torch.no_grad():
        for name, t in file_parts.items():
            w = model.get_submodule(name).weight
            if "lokr_w1" in t:
                d = torch.kron(t["lokr_w1"], t["lokr_w2_a"] @ t["lokr_w2_b"]) * t["alpha"] / t["lokr_w2_b"].shape[0]
                w += d
            else:
                calc = w + t["lora_up.weight"] @ t["lora_down.weight"] * t["alpha"] / t["lora_down.weight"].shape[0]
                axis = 0 if t["dora_scale"].shape[0] == w.shape[0] else 1
                w.copy_(calc * t["dora_scale"] / calc.norm(dim=1 - axis, keepdim=True))
    return model


# file layouts of other trainers: (prefix, diffusers names dotted or underscored)
LAYOUTS = {
    "simpletuner": ("lycoris_", "_"),
    "onetrainer": ("lora_transformer_", "_"),
    "ai-toolkit": ("transformer.", "."),
}


def test_convert_other_trainers_files_to_a_plain_lora(tmp_path):
    # LoKrs on parts of fused linears (to_q, to_k of one block, proj_mlp of a single block) and DoRAs (per row and
    # per column), in each trainer's layout: the plain LoRA, read as Nunchaku reads it, gives the model with the
    # adapters applied to diffusers' own weights
    from fluxzero.model.weights import save_weights

    cfg, ours, theirs = pair("flux-tiny", seed=2)
    base = tmp_path / "base.safetensors"
    save_weights(ours.state_dict(), base)
    g = torch.Generator().manual_seed(5)
    weight = lambda n: theirs.get_submodule(n).weight.detach()  # noqa: E731
    parts = {
        n: _lokr_part(*weight(n).shape, g)
        for n in (
            "transformer_blocks.0.attn.to_q",
            "transformer_blocks.0.attn.to_k",
            "single_transformer_blocks.0.proj_mlp",
        )
    }
    parts["transformer_blocks.1.ff.net.0.proj"] = _dora_part(weight("transformer_blocks.1.ff.net.0.proj"), g)
    parts["single_transformer_blocks.1.proj_out"] = _dora_part(
        weight("single_transformer_blocks.1.proj_out"), g, axis=1
    )
    x = _x(cfg)
    with torch.no_grad():
        want = run_theirs(_replay_diffusers(theirs, parts), x)
    for trainer, (prefix, sep) in LAYOUTS.items():
        src, out = tmp_path / f"{trainer}.safetensors", tmp_path / f"{trainer}_plain.safetensors"
        save_file(
            {f"{prefix}{n.replace('.', sep)}.{k}": v.contiguous() for n, t in parts.items() for k, v in t.items()},
            str(src),
        )
        r = CliRunner().invoke(
            cli, ["convert", str(src), str(out), "--to", "diffusers", "--as-lora-rank", "64", "--base", str(base)]
        )
        assert r.exit_code == 0, (trainer, r.output)
        assert "overall" in r.output and "plain LoRA of rank 64" in r.output
        with torch.no_grad():
            got = run_theirs(nunchaku_read(out, copy.deepcopy(theirs)), x)
        assert rel_err(got, want) <= RTOL, (trainer, rel_err(got, want))


def test_bad_adapter_input_through_convert(tmp_path):
    g = torch.Generator().manual_seed(0)
    lokr = {f"lora_unet_double_blocks_0_img_attn_qkv.{k}": v for k, v in _lokr_part(192, 64, g).items()}
    dora = {f"lora_unet_double_blocks_0_img_attn_proj.{k}": v for k, v in _dora_part(torch.randn(64, 64), g).items()}
    files = {
        "lokr": lokr,
        "dora": dora,
        "odd": {**lokr, "lora_unet_double_blocks_0_img_attn_qkv.lokr_t9": torch.ones(2)},
        "nan": {k: v * float("nan") if k.endswith("lokr_w1") else v for k, v in lokr.items()},
    }
    for name, t in files.items():
        save_file(t, str(tmp_path / f"{name}.safetensors"))
    runner = CliRunner()

    def convert(name, *args):
        out = tmp_path / f"out_{name}.safetensors"
        r = runner.invoke(cli, ["convert", str(tmp_path / f"{name}.safetensors"), str(out), "--to", "kohya", *args])
        return r, out

    cases = {  # (file, args): the start of the one error sentence
        ("lokr", ()): "is a LoKr or DoRA, which plain-LoRA loaders (Nunchaku, diffusers) cannot apply; pass "
        "--as-lora-rank R",
        ("odd", ("--as-lora-rank", "4")): "tensor lora_unet_double_blocks_0_img_attn_qkv.lokr_t9 is not a LoKr, "
        "DoRA or LoRA tensor",
        ("nan", ("--as-lora-rank", "4")): "lora_unet_double_blocks_0_img_attn_qkv.lokr_w1 holds NaN or infinite",
        ("lokr", ("--as-lora-rank", "65")): "rank 65 is larger than layer double_blocks.0.img_attn.qkv (192 x 64)",
        ("lokr", ("--as-lora-rank", "1", "--max-error", "1e-6")): "the rank-1 LoRA is off by",
        ("dora", ("--as-lora-rank", "4")): "the DoRA on double_blocks.0.img_attn.proj rescales the base weight, so its "
        "change needs the base weights; pass the base model's weights file (--base)",
        ("lokr", ("--max-error", "0.1")): "--max-error bounds the error of --as-lora-rank",
    }
    for (name, args), words in cases.items():
        r, out = convert(name, *args)
        lines = [line for line in r.output.splitlines() if line.startswith("Error: ") or line.startswith("Error:")]
        assert r.exit_code == 2 and words in " ".join(r.output.split()), (name, args, r.output)
        assert lines and not out.exists(), (name, args, r.output)  # one error, nothing written
    r, out = convert("lokr", "--as-lora-rank", "16")  # the LoKr's change has rank 4 x 2: rank 16 is exact
    assert r.exit_code == 0 and out.exists(), r.output
    assert "0.000e+00  double_blocks.0.img_attn.qkv" in r.output or "e-0" in r.output
    sd, info = F.read_lora(out)
    assert info.rank == 16 and set(sd) == {
        "double_blocks.0.img_attn.qkv.lora_A.weight",
        "double_blocks.0.img_attn.qkv.lora_B.weight",
    }
