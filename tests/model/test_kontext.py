"""FLUX.1 Kontext's model input: reference tokens after the target's with FluxKontextPipeline's ids, the forward
against diffusers' FluxTransformer2DModel fed the same tokens, the flow's loss over the target's tokens only, the
presets and the Kontext checkpoints in every layout. Tolerances as tests/model/test_model_parity.py's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from fluxzero.config import FlowConfig, get_model_config
from fluxzero.model.packing import img_ids, pack, reference_ids, with_reference
from fluxzero.train import flow
from tests.model.test_model_parity import RTOL, pair, rel_err, run_theirs

diffusers = pytest.importorskip("diffusers")
from diffusers import FluxKontextPipeline  # noqa: E402


def _pipeline_latents(noise, reference):
    """FluxKontextPipeline.prepare_latents on latents given as they are: (latents, image_latents, ids, image_ids)."""
    fake = SimpleNamespace(
        vae_scale_factor=8,
        latent_channels=16,
        _prepare_latent_image_ids=FluxKontextPipeline._prepare_latent_image_ids,
        _pack_latents=FluxKontextPipeline._pack_latents,
    )
    b, _, h, w = noise.shape
    return FluxKontextPipeline.prepare_latents(
        fake, reference, b, 16, h * 8, w * 8, torch.float32, torch.device("cpu"), None, pack(noise)
    )


@pytest.mark.parametrize("ref_hw", [(6, 10), (4, 8)])  # the reference at its target's size, or at another
def test_reference_tokens_and_ids_are_the_kontext_pipelines(ref_hw):
    g = torch.Generator().manual_seed(0)
    noise, ref = torch.randn(2, 16, 6, 10, generator=g), torch.randn(2, 16, *ref_hw, generator=g)
    latents, image_latents, ids, image_ids = _pipeline_latents(noise, ref)
    img, our_ids = with_reference(pack(noise), img_ids(2, 6, 10), ref)
    assert torch.equal(img, torch.cat([latents, image_latents], dim=1))
    assert torch.equal(our_ids[0], torch.cat([ids, image_ids]))  # diffusers keeps one (L, 3) for the batch
    assert torch.equal(our_ids[1], our_ids[0])
    assert (reference_ids(1, *ref_hw)[..., 0] == 1).all() and (our_ids[0, :15, 0] == 0).all()


def test_forward_with_reference_tokens_matches_diffusers():
    cfg, ours, theirs = pair("flux-tiny-kontext", seed=3)
    g = torch.Generator().manual_seed(4)
    x0, ref = torch.randn(2, 16, 4, 6, generator=g), torch.randn(2, 16, 4, 6, generator=g)
    img, ids = with_reference(pack(x0), img_ids(2, 4, 6), ref)
    x = dict(
        img=img,
        img_ids=ids,
        txt=torch.randn(2, 5, cfg.context_in_dim, generator=g),
        txt_ids=torch.zeros(2, 5, 3),
        timesteps=torch.rand(2, generator=g),
        y=torch.randn(2, cfg.vec_in_dim, generator=g),
        guidance=torch.full((2,), 3.5),
    )
    with torch.no_grad():
        a, b = ours(**x), run_theirs(theirs, x)
        plain = ours(**{**x, "img": x["img"][:, :6], "img_ids": x["img_ids"][:, :6]})
    assert a.shape == b.shape == (2, 12, cfg.out_channels)  # 6 target tokens, then 6 reference tokens
    assert rel_err(a, b) <= RTOL, rel_err(a, b)
    assert rel_err(a[:, :6], plain) > 1e-2  # the reference tokens change the target's prediction


def test_prepare_batch_appends_the_reference_and_the_loss_covers_the_target_only():
    cfg = FlowConfig()
    g = torch.Generator().manual_seed(5)
    batch = {
        "latents": torch.randn(2, 16, 4, 6, generator=g),
        "t5": torch.randn(2, 5, 64, generator=g),
        "clip": torch.randn(2, 32, generator=g),
        "index": torch.tensor([3, 7]),
    }
    plain, tgt = flow.prepare_batch(batch, cfg, seed=0, epoch=0, guidance_embed=True)
    ref = torch.randn(2, 16, 4, 6, generator=g)
    inputs, tgt_k = flow.prepare_batch({**batch, "reference": ref}, cfg, seed=0, epoch=0, guidance_embed=True)
    assert torch.equal(tgt_k, tgt) and tgt.shape == (2, 6, 64)  # the target is the target's alone
    assert torch.equal(inputs["img"][:, :6], plain["img"])  # the same noisy target, then the clean reference
    assert torch.equal(inputs["img"][:, 6:], pack(ref))
    assert torch.equal(inputs["img_ids"][:, 6:], reference_ids(2, 4, 6))
    # the loss ignores whatever the model says at the reference tokens, and their gradient is zero
    pred = torch.cat([tgt + 0.5, torch.randn(2, 6, 64, generator=g)], dim=1).requires_grad_()
    loss = flow.loss(pred, tgt)
    assert loss.item() == pytest.approx(0.25)
    loss.backward()
    assert pred.grad[:, 6:].abs().max() == 0 and pred.grad[:, :6].abs().min() > 0
    assert torch.allclose(flow.sample_losses(pred.detach(), tgt), torch.full((2,), 0.25))


def test_kontext_presets_and_specs():
    from fluxzero.config.models import resolve_model

    k, dev = get_model_config("flux-kontext-dev"), get_model_config("flux-dev")
    assert k.kontext and not dev.kontext and k.replace(name="flux-dev", kontext=False) == dev
    assert k.num_params() == dev.num_params()
    tiny = get_model_config("flux-tiny-kontext")
    assert tiny.kontext and tiny.same_shape(get_model_config("flux-tiny").replace(kontext=True))
    assert resolve_model("flux-tiny:kontext=true") == tiny  # a spec naming the flag is the preset
    assert resolve_model({"preset": "flux-dev", "kontext": True}) == k
    with pytest.raises(ValueError, match="kontext must be true or false"):
        resolve_model("flux-tiny:kontext=3")


@pytest.mark.parametrize("layout", ["bfl", "comfyui", "diffusers"])
def test_kontext_checkpoints_load_in_every_layout(tmp_path, layout):
    """Kontext's tensors are FLUX.1-dev's: any layout loads under the Kontext model; the file says it is Kontext
    (fluxzero's metadata, or a diffusers FluxKontextPipeline folder's model_index.json)."""
    from fluxzero.model.weights import load_model, save_weights, source_config

    cfg, ours, _ = pair("flux-tiny-kontext", seed=6)
    if layout == "diffusers":
        path = tmp_path / "pipe"
        save_weights(ours.state_dict(), path, cfg=cfg, layout="diffusers")  # FluxKontextPipeline's folder
        assert source_config(tmp_path / "pipe") == cfg  # the pipeline folder names Kontext
        assert source_config(tmp_path / "pipe" / "transformer") == cfg
        assert get_model_config(str(tmp_path / "pipe")) == cfg
        (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
        assert not source_config(tmp_path / "pipe").kontext
    else:
        path = tmp_path / f"kontext-{layout}.safetensors"
        save_weights(ours.state_dict(), path, cfg=cfg, layout=layout)
        assert source_config(path) == cfg  # recorded in the file's metadata
        plain = tmp_path / f"plain-{layout}.safetensors"  # as BFL ships it: no metadata, --model names Kontext
        save_weights(ours.state_dict(), plain, cfg=get_model_config("flux-tiny"), layout=layout)
        assert not source_config(plain).kontext
        assert load_model(plain, cfg=cfg, dtype=torch.float32).config.kontext
    model = load_model(path, cfg=cfg, dtype=torch.float32)
    for k, v in ours.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_a_kontext_diffusers_export_is_a_flux_kontext_pipeline_folder(tmp_path):
    """diffusers tells FLUX.1 Kontext from the pipeline's model_index.json alone (the transformer's config.json is
    FLUX.1-dev's): the export writes one above transformer/, and DiffusionPipeline.from_pretrained builds a
    FluxKontextPipeline holding the exported transformer (the other components passed, as from the base model)."""
    from diffusers import DiffusionPipeline, FluxTransformer2DModel

    from fluxzero.model.layouts import WeightsError
    from fluxzero.model.weights import save_weights, source_config

    cfg, ours, theirs = pair("flux-tiny-kontext", seed=4)
    out = tmp_path / "export"
    save_weights(ours.state_dict(), out, cfg=cfg, layout="diffusers", dtype=torch.float32)
    assert sorted(p.name for p in out.iterdir()) == ["model_index.json", "transformer"]
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "FluxKontextPipeline"
    others = {name: None for name in ("scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae")}
    pipe = DiffusionPipeline.from_pretrained(out, **others)
    assert type(pipe) is FluxKontextPipeline
    want = theirs.state_dict()
    got = pipe.transformer.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    loaded = FluxTransformer2DModel.from_pretrained(out, subfolder="transformer")
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want)
    assert source_config(out) == cfg  # and fluxzero reads it back as Kontext
    # written again over itself, and a FLUX.1 model's transformer folder over it: the old folder is replaced whole
    save_weights(ours.state_dict(), out, cfg=cfg, layout="diffusers")
    plain = get_model_config("flux-tiny")
    save_weights(ours.state_dict(), out, cfg=plain, layout="diffusers")
    assert not (out / "model_index.json").exists() and not source_config(out).kontext
    (out / "notes.txt").write_text("mine")
    with pytest.raises(WeightsError, match="it holds notes.txt"):
        save_weights(ours.state_dict(), out, cfg=cfg, layout="diffusers")
