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

import pytest
import torch
import yaml

from tests.helpers import tiny_ds, train_all_ok
from tests.train.test_train_previews import VALIDATION, assets  # noqa: F401  (the module fixture: VAE, prompts)

DATA = "synthetic:n=16,hw=4x4,txt=4,ctx=64,vec=32"


def _ds(offload: int, **fz) -> dict:
    return tiny_ds(
        0,
        clipping=0.0,
        weight_decay=0.0,
        lr=1e-2,
        fluxzero={"optimizer_mode": "fused-adafactor-sr", "offload_blocks": offload, **fz},
    )


def _run_file(
    tmp: Path, name: str, ds: dict, extras: bool = False, assets_dir: Path | None = None, steps: int = 4
) -> Path:
    (tmp / f"{name}.json").write_text(json.dumps(ds))
    cfg = {
        "deepspeed": str(tmp / f"{name}.json"),
        "data": DATA,
        "output_dir": str(tmp / name),
        "steps": steps,
        "checkpoint": {"every": 2},
        "export": {"format": "bfl", "dtype": "fp32"},
        "log_every": 1,
        "seed": 3,
    }
    if extras:
        cfg.update(
            ema={"decay": 0.9},
            validation={"data": VALIDATION, "every": 2},
            sample={
                "every": 2,
                "prompts": str(assets_dir / "prompts.safetensors"),
                "vae": str(assets_dir / "vae"),
                "size": "32x32",
                "steps": 2,
                "seeds": [0],
                "weights": "ema",
            },
        )
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
    runs = {
        "plain": _run_file(tmp_path, "plain", _ds(2, **ck)),
        "resident": _run_file(tmp_path, "resident", _ds(0, **ck), True, assets),
        "streamed": _run_file(tmp_path, "streamed", _ds(2, **ck), True, assets),
    }
    train_all_ok(*[[r] for r in runs.values()])
    rows = {n: _rows(tmp_path / n) for n in runs}
    losses = {n: [rows[n][s]["loss"] for s in range(1, 5)] for n in runs}
    assert losses["plain"] == losses["resident"] == losses["streamed"], losses
    for s in (2, 4):
        assert rows["streamed"][s]["val_loss"] == rows["resident"][s]["val_loss"] > 0
        grid = [
            (tmp_path / n / "samples" / f"step_{s:08d}" / "grid.png").read_bytes() for n in ("resident", "streamed")
        ]
        assert grid[0] == grid[1]
    assert rows["streamed"][2]["val_loss"] != rows["streamed"][4]["val_loss"]
    ema = {n: load_file(tmp_path / n / "export_ema.safetensors") for n in ("resident", "streamed")}
    live = load_file(tmp_path / "plain" / "export.safetensors")
    assert ema["resident"].keys() == live.keys()
    assert all(torch.equal(ema["resident"][k], ema["streamed"][k]) for k in live)
    assert any(not torch.equal(ema["streamed"][k], live[k]) for k in live)  # the EMA, not the live weights


@pytest.mark.slow  # two compiles of the blocks (aot_eager) on the CPU
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


# ---------------------------------------------------------------------------------------------------------
# Host memory is part of the fit (fluxzero.train.host_memory): the memory model's whole host need, refused
# before anything large is allocated
# ---------------------------------------------------------------------------------------------------------
def test_a_run_beyond_the_host_is_refused_before_the_engine_starts(tmp_path):
    from tests.helpers import rank_env, train

    run = _run_file(tmp_path, "short", _ds(2))
    cfg = yaml.safe_load(run.read_text())
    cfg["ema"] = {"decay": 0.9, "device": "cpu"}
    run.write_text(yaml.safe_dump(cfg))
    r = train(run, env={**rank_env(), "FLUXZERO_HOST_MEMORY_GIB": "0.00001"})  # ~10 KB: flux-tiny needs more
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    line = next(x for x in r.stderr.splitlines() if "host memory" in x)
    assert "this run needs 0.0 GiB of host memory on this machine (EMA (fp32) 0.0 GiB, streamed block weights " in line
    assert line.endswith(
        "but FLUXZERO_HOST_MEMORY_GIB gives 0.0 GiB and 10% of it is kept free: lower "
        "fluxzero.offload_blocks, keep the EMA on the GPU (ema.device: gpu), or let `fluxzero "
        "gen-config --fit --host-memory 1` choose a config for it"
    ), line
    assert not (tmp_path / "short" / "checkpoints").exists()
    bad = train(run, env={**rank_env(), "FLUXZERO_HOST_MEMORY_GIB": "lots"})
    assert (
        bad.returncode == 1
        and "environment variable FLUXZERO_HOST_MEMORY_GIB='lots' must be a positive number "
        "of GiB (the host memory this run may use); fix or unset it"
        in bad.stderr
    )


def test_the_host_need_is_the_memory_models(monkeypatch):
    """flux-dev with 44 of 57 blocks streamed and a bf16 EMA on the CPU: what `estimate` counts on the host (less
    its allowance for the running process), per rank on the machine; 20 GiB of it refuses, 64 fits."""
    from fluxzero import plan as memory
    from fluxzero.config import get_model_config
    from fluxzero.config.deepspeed.build import build, options_from
    from fluxzero.config.deepspeed.view import view
    from fluxzero.config.ema import EmaConfig
    from fluxzero.train import host_memory

    cfg = build(options_from(model="flux-dev", optimizer_mode="fused-adafactor-sr", zero_stage=0, offload_blocks=44))
    v, ds, model = view(cfg), {k: x for k, x in cfg.items() if k != "fluxzero"}, get_model_config("flux-dev")
    ema = EmaConfig(device="cpu", dtype="bf16")
    spec = memory.RunSpec(model, **memory.run_options_from_ds_config(cfg), ema="bf16", ema_device="cpu")
    for local in (1, 2):
        need, items = host_memory.run_host_need(
            model, ds, v, world=local, local_world=local, latent_sizes=[(64, 64)], ema=ema
        )
        est = memory.estimate(spec)
        process = next(i.bytes for i in est.items if i.name == memory.model_states.PROCESS_ITEM)
        assert need == local * (est.host_per_rank() - process)
        assert [name for name, _ in items] == ["EMA (bf16)", "streamed block weights (bf16, pinned)"]
    monkeypatch.setenv(host_memory.HOST_MEMORY_ENV, "20")
    assert host_memory.host_available() == 20 * 2**30
    assert host_memory.check_run(model, ds, v, world=1, local_world=1, ema=ema).startswith(
        "this run needs 36.0 GiB of host memory on this machine (EMA (bf16) 22.2 GiB, streamed block weights (bf16, "
        "pinned) 13.8 GiB), but FLUXZERO_HOST_MEMORY_GIB gives 20.0 GiB"
    )
    monkeypatch.setenv(host_memory.HOST_MEMORY_ENV, "64")
    assert host_memory.check_run(model, ds, v, world=1, local_world=1, ema=ema) is None
