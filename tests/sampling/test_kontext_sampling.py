"""FLUX.1 Kontext sampling against diffusers' FluxKontextPipeline on the same tiny weights (tolerances as
tests/sampling/test_sampling.py's: latents rel 1e-5, images within one level on nearly every pixel), and
`fluxzero sample --reference`."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from fluxzero.cli import main
from fluxzero.model import weights as W
from fluxzero.model.packing import pack
from fluxzero.sampling import sample
from fluxzero.sampling.images import read_png_params
from fluxzero.sampling.vae import decode, encode_reference
from tests.model.test_model_parity import pair
from tests.sampling.test_sampling import RTOL, STEPS, W_PX, H, rel_err, scheduler, tiny_vae

diffusers = pytest.importorskip("diffusers")
from diffusers import FluxKontextPipeline  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    cfg, ours, theirs = pair("flux-tiny-kontext", seed=7)
    vae = tiny_vae()
    pipe = FluxKontextPipeline(
        scheduler=scheduler(True),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=theirs,
    )
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(1)
    emb = dict(
        txt=torch.randn(2, 7, cfg.context_in_dim, generator=g),
        y=torch.randn(2, cfg.vec_in_dim, generator=g),
        ref=torch.randn(1, 16, H // 8, W_PX // 8, generator=g),
    )
    return cfg, ours, pipe, vae, emb


def run_pipe(pipe, emb, output_type="latent", ref=None):
    # a 16-channel tensor is taken as the reference's latents as they are (no resize, no VAE); max_area: the
    # pipeline rescales the output to this area (1024^2 by default), here the size asked for
    return pipe(
        max_area=H * W_PX,
        image=(emb["ref"] if ref is None else ref).expand(2, -1, -1, -1),
        prompt_embeds=emb["txt"],
        pooled_prompt_embeds=emb["y"],
        height=H,
        width=W_PX,
        num_inference_steps=STEPS,
        guidance_scale=2.5,
        generator=[torch.Generator().manual_seed(s) for s in (3, 5)],
        output_type=output_type,
        return_dict=False,
    )[0]


def run_ours(model, emb, ref=None):
    return sample(
        model,
        emb["txt"],
        emb["y"],
        height=H,
        width=W_PX,
        steps=STEPS,
        guidance=2.5,
        seed=[3, 5],
        reference=emb["ref"] if ref is None else ref,
    )


def test_latents_and_images_match_flux_kontext_pipeline(setup):
    cfg, ours, pipe, vae, emb = setup
    theirs, mine = run_pipe(pipe, emb), run_ours(ours, emb)
    assert rel_err(pack(mine), theirs) <= RTOL, rel_err(pack(mine), theirs)
    other = torch.randn(1, 16, 4, 6, generator=torch.Generator().manual_seed(9))  # a reference of another size
    assert rel_err(pack(run_ours(ours, emb, other)), run_pipe(pipe, emb, ref=other)) <= RTOL
    assert rel_err(pack(run_ours(ours, emb, other)), theirs) > 1e-2  # the reference steers the result
    theirs_px = torch.from_numpy((run_pipe(pipe, emb, output_type="np") * 255).round().astype("uint8"))
    mine_px = decode(vae, mine)
    diff = (mine_px.int() - theirs_px.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01
    assert mine_px.float().std() > 5


def test_reference_errors(setup):
    cfg, ours, _, _, emb = setup
    with pytest.raises(ValueError, match="reference must be latents"):
        run_ours(ours, emb, ref=torch.zeros(1, 16, 5, 6))
    _, plain, _ = pair("flux-tiny")
    with pytest.raises(ValueError, match="not FLUX.1 Kontext"):
        run_ours(plain, emb)


def test_sample_command_edits_a_reference_image(tmp_path):
    import numpy as np
    from PIL import Image

    from fluxzero.data.tiny_encoders import write_tiny_encoders
    from fluxzero.sampling.vae import load_vae

    flux = write_tiny_encoders(tmp_path / "flux")
    cfg, ours, _ = pair("flux-tiny-kontext", seed=2)
    weights = tmp_path / "kontext.safetensors"
    W.save_weights(ours.state_dict(), weights, cfg=cfg, layout="bfl")
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 60, 3), dtype=np.uint8)).save(tmp_path / "ref.png")
    args = [
        "--flux-dir",
        flux,
        "--prompt",
        "a red cat",
        "--height",
        "32",
        "--width",
        "48",
        "--steps",
        "2",
        "--t5-max-length",
        "8",
        "--device",
        "cpu",
        "--no-grid",
    ]
    run = lambda *a: CliRunner().invoke(main, ["sample", *map(str, a)], catch_exceptions=False)  # noqa: E731
    r = run(weights, "--out", tmp_path / "edit", "--reference", tmp_path / "ref.png", *args)
    assert r.exit_code == 0, r.output
    png = tmp_path / "edit" / "0000-p0-s0.png"
    assert read_png_params(png)["reference"] == str((tmp_path / "ref.png").resolve())
    assert read_png_params(png)["model"] == "flux-tiny-kontext"
    # the same reference as latents gives the same image
    z = encode_reference(load_vae(flux / "vae"), tmp_path / "ref.png", height=32, width=48)
    assert z.shape == (1, 16, 4, 6)
    from safetensors.torch import save_file

    save_file({"latents": z[0].contiguous()}, tmp_path / "ref.safetensors")
    r = run(weights, "--out", tmp_path / "lat", "--reference", tmp_path / "ref.safetensors", *args)
    assert r.exit_code == 0, r.output
    same = [np.asarray(Image.open(p)).astype(int) for p in (png, tmp_path / "lat" / "0000-p0-s0.png")]
    assert np.abs(same[0] - same[1]).max() <= 1
    # bad input: one sentence, exit 2
    (tmp_path / "bad.png").write_bytes(b"not an image")
    r = run(weights, "--out", tmp_path / "bad", "--reference", tmp_path / "bad.png", *args)
    assert r.exit_code == 2 and "reference image" in r.output and "cannot be read" in r.output, r.output
    r = run(weights, "--out", tmp_path / "bad", "--reference", tmp_path / "ref.png", "--model", "flux-tiny", *args)
    assert r.exit_code == 2 and "--reference needs a FLUX.1 Kontext model" in r.output, r.output
