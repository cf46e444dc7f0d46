"""What users combine with a full fine-tune in the fused mode (fused-adafactor-sr), with and without streamed
blocks (fluxzero.offload_blocks), through launch/train.py on flux-tiny (CPU).

On the CPU a streamed block's "device" copy is a second CPU tensor fetched and written back as on a GPU
(fluxzero.train.block_stream), so a weight the EMA, validation or previews read from the wrong copy, or an update
lost on the way back, shows as a difference from the run with every block resident. The fused mode with nothing
streamed is bit-identical to adafactor-sr stepped after backward (tests/train/test_fused_step.py), so it is the
reference here.
"""
import json
from pathlib import Path

import torch
import yaml

from tests.helpers import tiny_ds, train_all_ok
from tests.train.test_train_previews import VALIDATION, assets  # noqa: F401  (the module fixture: VAE, prompts)

DATA = "synthetic:n=16,hw=4x4,txt=4,ctx=64,vec=32"


def _ds(offload: int, **fz) -> dict:
    return tiny_ds(0, clipping=0.0, weight_decay=0.0, lr=1e-2,
                   fluxzero={"optimizer_mode": "fused-adafactor-sr", "offload_blocks": offload, **fz})


def _run_file(tmp: Path, name: str, ds: dict, extras: bool = False, assets_dir: Path | None = None,
              steps: int = 4) -> Path:
    (tmp / f"{name}.json").write_text(json.dumps(ds))
    cfg = {"deepspeed": str(tmp / f"{name}.json"), "data": DATA, "output_dir": str(tmp / name), "steps": steps,
           "checkpoint": {"every": 2}, "export": {"format": "bfl", "dtype": "fp32"}, "log_every": 1, "seed": 3}
    if extras:
        cfg.update(ema={"decay": 0.9}, validation={"data": VALIDATION, "every": 2},
                   sample={"every": 2, "prompts": str(assets_dir / "prompts.safetensors"),
                           "vae": str(assets_dir / "vae"), "size": "32x32", "steps": 2, "seeds": [0],
                           "weights": "ema"})
        cfg["export"]["weights"] = "ema"
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _rows(out: Path) -> dict:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_ema_validation_and_previews_with_streamed_blocks_equal_the_resident_run(assets, tmp_path):  # noqa: F811
    """EMA (sampled from and exported), validation and previews in the fused mode, every resident block
    checkpointed by DeepSpeed's reentrant implementation (the streamed ones by the streamer): with two blocks
    streamed every loss, validation loss, image and EMA weight equals the run with every block resident, and the
    extras leave the losses of a run without them."""
    from safetensors.torch import load_file

    ck = {"activation_checkpointing": {"every_k_blocks": 1, "implementation": "deepspeed"}}
    runs = {"plain": _run_file(tmp_path, "plain", _ds(2, **ck)),
            "resident": _run_file(tmp_path, "resident", _ds(0, **ck), True, assets),
            "streamed": _run_file(tmp_path, "streamed", _ds(2, **ck), True, assets)}
    train_all_ok(*[[r] for r in runs.values()])
    rows = {n: _rows(tmp_path / n) for n in runs}
    losses = {n: [rows[n][s]["loss"] for s in range(1, 5)] for n in runs}
    assert losses["plain"] == losses["resident"] == losses["streamed"], losses
    for s in (2, 4):
        assert rows["streamed"][s]["val_loss"] == rows["resident"][s]["val_loss"] > 0
        grid = [(tmp_path / n / "samples" / f"step_{s:08d}" / "grid.png").read_bytes() for n in ("resident", "streamed")]
        assert grid[0] == grid[1]
    assert rows["streamed"][2]["val_loss"] != rows["streamed"][4]["val_loss"]
    ema = {n: load_file(tmp_path / n / "export_ema.safetensors") for n in ("resident", "streamed")}
    live = load_file(tmp_path / "plain" / "export.safetensors")
    assert ema["resident"].keys() == live.keys()
    assert all(torch.equal(ema["resident"][k], ema["streamed"][k]) for k in live)
    assert any(not torch.equal(ema["streamed"][k], live[k]) for k in live)  # the EMA, not the live weights


def test_fp8_and_compiled_blocks_with_streamed_blocks_equal_the_resident_run(tmp_path):
    """FP8 matmuls (torchao float8 training casts each weight as it is used: a streamed weight is cast from its
    device copy) and compiled blocks (the streamer's checkpoint wraps the compiled forward): two streamed blocks
    train exactly like none, and the export holds the weights the last step wrote back."""
    from safetensors.torch import load_file

    both = {"fp8": {"recipe": "tensorwise"}, "compile": {"blocks": True, "backend": "aot_eager"}}
    runs = {n: _run_file(tmp_path, n, _ds(k, **both), steps=2) for n, k in (("resident", 0), ("streamed", 2))}
    train_all_ok(*[[r] for r in runs.values()])
    rows = {n: _rows(tmp_path / n) for n in runs}
    assert [rows["resident"][s]["loss"] for s in (1, 2)] == [rows["streamed"][s]["loss"] for s in (1, 2)]
    out = {n: load_file(tmp_path / n / "export.safetensors") for n in runs}
    assert all(torch.equal(out["resident"][k], out["streamed"][k]) for k in out["resident"])
