"""Conformance: every LoRA layout fluxzero writes, read the way each tool that loads it reads it, must give our
trained model (the base with W + (alpha / rank) B A merged in), at alpha != rank, on every target preset, at ranks
that are not multiples of 16.

The read paths replayed:
  diffusers  FluxPipeline.load_lora_weights itself (diffusers 0.42.1, a pipeline holding only the transformer):
             lora_state_dict, then load_lora_adapter with the file's `lora_adapter_metadata` and its `.alpha`
             tensors as network_alphas (it refuses a file that has both).
  tensors    what Nunchaku does, from the tensors alone (the header is never read): nunchaku-tech/nunchaku
             (3a3cc3d) nunchaku/lora/flux/diffusers_converter.py `to_diffusers` loads the file's tensors, calls
             FluxLoraLoaderMixin.lora_state_dict(tensors, return_alphas=True) and
             convert_unet_state_dict_to_peft, and multiplies each lora_A by alpha / rank of its `.alpha`
             tensor; nunchaku_converter.py then zero-pads every rank to a multiple of 16
             (utils.pad(lora_A, divisor=16, dim=0), pad(lora_B, divisor=16, dim=1)) and applies B A at strength 1.
             Replayed below with diffusers' real functions (nunchaku needs its CUDA kernels to install).
  ComfyUI    comfyanonymous/ComfyUI comfy/lora.py `model_lora_keys_unet`: a kohya key is "lora_unet_" + the name of
             a weight of comfy.ldm.flux.model.Flux, dots as underscores; comfy/weight_adapter/lora.py patches
             W += (alpha / rank) up @ down with rank = lora_down's rows (1 x up @ down without an `.alpha`).
             ComfyUI's FLUX module names are written out here from comfy/ldm/flux/model.py and layers.py, not
             taken from our model, so a renamed module of ours fails the key check.

diffusers' kohya converter splits single_blocks.N.linear1 with FLUX.1's widths written in (3 x 3072 + 12288 rows),
so on flux-tiny the kohya file read through diffusers (and through Nunchaku, which calls the same converter) leaves
linear1 out; test_lora.py checks linear1 through that converter at full width on the tensors alone.

FLUX.1 Kontext LoRAs (flux-tiny-kontext, inputs with reference tokens) are read the same ways, through
FluxKontextPipeline.load_lora_weights.

Tolerance RTOL 1e-5, as in test_lora.py: the same fp32 math in another op order (~1e-6 at worst), while a wrong
scale moves the output by far more (the LoRA moves it by > 3 %, asserted).
"""

import copy

import pytest
import torch

from fluxzero.config.lora import LoraConfig
from fluxzero.model import build_model, lora_keys
from fluxzero.model import lora as L
from fluxzero.model import lora_formats as F
from tests.model.test_lora import lora_model
from tests.model.test_model import make_inputs
from tests.model.test_model_parity import rel_err, run_theirs

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

RTOL = 1e-5
NUNCHAKU_RANK_MULTIPLE = 16

# (layout, targets, rank, alpha): every preset in each layout, alpha != rank everywhere (scales 2, 0.4, 1.5, 1/3,
# the last two not powers of two, so folding them into B rounds), no rank a multiple of 16
CASES = [
    ("diffusers", "attention", 4, 8.0),
    ("diffusers", "attention+mlp", 5, 2.0),
    ("diffusers", "all-linear", 6, 9.0),
    ("diffusers", ["*"], 3, 1.0),  # the embedders and the final layer too (its adaLN halves are swapped in diffusers)
    ("kohya", "attention", 4, 8.0),
    ("kohya", "attention+mlp", 5, 2.0),
    ("kohya", "all-linear", 6, 9.0),
]


def comfy_flux_weights(cfg) -> list[str]:
    """The linear weights of ComfyUI's comfy.ldm.flux.model.Flux for this shape, by its module names:
    MLPEmbedder in_layer / out_layer, Modulation lin, SelfAttention qkv / proj, the MLPs as Sequential .0 / .2,
    SingleStreamBlock linear1 / linear2 / modulation, LastLayer linear / adaLN_modulation.1."""
    names = ["img_in", "time_in.in_layer", "time_in.out_layer", "vector_in.in_layer", "vector_in.out_layer"]
    if cfg.guidance_embed:
        names += ["guidance_in.in_layer", "guidance_in.out_layer"]
    names.append("txt_in")
    for i in range(cfg.depth):
        for s in ("img", "txt"):
            names += [f"double_blocks.{i}.{s}_{m}" for m in ("mod.lin", "attn.qkv", "attn.proj", "mlp.0", "mlp.2")]
    for i in range(cfg.depth_single_blocks):
        names += [f"single_blocks.{i}.{m}" for m in ("linear1", "linear2", "modulation.lin")]
    names += ["final_layer.linear", "final_layer.adaLN_modulation.1"]
    return [f"{n}.weight" for n in names]


def comfy_key_map(cfg) -> dict[str, str]:
    """ComfyUI's kohya keys for FLUX: lora_unet_<weight name without .weight, dots as underscores> -> weight."""
    return {"lora_unet_" + w.removesuffix(".weight").replace(".", "_"): w for w in comfy_flux_weights(cfg)}


def diffusers_pipeline_read(path, transformer):
    """FluxPipeline.load_lora_weights on a pipeline that holds only `transformer` (the text encoders are not
    needed to load a transformer LoRA)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer,
    )
    pipe.load_lora_weights(str(path))
    return pipe.transformer


def nunchaku_read(path, transformer):
    """Nunchaku's to_diffusers from the tensors alone, its rank padding, then B A at strength 1 (see the top)."""
    from diffusers.loaders import FluxLoraLoaderMixin
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft
    from safetensors.torch import load_file

    tensors = load_file(str(path))  # tensors only; handle_kohya_lora acts on lora_transformer_* keys, none here
    sd, alphas = FluxLoraLoaderMixin.lora_state_dict(tensors, return_alphas=True)
    sd = convert_unet_state_dict_to_peft(sd)
    for key, alpha in (alphas or {}).items():
        a = key.replace(".alpha", ".lora_A.weight")
        sd[a] = sd[a] * alpha / sd[a].shape[0]
    padded = {}
    for key, t in sd.items():  # zeros: rows of A, columns of B
        dim = 0 if ".lora_A." in key else 1
        extra = -t.shape[dim] % NUNCHAKU_RANK_MULTIPLE
        pad = torch.zeros(*((extra, t.shape[1]) if dim == 0 else (t.shape[0], extra)), dtype=t.dtype)
        padded[key] = torch.cat([t, pad], dim=dim)
    assert all(t.shape[0 if ".lora_A." in k else 1] % NUNCHAKU_RANK_MULTIPLE == 0 for k, t in padded.items())
    transformer.load_lora_adapter(padded, prefix="transformer")  # no alphas, no metadata: scale 1
    return transformer


def comfy_read(path, base_sd, cfg):
    """Our model (ComfyUI's FLUX has its module names) with the kohya file patched in as ComfyUI patches it."""
    from safetensors.torch import load_file

    lora, keys = load_file(str(path)), comfy_key_map(cfg)
    bases = {
        k.removesuffix(s) for k in lora for s in (".lora_up.weight", ".lora_down.weight", ".alpha") if k.endswith(s)
    }
    assert bases and len(lora) == 3 * len(bases)  # nothing but up, down and alpha of each module
    unmapped = sorted(bases - set(keys))
    assert not unmapped, f"keys ComfyUI does not map for FLUX: {unmapped}"
    sd = {k: v.clone() for k, v in base_sd.items()}
    for b in bases:
        up, down = lora[f"{b}.lora_up.weight"].float(), lora[f"{b}.lora_down.weight"].float()
        alpha = lora[f"{b}.alpha"].item() / down.shape[0] if f"{b}.alpha" in lora else 1.0
        sd[keys[b]] += alpha * (up @ down)
    model = build_model(cfg)
    model.load_state_dict(sd)
    return model


def _trained(targets, rank, alpha, seed):
    """(config, diffusers twin of the base, base state dict, canonical LoRA with non-zero B, LoraConfig)."""
    lcfg = LoraConfig(rank=rank, alpha=alpha, targets=targets)
    cfg, ours, theirs = lora_model(lcfg, seed=seed)
    lora_sd = {k: v.clone() for k, v in L.lora_state_dict(ours).items()}
    return cfg, theirs, {k: v.clone() for k, v in L.base_state_dict(ours).items()}, lora_sd, lcfg


def _merged_output(cfg, base_sd, lora_sd, lcfg, x):
    """Our trained model's output: the base with the LoRA merged in (fluxzero export --merge's weights)."""
    model = build_model(cfg)
    model.load_state_dict(F.merge_lora(base_sd, lora_sd, lcfg))
    with torch.no_grad():
        return model(**x)


@pytest.mark.parametrize("layout, targets, rank, alpha", CASES)
def test_every_reader_gets_the_trained_model(tmp_path, layout, targets, rank, alpha):
    cfg, theirs, base_sd, lora_sd, lcfg = _trained(targets, rank, alpha, seed=rank)
    x = make_inputs(cfg, batch=2, h=3, w=4, txt_len=5, seed=7)
    want = _merged_output(cfg, base_sd, lora_sd, lcfg, x)
    base = build_model(cfg)
    base.load_state_dict(base_sd)
    with torch.no_grad():
        assert rel_err(base(**x), want) > 0.03  # the LoRA moves the output far beyond the tolerance
    path = tmp_path / f"{layout}.safetensors"
    F.save_lora(path, lora_sd, lcfg, layout=layout, base_model="flux-tiny")

    results = {}
    if layout == "kohya":
        with torch.no_grad():
            results["comfyui"] = (comfy_read(path, base_sd, cfg)(**x), want)
        # diffusers' converter and Nunchaku's (the same converter) on flux-tiny: linear1 left out (see the top)
        lora_sd = {k: v for k, v in lora_sd.items() if ".linear1." not in k}
        want = _merged_output(cfg, base_sd, lora_sd, lcfg, x)
        path = tmp_path / "kohya_no_linear1.safetensors"
        F.save_lora(path, lora_sd, lcfg, layout=layout, base_model="flux-tiny")
    else:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            assert not any(k.endswith(".alpha") for k in f.keys())  # with the header entry diffusers would refuse
    for name, read in (("diffusers", diffusers_pipeline_read), ("tensors", nunchaku_read)):
        model = read(path, copy.deepcopy(theirs))
        with torch.no_grad():
            results[name] = (run_theirs(model, x), want)
    errors = {name: rel_err(got, ref) for name, (got, ref) in results.items()}
    assert all(e <= RTOL for e in errors.values()), errors


def test_comfy_key_map_is_every_linear_of_our_flux():
    # every module a LoRA can target has a ComfyUI key (and our kohya names are exactly those): a module renamed
    # on either side fails here before any file is written
    for name in ("flux-tiny", "flux-tiny-schnell", "flux-dev"):
        model = build_model(name, device="meta")
        ours = [f"{n}.weight" for n in lora_keys._linear_names(model)]
        assert sorted(ours) == sorted(comfy_flux_weights(model.config)), name


def kontext_pipeline_read(path, transformer):
    """FluxKontextPipeline.load_lora_weights (the same FluxLoraLoaderMixin as FluxPipeline's) on a pipeline
    holding only `transformer`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline

    pipe = FluxKontextPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer,
    )
    pipe.load_lora_weights(str(path))
    return pipe.transformer


@pytest.mark.parametrize("layout", ["diffusers", "kohya"])
def test_a_kontext_lora_loads_in_every_reader(tmp_path, layout):
    """A FLUX.1 Kontext LoRA (flux-tiny-kontext), on inputs that hold reference tokens after the target's, read by
    FluxKontextPipeline.load_lora_weights, Nunchaku's tensors-only path and ComfyUI's key map."""
    from fluxzero.model.packing import img_ids, pack, with_reference

    lcfg = LoraConfig(rank=5, alpha=2.0, targets="attention+mlp")
    cfg, ours, theirs = lora_model(lcfg, name="flux-tiny-kontext", seed=5)
    assert cfg.kontext
    lora_sd = {k: v.clone() for k, v in L.lora_state_dict(ours).items()}
    base_sd = {k: v.clone() for k, v in L.base_state_dict(ours).items()}
    x = make_inputs(cfg, batch=2, h=2, w=4, txt_len=5, seed=8)
    ref = torch.randn(2, 16, 4, 8, generator=torch.Generator().manual_seed(9))
    x["img"], x["img_ids"] = with_reference(x["img"], img_ids(2, 4, 8), ref)
    assert x["img"].shape[1] == 16 and torch.equal(x["img"][:, 8:], pack(ref))
    want = _merged_output(cfg, base_sd, lora_sd, lcfg, x)
    path = tmp_path / f"kontext-{layout}.safetensors"
    results = {}
    if layout == "kohya":
        F.save_lora(path, lora_sd, lcfg, layout=layout, base_model=cfg.name)
        with torch.no_grad():
            results["comfyui"] = (comfy_read(path, base_sd, cfg)(**x), want)
        assert F.read_lora(path)[1].base_model == "flux-tiny-kontext"
    else:
        F.save_lora(path, lora_sd, lcfg, layout=layout, base_model=cfg.name)
        for name, read in (("kontext pipeline", kontext_pipeline_read), ("tensors", nunchaku_read)):
            model = read(path, copy.deepcopy(theirs))
            with torch.no_grad():
                results[name] = (run_theirs(model, x), want)
    errors = {name: rel_err(got, ref) for name, (got, ref) in results.items()}
    assert errors and all(e <= RTOL for e in errors.values()), errors
