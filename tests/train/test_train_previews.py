"""Sample images, validation loss and EMA during training, through launch/train.py (flux-tiny, CPU).

A run with previews, validation and EMA must have exactly the losses of a run without them (they leave the
random streams alone), the validation loss must be deterministic across a resume, images land in
output_dir/samples/step_XXXXXXXX/ with their parameters, and the EMA is saved, resumed and exported.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import tiny_ds, train_ok

DATA = "synthetic:n=16,hw=4x4,txt=4,ctx=64,vec=32"
VALIDATION = "synthetic:n=6,hw=4x4,txt=4,ctx=64,vec=32"


def _ds(stage=2):
    return tiny_ds(stage, clipping=0.0)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from diffusers import AutoencoderKL

    from fluxzero.sampling.embeddings import PromptEmbeddings, save_embeddings

    tmp = tmp_path_factory.mktemp("previews")
    torch.manual_seed(0)
    AutoencoderKL(
        latent_channels=16,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    ).save_pretrained(tmp / "vae")
    save_embeddings(
        tmp / "prompts.safetensors", PromptEmbeddings(["a cat", "a dog"], torch.randn(2, 4, 64), torch.randn(2, 32))
    )
    for stage in (2, 3):
        (tmp / f"ds{stage}.json").write_text(json.dumps(_ds(stage)))
    return tmp


def _run_file(assets, out, *, previews: bool, stage=2, **over):
    cfg = {
        "deepspeed": str(assets / f"ds{stage}.json"),
        "data": DATA,
        "output_dir": str(out),
        "steps": 4,
        "checkpoint": {"every": 2},
        "export": {"format": "bfl", "dtype": "fp32"},
        "log_every": 1,
    }
    if previews:
        cfg.update(
            ema={"decay": 0.9},
            validation={"data": VALIDATION, "every": 2},
            sample={
                "every": 2,
                "prompts": str(assets / "prompts.safetensors"),
                "vae": str(assets / "vae"),
                "size": "32x32",
                "steps": 2,
                "seeds": [0, 1],
            },
        )
        cfg["export"]["weights"] = "ema"
    for key, value in over.items():  # a section's keys are merged into it
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    path = Path(str(out) + ".yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


_train = train_ok


def _rows(out):
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_previews_validation_and_ema_leave_training_unchanged(assets, tmp_path):
    from PIL import Image
    from safetensors.torch import load_file

    from fluxzero.sampling.images import read_png_params

    _train(_run_file(assets, tmp_path / "plain", previews=False))
    _train(_run_file(assets, tmp_path / "full", previews=True))
    plain, full = _rows(tmp_path / "plain"), _rows(tmp_path / "full")
    assert [plain[s]["loss"] for s in range(1, 5)] == [full[s]["loss"] for s in range(1, 5)]  # exactly

    val = {s: full[s].get("val_loss") for s in range(1, 5)}
    assert val[1] is None and val[3] is None and all(v > 0 for v in (val[2], val[4])) and val[2] != val[4]
    for step in (2, 4):
        folder = tmp_path / "full" / "samples" / f"step_{step:08d}"
        pngs = sorted(folder.glob("0*.png"))
        assert len(pngs) == 4 and (folder / "grid.png").is_file()  # 2 prompts x 2 seeds
        assert Image.open(pngs[0]).size == (32, 32)
        params = read_png_params(pngs[0])
        assert params["prompt"] == "a cat" and params["steps"] == 2 and params["seed"] == 0
        assert full[step]["sample_s"] > 0
    # the images of step 2 and 4 differ: they show the model as it trains
    a = Image.open(tmp_path / "full" / "samples" / "step_00000002" / "grid.png").tobytes()
    assert a != Image.open(tmp_path / "full" / "samples" / "step_00000004" / "grid.png").tobytes()

    # the EMA was saved with each checkpoint and exported instead of the live weights
    ck = tmp_path / "full" / "checkpoints" / "step_00000004"
    assert (ck / "ema_rank_00000.safetensors").is_file()
    ema, live = (
        load_file(tmp_path / "full" / "export_ema.safetensors"),
        load_file(tmp_path / "plain" / "export.safetensors"),
    )
    assert ema.keys() == live.keys() and any(not torch.equal(ema[k], live[k]) for k in ema)

    # `fluxzero export --weights ema` writes the same file from the checkpoint
    from click.testing import CliRunner

    from fluxzero.cli import main

    out = tmp_path / "again.safetensors"
    r = CliRunner().invoke(main, ["export", str(tmp_path / "full"), str(out), "--weights", "ema", "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    again = load_file(out)
    assert all(torch.equal(again[k], ema[k]) for k in ema)


def test_validation_and_ema_resume_exactly(assets, tmp_path):
    _train(_run_file(assets, tmp_path / "whole", previews=True, sample={"every": 0}))
    run = _run_file(assets, tmp_path / "cut", previews=True, sample={"every": 0})
    _train(run, "stop_after=2")
    _train(run)
    whole, cut = _rows(tmp_path / "whole"), _rows(tmp_path / "cut")
    assert [whole[s]["loss"] for s in range(1, 5)] == [cut[s]["loss"] for s in range(1, 5)]
    assert whole[4]["val_loss"] == cut[4]["val_loss"] and whole[2]["val_loss"] == cut[2]["val_loss"]
    from safetensors.torch import load_file

    a, b = (
        load_file(tmp_path / "whole" / "export_ema.safetensors"),
        load_file(tmp_path / "cut" / "export_ema.safetensors"),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)  # the EMA resumed from its shard, not from the weights


def test_previews_that_cannot_be_written_are_one_line_and_training_goes_on(assets, tmp_path):
    from tests.helpers import train

    run = _run_file(assets, tmp_path / "out", previews=True, steps=2, export={"format": None}, sample={"seeds": [0]})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "samples").write_text("a file where the previews go")
    r = train(run)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    warned = [line for line in r.stderr.splitlines() if line.startswith("warning: the preview images")]
    assert len(warned) == 1 and "of step 2 were not written to " in warned[0] and "training goes on" in warned[0]
    assert (tmp_path / "out" / "checkpoints" / "latest").read_text() == "step_00000002"
    assert _rows(tmp_path / "out")[2]["val_loss"] > 0


def test_bad_preview_settings_are_one_sentence(assets, tmp_path):
    from fluxzero.config import TrainConfig

    base = {"deepspeed": "d.json", "data": DATA, "output_dir": str(tmp_path)}
    for bad, words in (
        ({"sample": {"every": 2}}, "sample.every needs sample.prompts"),
        ({"sample": {"size": "30x32"}}, "multiples of 16"),
        ({"sample": {"weights": "ema"}}, "keeps no EMA"),
        ({"validation": {"every": 5}}, "validation.every needs validation.data"),
        ({"ema": {"decay": 1.0}}, "ema.decay must be between 0 and 1"),
    ):
        with pytest.raises(ValueError, match=words):
            TrainConfig.from_dict({**base, **bad})


@pytest.mark.slow
def test_zero3_two_ranks_sample_and_validate(assets, tmp_path):
    # every rank takes part in the forward passes (ZeRO-3 gathers the parameters collectively); rank 0 writes
    run = _run_file(
        assets, tmp_path / "z3", previews=True, stage=3, steps=2, export={"format": None}, sample={"seeds": [0]}
    )
    _train(run, world=2)
    rows = _rows(tmp_path / "z3")
    assert rows[2]["val_loss"] > 0
    assert len(list((tmp_path / "z3" / "samples" / "step_00000002").glob("0*.png"))) == 2
    assert (tmp_path / "z3" / "checkpoints" / "step_00000002" / "ema_rank_00001.safetensors").is_file()
