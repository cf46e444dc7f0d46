"""Sampling: the time grid, the sampler and the VAE decode against diffusers' FluxPipeline (an independent
implementation of the same conventions), the PNG metadata, and `fluxzero sample` / `encode-prompts`.

Tolerances. The grid is compared bit for bit (the same float32 operations as the scheduler). Latents: both
sides run fp32 on CPU through transformers whose single forward agrees to rel 1e-5 (test_model_parity:
different op orders, ~1e-6 at worst); N Euler steps add N such errors into one state, and timesteps differ
by an ulp (diffusers feeds (sigma * 1000) / 1000). Measured 9e-8 (plain) and 3e-7 (true CFG, which
multiplies the difference of two outputs by 4), so rel 1e-5 keeps a 30x margin while a wrong grid, noise,
guidance or CFG formula moves the result by > 1e-2 (test_parity_check_can_fail). Images: the same latents
give uint8 pixels that differ only where a value sits on a rounding boundary: at most 1 level, on under
1% of the pixels (measured: none).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from fluxzero.cli import main
from fluxzero.config import get_model_config
from fluxzero.model import weights as W
from fluxzero.model.packing import pack
from fluxzero.sampling import initial_noise, sample
from fluxzero.sampling import schedule as S
from fluxzero.sampling.embeddings import PromptEmbeddings, load_embeddings, save_embeddings
from fluxzero.sampling.images import grid, read_png_params, save_png
from fluxzero.sampling.vae import decode
from tests.model.test_model_parity import pair

diffusers = pytest.importorskip("diffusers")
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline  # noqa: E402
from diffusers.pipelines.flux.pipeline_flux import calculate_shift  # noqa: E402

RTOL = 1e-5
H, W_PX, STEPS = 48, 80, 6  # 6 x 10 latent, 15 image tokens: non-square catches a height/width swap


def scheduler(dev: bool):
    # FLUX.1-dev's scheduler_config.json: dynamic (resolution) shift; schnell's: none (shift 1.0)
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0 if dev else 1.0,
        use_dynamic_shifting=dev,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def tiny_vae(seed=0):
    torch.manual_seed(seed)
    return AutoencoderKL(
        latent_channels=16,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    ).eval()


@pytest.fixture(scope="module", params=["flux-tiny", "flux-tiny-schnell"])
def setup(request):
    cfg, ours, theirs = pair(request.param)
    vae = tiny_vae()
    pipe = FluxPipeline(
        scheduler=scheduler(cfg.guidance_embed),
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
        neg_txt=torch.randn(1, 7, cfg.context_in_dim, generator=g),
        neg_y=torch.randn(1, cfg.vec_in_dim, generator=g),
    )
    return cfg, ours, pipe, vae, emb


def run_pipe(pipe, emb, output_type="latent", true_cfg=1.0, **kw):
    if true_cfg > 1:
        kw |= dict(
            negative_prompt_embeds=emb["neg_txt"].expand(2, -1, -1),
            negative_pooled_prompt_embeds=emb["neg_y"].expand(2, -1),
            true_cfg_scale=true_cfg,
        )
    kw.setdefault("generator", [torch.Generator().manual_seed(s) for s in (3, 5)])
    return pipe(
        prompt_embeds=emb["txt"],
        pooled_prompt_embeds=emb["y"],
        height=H,
        width=W_PX,
        num_inference_steps=STEPS,
        guidance_scale=3.5,
        output_type=output_type,
        return_dict=False,
        **kw,
    )[0]


def run_ours(model, emb, true_cfg=1.0, **kw):
    kw.setdefault("seed", [3, 5])
    neg = dict(neg_txt=emb["neg_txt"], neg_y=emb["neg_y"]) if true_cfg > 1 else {}
    return sample(
        model, emb["txt"], emb["y"], height=H, width=W_PX, steps=STEPS, guidance=3.5, true_cfg=true_cfg, **neg, **kw
    )


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


# ------------------------------------------------------------------------------------------ schedule
@pytest.mark.parametrize("steps", [1, 2, 4, 7, 28, 50])
@pytest.mark.parametrize("tokens", [1, 15, 256, 1024, 4096, 8192])
def test_grid_is_diffusers_bit_for_bit(steps, tokens):
    s = scheduler(dev=True)
    mu = calculate_shift(tokens)
    assert S.shift_mu(tokens) == mu
    s.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)  # what FluxPipeline passes
    ours = S.sigmas(steps, tokens)
    assert ours.dtype == torch.float32 and torch.equal(ours, s.sigmas)
    assert torch.equal(S.timesteps(ours), s.timesteps)
    assert ours[0] == 1.0 and ours[-1] == 0.0 and bool((ours[1:] < ours[:-1]).all())


@pytest.mark.parametrize("steps", [1, 4, 28])
def test_unshifted_grid_is_schnells(steps):
    s = scheduler(dev=False)
    s.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=0.5)
    assert torch.equal(S.sigmas(steps, shift=False), s.sigmas)


def test_grid_matches_the_training_shift():
    from fluxzero.train import flow

    t = S.sigmas(20, 1024)[:-1]
    plain = S.sigmas(20, shift=False)[:-1]
    assert torch.allclose(t, flow.time_shift(plain, flow.resolution_mu(1024)), rtol=1e-6)
    assert S.image_tokens(1024, 1024) == 4096 and S.image_tokens(H, W_PX) == 15


# ------------------------------------------------------------------------------------------ noise
def test_noise_is_diffusers_prepare_latents(setup):
    _, _, pipe, _, _ = setup
    gens = [torch.Generator().manual_seed(s) for s in (3, 5)]
    theirs, _ = pipe.prepare_latents(2, 16, H, W_PX, torch.float32, "cpu", gens)
    assert torch.equal(pack(initial_noise(2, H, W_PX, seed=[3, 5])), theirs)
    one, _ = pipe.prepare_latents(2, 16, H, W_PX, torch.float32, "cpu", torch.Generator().manual_seed(7))
    assert torch.equal(pack(initial_noise(2, H, W_PX, seed=7)), one)  # one int seed = one generator for the batch
    # per-image seeds: an image's noise does not depend on its batch
    assert torch.equal(initial_noise(1, H, W_PX, seed=[5]), initial_noise(2, H, W_PX, seed=[3, 5])[1:])
    with pytest.raises(ValueError, match="one per image"):
        initial_noise(2, H, W_PX, seed=[1, 2, 3])


# ------------------------------------------------------------------------------------------ parity
def test_latents_match_flux_pipeline(setup):
    cfg, ours, pipe, _, emb = setup
    theirs = run_pipe(pipe, emb)  # packed (B, HW/256, 64)
    mine = run_ours(ours, emb)
    assert mine.shape == (2, 16, H // 8, W_PX // 8) and mine.dtype == torch.float32
    assert rel_err(pack(mine), theirs) <= RTOL, rel_err(pack(mine), theirs)  # measured ~9e-8
    # given noise instead of seeds: diffusers' latents= takes it packed
    noise = torch.randn(2, 16, H // 8, W_PX // 8, generator=torch.Generator().manual_seed(11))
    theirs = run_pipe(pipe, emb, latents=pack(noise), generator=None)
    assert rel_err(pack(run_ours(ours, emb, noise=noise, seed=None)), theirs) <= RTOL


def test_true_cfg_matches_flux_pipeline(setup):
    cfg, ours, pipe, _, emb = setup
    theirs = run_pipe(pipe, emb, true_cfg=4.0)
    mine = run_ours(ours, emb, true_cfg=4.0)
    assert rel_err(pack(mine), theirs) <= RTOL, rel_err(pack(mine), theirs)  # measured ~3e-7
    assert rel_err(pack(mine), run_pipe(pipe, emb)) > 1e-2  # CFG changed the result
    with pytest.raises(ValueError, match="needs a negative prompt"):
        sample(ours, emb["txt"], emb["y"], height=H, width=W_PX, steps=1, seed=0, true_cfg=2.0)


def test_images_match_flux_pipeline(setup):
    cfg, ours, pipe, vae, emb = setup
    theirs = torch.from_numpy((run_pipe(pipe, emb, output_type="np") * 255).round().astype("uint8"))
    mine = decode(vae, run_ours(ours, emb))
    assert mine.shape == theirs.shape == (2, H, W_PX, 3) and mine.dtype == torch.uint8
    diff = (mine.int() - theirs.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01  # measured: identical
    assert mine.float().std() > 5  # not a flat image


def test_parity_check_can_fail(setup):
    """Each of these mistakes moves the latents far past RTOL: the comparisons above would catch them."""
    cfg, ours, pipe, _, emb = setup
    theirs = run_pipe(pipe, emb)
    assert rel_err(pack(run_ours(ours, emb, seed=[3, 6])), theirs) > 1e-2  # other noise
    assert rel_err(pack(run_ours(ours, emb, shift=not cfg.guidance_embed)), theirs) > 1e-3  # wrong grid
    if cfg.guidance_embed:
        wrong = sample(ours, emb["txt"], emb["y"], height=H, width=W_PX, steps=STEPS, guidance=1.0, seed=[3, 5])
        assert rel_err(pack(wrong), theirs) > 1e-3
    else:  # schnell ignores guidance
        same = sample(ours, emb["txt"], emb["y"], height=H, width=W_PX, steps=STEPS, guidance=1.0, seed=[3, 5])
        assert torch.equal(same, run_ours(ours, emb))


# ------------------------------------------------------------------------------------------ sampler API
def test_sampler_restores_mode_calls_back_and_batches_independently(setup):
    cfg, ours, _, _, emb = setup
    ours.train()
    seen = []
    out = run_ours(ours, emb, callback=lambda i, n, t, x: seen.append((i, n, t, x.shape)))
    assert ours.training and all(p.grad is None for p in ours.parameters())
    ours.eval()
    assert [s[0] for s in seen] == list(range(1, STEPS + 1)) and seen[-1][2] == 0.0
    assert seen[0][3] == (2, 15, 64)
    one = sample(ours, emb["txt"][1:], emb["y"][1:], height=H, width=W_PX, steps=STEPS, guidance=3.5, seed=[5])
    assert rel_err(one, out[1:]) <= RTOL  # batch of 2 vs 1: same image up to matmul blocking


def test_sampler_follows_model_dtype(setup):
    cfg, ours, _, _, emb = setup
    bf = pair(cfg.name)[1].to(torch.bfloat16)
    out = sample(bf, emb["txt"], emb["y"], height=H, width=W_PX, steps=2, seed=[3, 5])
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    ref = sample(ours, emb["txt"], emb["y"], height=H, width=W_PX, steps=2, seed=[3, 5])
    assert rel_err(out.float(), ref) < 0.05  # bf16 has 8 mantissa bits; a few percent through the tiny model


def test_sampler_input_errors(setup):
    cfg, ours, _, _, emb = setup
    with pytest.raises(ValueError, match="height must be a positive multiple of 16 pixels, got 40; use 32 or 48"):
        sample(ours, emb["txt"], emb["y"], height=40, width=W_PX, steps=1, seed=0)
    with pytest.raises(ValueError, match="exactly one of seed and generator"):
        sample(ours, emb["txt"], emb["y"], height=H, width=W_PX, steps=1)


# ------------------------------------------------------------------------------------------ files
def test_png_metadata_and_grid(tmp_path):
    from PIL import Image

    img = torch.randint(0, 256, (32, 48, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    params = {
        "prompt": "ein Fuchs im Schnee, 雪の中の狐",
        "seed": 7,
        "steps": 28,
        "guidance": 3.5,
        "width": 48,
        "height": 32,
        "model": "flux-dev",
        "weights": "/w/flux1-dev.safetensors",
        "negative_prompt": None,
    }
    path = save_png(img, tmp_path / "a.png", params)
    with Image.open(path) as im:
        assert torch.equal(torch.from_numpy(np.array(im)), img)  # lossless
        assert im.text["prompt"] == params["prompt"] and im.text["seed"] == "7" and im.text["steps"] == "28"
        assert im.text["model"] == "flux-dev" and im.text["weights"] == params["weights"]
        assert "negative_prompt" not in im.text and im.text["Software"] == "fluxzero"
    assert read_png_params(path) == params
    g = grid([img] * 5, cols=2)
    assert g.size == (96, 96)  # 2 columns x 3 rows
    assert torch.equal(torch.from_numpy(np.array(g))[64:, 48:], torch.full((32, 48, 3), 255, dtype=torch.uint8))


def test_embeddings_round_trip_and_errors(tmp_path):
    from fluxzero.sampling.embeddings import EmbeddingsError

    emb = PromptEmbeddings(
        ["a", "b"], torch.randn(2, 4, 8), torch.randn(2, 3), "blurry", torch.randn(1, 4, 8), torch.randn(1, 3)
    )
    back = load_embeddings(save_embeddings(tmp_path / "e.safetensors", emb))
    assert back.prompts == ["a", "b"] and back.negative_prompt == "blurry"
    for k in ("t5", "clip_pooled", "neg_t5", "neg_clip_pooled"):
        assert torch.equal(getattr(back, k), getattr(emb, k))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(EmbeddingsError, match="not a fluxzero prompt-embeddings file"):
        load_embeddings(tmp_path / "other.safetensors")
    with pytest.raises(EmbeddingsError, match="for N=2 prompts"):
        PromptEmbeddings(["a", "b"], torch.randn(3, 4, 8), torch.randn(2, 3))


# ------------------------------------------------------------------------------------------ the commands
CLI_SIZE = ["--height", "32", "--width", "48", "--steps", "2", "--t5-max-length", "8", "--device", "cpu"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny random encoders in FLUX's folder layout (shared with test_cache) and flux-tiny weights."""
    from fluxzero.data.tiny_encoders import write_tiny_encoders as build_tiny_flux_dir

    base = tmp_path_factory.mktemp("sample")
    flux = build_tiny_flux_dir(base / "flux")
    _, ours, _ = pair("flux-tiny", seed=2)
    W.save_weights(ours.state_dict(), base / "tiny.safetensors", layout="bfl")
    return flux, base / "tiny.safetensors"


def _run(*args):
    return CliRunner().invoke(main, [*map(str, args)], catch_exceptions=False)


def _pixels(path):
    from PIL import Image

    with Image.open(path) as im:
        return torch.from_numpy(np.array(im))


def test_sample_command_writes_pngs_grid_and_metadata(files, tmp_path):
    from fluxzero.data.encode import Encoders, resolve_paths
    from fluxzero.model.weights import load_model

    flux, weights = files
    out = tmp_path / "out"
    r = _run(
        "sample",
        weights,
        "--out",
        out,
        "--flux-dir",
        flux,
        "--prompt",
        "a red cat",
        "--prompt",
        "a blue dog",
        "--seed",
        "1",
        "--seed",
        "2",
        "--batch-size",
        "3",
        *CLI_SIZE,
    )
    assert r.exit_code == 0, r.output
    pngs = sorted(out.glob("0*.png"))
    assert [p.name for p in pngs] == ["0000-p0-s1.png", "0001-p0-s2.png", "0002-p1-s1.png", "0003-p1-s2.png"]
    meta = read_png_params(pngs[2])
    assert meta["prompt"] == "a blue dog" and meta["seed"] == 1 and meta["steps"] == 2 and meta["guidance"] == 3.5
    assert meta["width"] == 48 and meta["height"] == 32 and meta["model"] == "flux-tiny"
    assert meta["weights"] == str(weights.resolve()) and meta["true_cfg"] is None
    g = _pixels(out / "grid.png")
    assert g.shape == (64, 96, 3) and torch.equal(g[32:, :48], _pixels(pngs[2]))  # row per prompt, column per seed

    # the same image through the public API: encoders -> sample -> decode
    enc = Encoders.load(resolve_paths(flux), device=torch.device("cpu"), dtype=torch.float32, t5_max_length=8)
    t5, _, clip = enc.encode_text(["a blue dog"])
    lat = sample(load_model(weights, dtype=torch.float32), t5, clip, height=32, width=48, steps=2, seed=[1])
    assert (decode(enc.vae, lat)[0].int() - _pixels(pngs[2]).int()).abs().max() <= 1  # batch of 3 vs 1

    # images do not depend on the batch size
    r = _run(
        "sample",
        weights,
        "--out",
        tmp_path / "one",
        "--flux-dir",
        flux,
        "--prompt",
        "a red cat",
        "--prompt",
        "a blue dog",
        "--seed",
        "1",
        "--seed",
        "2",
        *CLI_SIZE,
    )
    assert r.exit_code == 0, r.output
    for p in pngs:
        assert (_pixels(tmp_path / "one" / p.name).int() - _pixels(p).int()).abs().max() <= 1


def test_encode_prompts_then_sample_from_embeddings(files, tmp_path):
    flux, weights = files
    emb = tmp_path / "prompts.safetensors"
    (tmp_path / "prompts.txt").write_text("a red cat\n\nthe sky\n", encoding="utf-8")
    r = _run(
        "encode-prompts",
        emb,
        "--flux-dir",
        flux,
        "--prompts",
        tmp_path / "prompts.txt",
        "--negative-prompt",
        "small",
        "--t5-max-length",
        "8",
        "--device",
        "cpu",
    )
    assert r.exit_code == 0, r.output
    e = load_embeddings(emb)
    assert e.prompts == ["a red cat", "the sky"] and e.t5.shape == (2, 8, 64) and e.neg_t5.shape == (1, 8, 64)
    # an existing OUT (a LoRA, say) is replaced only with --overwrite
    again = ["encode-prompts", emb, "--flux-dir", flux, "--prompt", "a dog", "--t5-max-length", "8", "--device", "cpu"]
    r = CliRunner().invoke(main, [*map(str, again)])
    assert r.exit_code == 2 and f"{emb} exists; pass --overwrite to replace it or choose another OUT" in r.output
    assert load_embeddings(emb).prompts == ["a red cat", "the sky"]
    assert _run(*again, "--overwrite").exit_code == 0 and load_embeddings(emb).prompts == ["a dog"]
    r = _run(
        "encode-prompts",
        emb,
        "--flux-dir",
        flux,
        "--prompts",
        tmp_path / "prompts.txt",
        "--negative-prompt",
        "small",
        "--t5-max-length",
        "8",
        "--device",
        "cpu",
        "--overwrite",
    )
    assert r.exit_code == 0, r.output
    common = ["--seed", "4", "--true-cfg", "3", *CLI_SIZE]
    r = _run("sample", weights, "--out", tmp_path / "a", "--embeddings", emb, "--vae", flux / "vae", *common)
    assert r.exit_code == 0, r.output
    r = _run(
        "sample",
        weights,
        "--out",
        tmp_path / "b",
        "--flux-dir",
        flux,
        "--prompts",
        tmp_path / "prompts.txt",
        "--negative-prompt",
        "small",
        *common,
    )
    assert r.exit_code == 0, r.output
    for name in ("0000-p0-s4.png", "0001-p1-s4.png"):
        assert torch.equal(_pixels(tmp_path / "a" / name), _pixels(tmp_path / "b" / name))  # same numbers, no T5
    meta = read_png_params(tmp_path / "a" / "0001-p1-s4.png")
    assert meta["prompt"] == "the sky" and meta["negative_prompt"] == "small" and meta["true_cfg"] == 3.0
    r = _run(
        "sample", weights, "--out", tmp_path / "c", "--embeddings", emb, "--vae", flux / "vae", "--seed", "4", *CLI_SIZE
    )
    assert not torch.equal(_pixels(tmp_path / "c" / "0000-p0-s4.png"), _pixels(tmp_path / "a" / "0000-p0-s4.png"))
    # the same weights as a diffusers folder give the same images (any layout convert reads)
    W.save_weights(W.load_weights(weights), tmp_path / "diffusers", layout="diffusers")
    r = _run(
        "sample", tmp_path / "diffusers", "--out", tmp_path / "d", "--embeddings", emb, "--vae", flux / "vae", *common
    )
    assert r.exit_code == 0, r.output
    assert torch.equal(_pixels(tmp_path / "d" / "0001-p1-s4.png"), _pixels(tmp_path / "a" / "0001-p1-s4.png"))


def test_sample_bad_input_is_one_sentence(files, tmp_path):
    flux, weights = files
    (tmp_path / "empty.txt").write_text("\n  \n", encoding="utf-8")
    (tmp_path / "file").write_text("x")
    small = tmp_path / "small.safetensors"
    save_embeddings(small, PromptEmbeddings(["x"], torch.zeros(1, 8, 16), torch.zeros(1, 8)))
    base = ["sample", weights, "--out", tmp_path / "o"]
    cases = [
        (
            [*base, "--prompt", "a cat", "--vae", tmp_path / "nope", "--flux-dir", flux],
            f"diffusers AutoencoderKL folder not found at --vae {tmp_path / 'nope'}",
        ),
        ([*base, "--embeddings", small, "--vae", tmp_path / "nope"], f"VAE folder {tmp_path / 'nope'} does not exist"),
        (
            [*base, "--prompt", "a cat", "--flux-dir", tmp_path, "--vae", flux / "vae"],
            "transformers T5EncoderModel folder not found",
        ),
        (
            [*base, "--prompts", tmp_path / "empty.txt", "--flux-dir", flux],
            "empty.txt holds no prompts; write one prompt per line",
        ),
        (
            [*base, "--prompt", "a cat", "--flux-dir", flux, "--height", "50"],
            "Invalid value for --height: must be a multiple of 16 pixels, got 50; use 48 or 64",
        ),
        (
            [*base, "--prompt", "a cat", "--flux-dir", flux, "--model", "flux-tiny-schnell"],
            "do not match the model: 4 unexpected: guidance_in",
        ),
        (
            [
                "sample",
                flux / "vae" / "diffusion_pytorch_model.safetensors",
                "--out",
                tmp_path / "o",
                "--prompt",
                "a cat",
                "--flux-dir",
                flux,
            ],
            "cannot tell the layout",
        ),
        (
            [*base, "--embeddings", small, "--flux-dir", flux],
            "the prompt embeddings are T5 16 / CLIP 8 wide but model 'flux-tiny' takes 64 / 32",
        ),
        (
            [*base, "--prompt", "a cat", "--flux-dir", flux, "--true-cfg", "2"],
            "--true-cfg above 1 needs a negative prompt",
        ),
        (
            [*base, "--prompt", "a cat", "--flux-dir", flux, "--negative-prompt", "dog"],
            "acts only with --true-cfg above 1",
        ),
        ([*base, "--embeddings", small, "--flux-dir", flux, "--true-cfg", "2"], "holds none; encode one with"),
        ([*base, "--flux-dir", flux], "no prompts; pass --prompt TEXT"),
        ([*base, "--embeddings", weights, "--flux-dir", flux], "is not a fluxzero prompt-embeddings file"),
        (
            ["sample", weights, "--out", tmp_path / "file" / "o", "--embeddings", small, "--flux-dir", flux],
            "Invalid value for --out: cannot create",
        ),
        (
            [*base, "--prompt", "a cat", "--flux-dir", flux, "--attention", "cudnn"],
            "Invalid value for --attention: cudnn attention runs on CUDA only, and this samples on cpu",
        ),
    ]
    for args, message in cases:
        r = _run(*args[:1], *CLI_SIZE, *args[1:])  # the case's own options come last and win
        assert r.exit_code == 2, (args, r.output)
        text = " ".join(r.output.split())  # Click wraps long messages
        assert message in text and "Traceback" not in text, (message, r.output)
        assert text.count("Error:") == 1


# ------------------------------------------------------------------------------------------ the speed options
def test_compiled_blocks_sample_what_eager_ones_do():
    """--compile's helper (the trainer's apply_compile, Inductor on CPU) against the eager model, fp32, 2 steps.
    Tolerance rel 1e-5 as for the parity tests above: Inductor fuses the pointwise ops and may reassociate the
    norms' reductions, ~1e-7 per forward (measured 8e-8 after 2 steps), while a block that compiled into other
    work (a dropped modulation, a wrong attention mask) moves the latents by > 1e-2."""
    from fluxzero.model import build_model
    from fluxzero.sampling.pipeline import prepare_model

    torch.manual_seed(0)
    model = build_model("flux-tiny").eval()
    g = torch.Generator().manual_seed(1)
    txt, y = (
        torch.randn(2, 8, model.config.context_in_dim, generator=g),
        torch.randn(2, model.config.vec_in_dim, generator=g),
    )
    eager = sample(model, txt, y, height=32, width=48, steps=2, seed=[1, 2])
    prepare_model(model, attention="math", compile=True)
    assert model.attention == "math" and all(b.attention == "math" for b in model.single_blocks)
    assert all(isinstance(b.__dict__.get("forward"), functools.partial) for b in model.double_blocks)
    compiled = sample(model, txt, y, height=32, width=48, steps=2, seed=[1, 2])
    assert rel_err(compiled, eager) <= RTOL


def test_sampler_sets_the_models_sdpa_flags_for_the_loop_only(setup):
    """The loop runs under the model's attention flags (each call then skips its own sdpa_kernel) and leaves
    torch's process-wide flags as it found them; the numbers are the per-call path's."""
    cfg, ours, _, _, emb = setup
    b = torch.backends.cuda
    before = (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled())
    seen = []
    out = run_ours(ours, emb, callback=lambda *_: seen.append((b.flash_sdp_enabled(), b.cudnn_sdp_enabled())))
    assert seen[0] == (True, False)  # "auto" = flash, efficient, math: cuDNN off inside the loop
    assert (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled()) == before

    class Wrapped(torch.nn.Module):  # no `attention` name: every call chooses its kernels itself, as before
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, **kw):
            return self.inner(**kw)

    assert torch.equal(run_ours(Wrapped(ours), emb), out)


def test_attention_choices_are_the_models():
    from fluxzero.commands.sample import ATTENTION_CHOICES
    from fluxzero.model.math import ATTENTION_BACKENDS

    assert tuple(ATTENTION_BACKENDS) == ATTENTION_CHOICES


def test_sample_command_speed_options(files, tmp_path, monkeypatch):
    """--compile, --attention and --no-grid reach the model and the files; the images stay the default's.
    Compiled with Dynamo's eager backend here (the wiring; Inductor's numbers are the test above's)."""
    import fluxzero.model.compile as C

    flux, weights = files
    calls = []
    real = C.apply_compile
    monkeypatch.setattr(
        C, "apply_compile", lambda model, backend: calls.append((real(model, backend="eager"), backend))
    )
    args = ["--flux-dir", flux, "--prompt", "a red cat", "--seed", "1", "--seed", "2", *CLI_SIZE]
    r = _run("sample", weights, "--out", tmp_path / "plain", *args)
    assert r.exit_code == 0 and "images and grid.png" in r.output, r.output
    assert calls == []  # the defaults: eager, "auto" attention, a grid
    r = _run("sample", weights, "--out", tmp_path / "fast", *args, "--compile", "--attention", "math", "--no-grid")
    assert r.exit_code == 0 and "wrote 2 images to" in r.output, r.output
    tiny = get_model_config("flux-tiny")
    assert calls == [(tiny.depth + tiny.depth_single_blocks, "inductor")]  # every block compiled, once
    assert sorted(p.name for p in (tmp_path / "fast").iterdir()) == ["0000-p0-s1.png", "0001-p0-s2.png"]
    for name in ("0000-p0-s1.png", "0001-p0-s2.png"):  # fp32: math and flash kernels agree to ~1e-7
        assert (_pixels(tmp_path / "fast" / name).int() - _pixels(tmp_path / "plain" / name).int()).abs().max() <= 1
        assert read_png_params(tmp_path / "fast" / name) == read_png_params(tmp_path / "plain" / name)


def test_sampling_needs_no_deepspeed():
    """A sampling node (or `fluxzero sample`) imports nothing of the training stack's DeepSpeed side."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["deepspeed"] = None  # any import of it fails
import fluxzero.commands.sample, fluxzero.sampling.pipeline, fluxzero.sampling.vae, fluxzero.sampling.embeddings
from fluxzero.model import build_model
from fluxzero.sampling import sample
import torch
m = build_model("flux-tiny")
out = sample(m, torch.zeros(1, 3, 64), torch.zeros(1, 32), height=16, width=32, steps=1, seed=0)
print(tuple(out.shape))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "(1, 16, 2, 4)" in r.stdout, r.stderr[-2000:]


def test_auto_speed_compiles_where_it_pays_off_and_never_recompiles_for_a_last_batch():
    from fluxzero.sampling.pipeline import COMPILE_PAYS_OFF_IMAGE_STEPS, auto_speed

    # 1024 px, 28 steps: compiling pays off from ~10 images (256 image-steps), not for 4
    assert auto_speed("cuda", 4, 28, 4096, None, None) == (4, False)
    assert auto_speed("cuda", 10, 28, 4096, None, None) == (2, True)  # 4+4+2 would compile twice
    assert auto_speed("cuda", 12, 28, 4096, None, None) == (4, True)
    assert auto_speed("cuda", 7, 28, 4096, None, True) == (1, True)
    # a quarter of the tokens (512 px): four times the images before it pays off; a Kontext reference of the
    # same size doubles the tokens a call: 1024 px Kontext pays off from 5 images
    n = COMPILE_PAYS_OFF_IMAGE_STEPS * 4 // 28 + 1
    assert auto_speed("cuda", n - 4, 28, 1024, None, None)[1] is False
    assert auto_speed("cuda", n, 28, 1024, None, None)[1] is True
    assert auto_speed("cuda", 4, 28, 2 * 4096, None, None) == (4, False)
    assert auto_speed("cuda", 5, 28, 2 * 4096, None, None) == (1, True)  # 5 images: one a call, compiled once
    # the CPU: eager, one image a call; what the user sets stays
    assert auto_speed("cpu", 100, 28, 4096, None, None) == (1, False)
    assert auto_speed("cpu", 100, 28, 4096, 3, True) == (3, True)
    assert auto_speed("cuda", 100, 28, 4096, 5, False) == (5, False)
