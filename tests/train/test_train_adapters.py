"""DoRA and LoKr (lora.type) in the trainer: ZeRO-0 against plain PyTorch + PEFT, ZeRO-3 (adapters and base
partitioned) against ZeRO-0, exact resume and the adapters' EMA at ZeRO-3, the LyCORIS export, and `fluxzero
export --as-lora-rank` on the checkpoint: one rank in one child process (DeepSpeed never runs in pytest's); and
on two spawned ranks ZeRO-3 and ZeRO-2 against plain PyTorch.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests.helpers import (
    TRAINER_CHILD,
    close_group,
    enter_training_rank,
    exit_rank,
    plain_losses,
    spawn_ranks,
    tiny_ds,
    tiny_weights,
)

ROOT = Path(__file__).resolve().parents[2]
DATA4 = "synthetic:n=4,hw=8x8,txt=4,ctx=64,vec=32"
LR = 1e-2
STEPS = 3
KINDS = {
    "dora": {"rank": 4, "alpha": 8, "targets": "all-linear", "type": "dora"},
    "lokr": {"rank": 4, "alpha": 8, "targets": "all-linear", "type": "lokr", "factor": 4},
}
LOSS_RTOL = 1e-5  # fp32: the stages differ from plain PyTorch in summation order only (test_train_lora.py)

_CHILD = (
    TRAINER_CHILD
    + """
from fluxzero.config import TrainConfig
results = {}
for name, cfg in json.load(open(sys.argv[1])):
    results[name] = train(TrainConfig.from_dict(cfg))["losses"]
json.dump(results, open(sys.argv[2], "w"))
"""
)


def _reference(weights, lora):
    """Plain PyTorch and PEFT: build_engine's order (seed, build, load, adapters), AdamW on the adapters."""
    from fluxzero.config import LoraConfig
    from fluxzero.model import build_model
    from fluxzero.model.lora import apply_lora
    from fluxzero.model.weights import load_weights

    torch.manual_seed(3)
    model = build_model("flux-tiny")
    model.load_state_dict(load_weights(weights, dtype=torch.float32))
    apply_lora(model, LoraConfig(**lora))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    return plain_losses(model, opt, DATA4, STEPS, 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    weights = tiny_weights(tmp / "base.safetensors")
    z3 = {"stage": 3, "stage3_param_persistence_threshold": 0}  # the adapters partitioned too
    for name, zero in {"z0": {"stage": 0}, "z3": z3}.items():
        ds = tiny_ds(
            zero["stage"],
            clipping=0.0,
            lr=LR,
            weight_decay=0.0,
            train_micro_batch_size_per_gpu=4,
            zero_optimization=zero,
        )
        (tmp / f"{name}.json").write_text(json.dumps(ds))
    jobs = []
    for kind, lora in KINDS.items():

        def job(name, ds, **kw):
            cfg = {
                "deepspeed": str(tmp / f"{ds}.json"),
                "data": DATA4,
                "output_dir": str(tmp / f"{kind}_{name}"),
                "weights": str(weights),
                "steps": STEPS,
                "seed": 3,
                "lora": lora,
                "export": {"format": "comfyui", "dtype": "fp32"},
            }
            return [f"{kind}_{name}", {**cfg, **kw}]

        ema = {"ema": {"decay": 0.5}, "export": {"format": "comfyui", "dtype": "fp32", "weights": "ema"}}
        # ZeRO-3 first: a ZeRO-3 build as the process's first model is what drew other adapters once
        # (engine._meta_outlives_zero_init)
        jobs += [
            job("z3", "z3", **ema),
            job("z0", "z0"),
            job("stop3", "z3", stop_after=2, **ema),
            job("resumed3", "z3", output_dir=str(tmp / f"{kind}_stop3"), **ema),
        ]
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp / "jobs.json"), str(tmp / "out.json")],
        cwd=ROOT,
        check=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return {
        "tmp": tmp,
        "weights": weights,
        "losses": json.loads((tmp / "out.json").read_text()),
        "reference": {kind: _reference(weights, lora) for kind, lora in KINDS.items()},
    }


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_adapters_train_under_zero_0_and_3_and_resume_exactly(runs, kind):
    r, ref = runs["losses"], runs["reference"][kind]
    assert r[f"{kind}_z0"] == pytest.approx(ref, rel=LOSS_RTOL) and ref[-1] != ref[0], (r[f"{kind}_z0"], ref)
    assert r[f"{kind}_z3"] == pytest.approx(ref, rel=LOSS_RTOL), (r[f"{kind}_z3"], ref)
    assert r[f"{kind}_stop3"] + r[f"{kind}_resumed3"] == r[f"{kind}_z3"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_exports_hold_the_trained_adapters_and_their_ema(runs, kind):
    from fluxzero.config import LoraConfig
    from fluxzero.model import adapters as AD
    from fluxzero.model.weights import load_weights
    from fluxzero.train.export.consolidate import consolidated_state_dict, ema_state_dict
    from fluxzero.train.export.lora import canonical_lora

    tmp, lcfg = runs["tmp"], LoraConfig(**KINDS[kind])
    base = load_weights(runs["weights"], dtype=torch.float32)
    for run, file, ema in (("z0", "lora.safetensors", False), ("resumed3", "lora_ema.safetensors", True)):
        folder = tmp / f"{kind}_{'stop3' if run == 'resumed3' else run}"
        sd, tag_dir = consolidated_state_dict(folder)
        trained = canonical_lora(ema_state_dict(tag_dir) if ema else sd)
        if ema:  # decay 0.5: the EMA lags the trained adapters
            assert any(not torch.equal(trained[k], v) for k, v in canonical_lora(sd).items())
        want = AD.module_deltas(AD.trained_parts(trained, lcfg), base)
        parts, meta = AD.read_adapters(folder / file)  # the LyCORIS file, as its readers apply it
        got = AD.module_deltas(parts, base)
        assert meta["fluxzero.format"] == "lycoris" and set(got) == set(want)
        assert all(torch.allclose(got[m], want[m], rtol=1e-6, atol=1e-7) for m in want), run


@pytest.mark.slow
def test_export_as_a_plain_lora_from_the_checkpoint(runs):
    from fluxzero.cli import main as cli
    from fluxzero.model.lora_formats import read_lora

    tmp = runs["tmp"]
    for kind in KINDS:
        out = tmp / f"{kind}_plain.safetensors"
        r = CliRunner().invoke(
            cli,
            [
                "export",
                str(tmp / f"{kind}_z0"),
                str(out),
                "--format",
                "diffusers",
                "--as-lora-rank",
                "64",
                "--max-error",
                "1e-5",
                "--dtype",
                "fp32",
            ],
        )
        assert r.exit_code == 0 and "plain LoRA of rank 64" in r.output, r.output
        assert r.output.count("double_blocks.0.img_attn.qkv") == 1 and "overall" in r.output
        sd, info = read_lora(out)
        assert info.rank == 64 and len(sd) == 2 * 26  # flux-tiny's all-linear: 26 linears
        refused = tmp / f"{kind}_refused.safetensors"
        r = CliRunner().invoke(
            cli, ["export", str(tmp / f"{kind}_z0"), str(refused), "--as-lora-rank", "1", "--max-error", "1e-9"]
        )
        assert r.exit_code == 2 and "above --max-error 1e-09" in r.output and not refused.exists(), r.output


def _worker(rank, world, port, jobs, out_file):
    enter_training_rank(rank, world, port)
    from fluxzero.config import TrainConfig
    from fluxzero.model import build_model
    from fluxzero.train.loop import train

    results, done = {}, False
    try:
        for name, cfg in jobs:
            results[name] = train(TrainConfig.from_dict(cfg))["losses"]
        results["meta"] = str(next(build_model("flux-tiny", device="meta").parameters()).device)
        done = True
    finally:
        close_group(done)
    exit_rank(rank, out_file, results)


@pytest.mark.slow
def test_adapters_on_two_ranks(runs, tmp_path):
    # 2 ranks x micro batch 2 = the reference's 4 samples a step: the same losses as plain PEFT at ZeRO-3 (the base
    # and the adapters partitioned) and ZeRO-2. ZeRO-3 runs first in each fresh rank, where a meta device context
    # broken by zero.Init made rank 0 draw other adapters (engine._meta_outlives_zero_init); `meta` checks that
    # context after all the runs
    z3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
    for stage, zero in ((3, z3), (2, {"stage": 2})):
        ds = tiny_ds(stage, clipping=0.0, lr=LR, weight_decay=0.0, zero_optimization=zero)
        (tmp_path / f"z{stage}.json").write_text(json.dumps(ds))
    jobs = [
        [
            f"{kind}{stage}",
            {
                "deepspeed": str(tmp_path / f"z{stage}.json"),
                "data": DATA4,
                "weights": str(runs["weights"]),
                "output_dir": str(tmp_path / f"{kind}{stage}"),
                "steps": STEPS,
                "seed": 3,
                "lora": lora,
                "export": {"format": None},
            },
        ]
        for stage in (3, 2)
        for kind, lora in KINDS.items()
    ]
    spawn_ranks(_worker, 2, jobs, str(tmp_path / "out.json"))
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["meta"] == "meta"
    for kind in KINDS:
        for stage in (3, 2):
            assert got[f"{kind}{stage}"] == pytest.approx(runs["reference"][kind], rel=LOSS_RTOL), (kind, stage, got)
