"""FLUX.1 Kontext training on CPU: flux-tiny-kontext on synthetic pairs (ref=1), a full fine-tune and a LoRA under
every ZeRO stage, each against the plain-PyTorch reference loop (flow.prepare_batch puts the reference tokens after
the target's, flow.loss covers the target's), and launch/tiny-kontext.yaml as the quick start runs it.

Tolerance: fp32 on CPU, one rank; the stages differ from plain PyTorch only in summation order (~1e-7 a step),
grown a little by Adam over 3 steps: rel 1e-5, as tests/train/test_train_lora.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, plain_losses, tiny_ds, tiny_weights

DATA = "synthetic:n=4,hw=8x8,txt=4,ctx=64,vec=32,ref=1"
STEPS, LR, RTOL = 3, 1e-2, 1e-5
LORA = {"rank": 4, "alpha": 8, "targets": "all-linear"}

_CHILD = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from fluxzero.config import TrainConfig
from fluxzero.train.loop import train
print("LOSSES", json.dumps({name: train(TrainConfig.from_dict(cfg))["losses"] for name, cfg in json.loads(sys.argv[1])}))
"""


def _reference(weights, lora: bool) -> list[float]:
    from fluxzero.config import LoraConfig
    from fluxzero.model import build_model
    from fluxzero.model.lora import apply_lora
    from fluxzero.model.weights import load_weights

    torch.manual_seed(3)  # build_engine's order: seed, build, load the weights, apply_lora
    model = build_model("flux-tiny-kontext")
    model.load_state_dict(load_weights(weights, dtype=torch.float32))
    if lora:
        apply_lora(model, LoraConfig(**LORA))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    return plain_losses(model, opt, DATA, STEPS, seed=3)


@pytest.mark.slow
def test_full_and_lora_train_under_every_zero_stage(tmp_path):
    weights = tiny_weights(tmp_path / "base.safetensors")  # flux-tiny's tensors: Kontext's are FLUX.1's
    jobs = []
    for stage in (0, 1, 2, 3):
        ds = tmp_path / f"z{stage}.json"
        ds.write_text(
            json.dumps(tiny_ds(stage, clipping=0.0, lr=LR, weight_decay=0.0, train_micro_batch_size_per_gpu=4))
        )
        for kind in ("full", "lora"):
            cfg = {
                "deepspeed": str(ds),
                "data": DATA,
                "output_dir": str(tmp_path / f"{kind}{stage}"),
                "model": "flux-tiny-kontext",
                "weights": str(weights),
                "steps": STEPS,
                "seed": 3,
                "export": {"format": None},
            }
            jobs.append((f"{kind}{stage}", {**cfg, **({"lora": LORA} if kind == "lora" else {})}))
    env = {**os.environ, "FLUXZERO_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(jobs)], env=env, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stderr[-3000:]
    losses = json.loads(p.stdout.split("LOSSES", 1)[1])
    ref = {kind: _reference(weights, kind == "lora") for kind in ("full", "lora")}
    for name, got in losses.items():
        want = ref[name[:-1]]
        assert got == pytest.approx(want, rel=RTOL), (name, got, want)
    # they train: the full fine-tune's loss falls; the adapters (B starts at 0) move the model from step 2 on
    assert ref["full"][-1] < ref["full"][0] and len(set(ref["lora"])) == STEPS


@pytest.mark.slow
def test_tiny_kontext_run_file_trains_and_exports_a_kontext_lora(tmp_path):
    from fluxzero.model.lora_formats import read_lora

    out = tmp_path / "tiny-kontext"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "launch/train.py",
        "--config",
        "launch/tiny-kontext.yaml",
        "steps=2",
        "checkpoint.every=0",
        "log_every=1",
        f"output_dir={out}",
    ]
    p = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "done: step 2/2" in p.stderr
    _, info = read_lora(out / "lora.safetensors")
    assert (info.layout, info.rank, info.base_model) == ("diffusers", 4, "flux-tiny-kontext")


def test_a_kontext_model_refuses_data_without_references_and_back():
    from fluxzero.config import get_model_config
    from fluxzero.data import build_dataloader
    from fluxzero.data.errors import DataError

    plain = build_dataloader(DATA.replace(",ref=1", ""), micro_batch=2, rank=0, world_size=1, seed=0)
    pairs = build_dataloader(DATA, micro_batch=2, rank=0, world_size=1, seed=0)
    with pytest.raises(DataError, match="is FLUX.1 Kontext.*holds no reference latents"):
        plain.check_model(get_model_config("flux-tiny-kontext"))
    with pytest.raises(DataError, match="not a Kontext model"):
        pairs.check_model(get_model_config("flux-tiny"))
    pairs.check_model(get_model_config("flux-tiny-kontext"))
    batch = next(iter(pairs))
    assert batch["reference"].shape == batch["latents"].shape == (2, 16, 8, 8)


def _sample_cli(*args) -> None:
    from click.testing import CliRunner

    from fluxzero.cli import main

    r = CliRunner().invoke(main, ["sample", *map(str, args)], catch_exceptions=False)
    assert r.exit_code == 0, r.output


def test_kontext_previews_edit_the_reference_as_fluxzero_sample_does(tmp_path):
    """A Kontext run's previews edit sample.reference (or, without it, validation.data's first pair's reference):
    each PNG equals what `fluxzero sample --reference` makes of the run's export with the same seed, and differs
    from the text-only image. The export is a FluxKontextPipeline folder, which `fluxzero sample` reads as Kontext."""
    import numpy as np
    import yaml
    from PIL import Image
    from safetensors.torch import save_file

    from fluxzero.data import build_dataloader
    from fluxzero.sampling.embeddings import PromptEmbeddings, save_embeddings
    from fluxzero.sampling.images import read_png_params
    from tests.helpers import train_all_ok
    from tests.sampling.test_sampling import tiny_vae

    tiny_vae().save_pretrained(tmp_path / "vae")
    torch.manual_seed(0)
    save_embeddings(
        tmp_path / "prompts.safetensors", PromptEmbeddings(["make it night"], torch.randn(1, 4, 64), torch.randn(1, 32))
    )
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 60, 3), dtype=np.uint8)).save(tmp_path / "ref.png")
    (tmp_path / "ds.json").write_text(json.dumps(tiny_ds(2, clipping=0.0, lr=LR, train_micro_batch_size_per_gpu=4)))
    sample = {
        "every": 2,
        "prompts": str(tmp_path / "prompts.safetensors"),
        "vae": str(tmp_path / "vae"),
        "size": "48x32",
        "steps": 2,
        "seeds": [5],
    }
    runs = {}
    for name, extra in (
        ("image", {"sample": {**sample, "reference": str(tmp_path / "ref.png")}}),
        ("val", {"sample": sample, "validation": {"data": DATA}}),
    ):
        cfg = {
            "deepspeed": str(tmp_path / "ds.json"),
            "data": DATA,
            "output_dir": str(tmp_path / name),
            "model": "flux-tiny-kontext",
            "weights": str(tiny_weights(tmp_path / "base.safetensors")),
            "steps": 2,
            "seed": 3,
            "export": {"format": "diffusers", "dtype": "fp32"},
            **extra,
        }
        runs[name] = tmp_path / f"{name}.yaml"
        runs[name].write_text(yaml.safe_dump(cfg))
    train_all_ok(*[(run,) for run in runs.values()])

    val_ref = build_dataloader(DATA, micro_batch=1, rank=0, world_size=1, seed=0).source.get(0)["reference"]
    save_file({"latents": val_ref.contiguous()}, tmp_path / "val_ref.safetensors")
    common = [
        "--embeddings",
        tmp_path / "prompts.safetensors",
        "--vae",
        tmp_path / "vae",
        "--width",
        48,
        "--height",
        32,
        "--steps",
        2,
        "--seed",
        5,
        "--device",
        "cpu",
        "--no-grid",
    ]
    pixels = lambda png: np.asarray(Image.open(png)).astype(int)  # noqa: E731
    for name, reference in (("image", tmp_path / "ref.png"), ("val", tmp_path / "val_ref.safetensors")):
        preview = tmp_path / name / "samples" / "step_00000002" / "0000-p0-s5.png"
        export = tmp_path / name / "export"
        assert json.loads((export / "model_index.json").read_text())["_class_name"] == "FluxKontextPipeline"
        _sample_cli(export, "--out", tmp_path / f"{name}-cli", "--reference", reference, *common)
        _sample_cli(export, "--out", tmp_path / f"{name}-text", "--model", "flux-tiny-kontext", *common)
        same, text = (
            pixels(tmp_path / f"{name}-cli" / "0000-p0-s5.png"),
            pixels(tmp_path / f"{name}-text" / "0000-p0-s5.png"),
        )
        assert np.array_equal(pixels(preview), same), name
        assert np.abs(pixels(preview) - text).mean() > 1, name  # the reference steers the preview
        params = read_png_params(preview)
        assert params["model"] == "flux-tiny-kontext" and params["seed"] == 5
        assert params["reference"] == (
            str((tmp_path / "ref.png").resolve()) if name == "image" else "synthetic sample 0 (validation.data)"
        )


def test_bad_kontext_preview_settings_are_one_sentence(tmp_path):
    from fluxzero.config import TrainConfig

    base = {
        "deepspeed": "d.json",
        "data": DATA,
        "output_dir": str(tmp_path),
        "model": "flux-tiny-kontext",
        "sample": {"every": 2, "prompts": "p.safetensors", "vae": "vae"},
    }
    with pytest.raises(
        ValueError,
        match=r"^model flux-tiny-kontext is FLUX.1 Kontext, so its previews edit a "
        r"reference image; set sample.reference .* or validation.data",
    ):
        TrainConfig.from_dict(base)
    with pytest.raises(
        ValueError,
        match=r"^sample.reference is an image for a FLUX.1 Kontext model to edit, and "
        r"model flux-tiny is not one; remove sample.reference",
    ):
        TrainConfig.from_dict(
            {**base, "model": "flux-tiny", "data": DATA.replace(",ref=1", ""), "sample": {"reference": "ref.png"}}
        )
    # a reference file that is not there: tests/test_bad_inputs.py (sample_reference_missing)
