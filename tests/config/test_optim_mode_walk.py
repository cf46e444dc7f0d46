"""Every optimizer mode is one object (fluxzero.config.optim_modes.OptimMode) that gen-config, check-config, the memory
model and the trainer read: each trainable mode walks gen-config -> check-config -> estimate -> a real DeepSpeed
engine on flux-tiny that takes a step, with nothing but its registry entry (and its builder) naming it."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from fluxzero.cli import main
from fluxzero.config import optim_modes
from fluxzero.config.models import get_model_config
from fluxzero.plan import FIT_MODES, MODE_STEP_TEMP, param_inventory
from tests.helpers import ONE_RANK

MODES = optim_modes.trainable_modes()


def _gen_args(mode: optim_modes.OptimMode) -> list[str]:
    """gen-config flags for the mode at its first ZeRO stage, with what the mode itself requires."""
    stage = mode.zero_stages[0]
    args = [
        "--model",
        "flux-tiny",
        "--optimizer-mode",
        mode.name,
        "--zero-stage",
        str(stage),
        "--micro-batch",
        "2",
        "--checkpoint-every",
        "0",
        "--scheduler",
        "none",
        "--steps-per-print",
        "1000000",
    ]
    if mode.needs_offload:
        args += ["--offload-optimizer", "cpu"]
    if mode.fused:
        args += ["--gradient-clipping", "0"]
    return args


def _write(tmp_path, name: str) -> str:
    mode = optim_modes.get_mode(name)
    out = tmp_path / f"{name}.json"
    r = CliRunner().invoke(main, ["gen-config", *_gen_args(mode), "-o", str(out)])
    assert r.exit_code == 0, r.output
    return str(out)


def test_the_registry_is_what_the_readers_read():
    from fluxzero.train.optim.optimizers import BUILDERS

    assert {m.builder for m in optim_modes.MODES.values()} <= set(BUILDERS)
    assert (None, *optim_modes.fit_modes()) == FIT_MODES
    assert set(MODE_STEP_TEMP) == {n for n, m in optim_modes.MODES.items() if not m.needs_offload}


@pytest.mark.parametrize("name", MODES)
def test_each_mode_writes_checks_and_estimates(tmp_path, name):
    mode = optim_modes.get_mode(name)
    path = _write(tmp_path, name)
    r = CliRunner().invoke(main, ["check-config", "--no-deepspeed", path])
    assert r.exit_code == 0 and f"optimizer mode {name}" in r.output, r.output
    r = CliRunner().invoke(main, ["estimate", "--model", "flux-tiny", "--ds-config", path, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    stage = mode.zero_stages[0]
    assert (d["optimizer_mode"], d["stage"]) == (name, stage)
    states = [i for i in d["items"] if i["name"].startswith("optimizer state") and name in i["name"]]
    total = param_inventory(get_model_config("flux-tiny")).total  # one GPU: the partition is the whole model
    assert len(states) == 1 and states[0]["gib"] * 2**30 == pytest.approx(mode.bytes_at(stage)["states"] * total, abs=1)


_ENGINES = (
    'import warnings\nwarnings.filterwarnings("ignore")\n'
    + ONE_RANK
    + r"""
import json, sys
from fluxzero.config import FlowConfig, get_model_config
from fluxzero.config.deepspeed.file import load_for_training
from fluxzero.data import build_dataloader
from fluxzero.train import engine as ds_engine, flow
for arg in sys.argv[1:]:
    path, step = arg.split("=")
    ds, v = load_for_training(path, 1)
    torch.manual_seed(0)
    engine = ds_engine.build_engine(get_model_config("flux-tiny"), ds, v, torch.device("cpu"), seed=0)
    before = [p.detach().float().clone() for p in engine.module.parameters()]
    batch = next(iter(build_dataloader("synthetic:n=4,hw=16x16,txt=16,ctx=64,vec=32", micro_batch=2, rank=0,
                                       world_size=1, seed=0)))
    inputs, target = flow.prepare_batch(batch, FlowConfig(), 0, 0, guidance_embed=True, dtype=torch.bfloat16)
    loss = flow.loss(engine(**inputs), target)
    engine.backward(loss)
    if step == "1":
        engine.step()
    moved = sum(int(not torch.equal(a, p.detach().float())) for a, p in zip(before, engine.module.parameters()))
    print("ROW " + json.dumps({"mode": v.optimizer_mode, "loss": float(loss), "moved": moved,
                               "client": type(engine.client_optimizer).__name__ if engine.client_optimizer else None}))
    engine.destroy()
"""
)


@pytest.mark.slow
def test_each_mode_builds_a_real_engine_that_steps(tmp_path):
    """The config gen-config wrote for each mode builds the trainer's engine on flux-tiny (DeepSpeed 0.19.8, one
    rank, CPU) with the mode's own optimizer, and one step moves the weights. torchao's optimizers compile a kernel
    per tensor at their first step (30-70 s each on this CPU): built and run through backward here, stepped by
    tests/config/test_ds_config_deepspeed.py::test_mode_configs_start_real_engines."""
    pytest.importorskip("torchao")
    steps = {name: not optim_modes.get_mode(name).builder.startswith("torchao.") for name in MODES}
    args = [f"{_write(tmp_path, name)}={int(steps[name])}" for name in MODES]
    r = subprocess.run([sys.executable, "-c", _ENGINES, *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {d["mode"]: d for d in (json.loads(ln[4:]) for ln in r.stdout.splitlines() if ln.startswith("ROW "))}
    assert set(rows) == set(MODES)
    for name, row in rows.items():
        assert (row["moved"] > 0) == steps[name] and row["loss"] == row["loss"], row
        if name != "fp32":  # fp32 masters: DeepSpeed's own AdamW; every other mode hands its own optimizer in
            assert row["client"] is not None, row
