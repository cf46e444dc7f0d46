"""The host modes under real DeepSpeed engines with optimizer offload (gloo, CPU; 1 rank, and 2 ranks as torchrun
starts them): same least-squares problem and 5% bar as test_optim_quality.py, against DeepSpeed's fp32 masters
(torch's AdamW, bf16 on, no offload) at ZeRO 2; the optimizer steps bf16 partitions in host memory; save, load into
a fresh engine, next step is bit-identical. No JIT build: the client optimizer replaces DeepSpeed's CPU Adam."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from tests.helpers import free_port, rank_vars  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BOUND = 0.05

WORKER = r"""
import json, os, sys, tempfile, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, os.getcwd())
import torch, deepspeed
from deepspeed.utils import safe_get_full_fp32_param
from fluxzero.train.distributed import init_distributed
from fluxzero.train.ds_patches import accept_host_optimizer
from fluxzero.train.engine import join_deepspeed_comm
init_distributed()
join_deepspeed_comm()
torch.set_num_threads(1)
from fluxzero.config.optim_modes import BF16_MASTER_KEYS
from fluxzero.train.optim.optimizers import build_optimizer
from tests.train.test_optim_quality import LR, STEPS, LeastSquares, LeastSquaresLayer

P = LeastSquares()


def Layer():
    return LeastSquaresLayer(P)


def engine(mode, stage, param_offload):
    torch.manual_seed(0)
    model = Layer()
    zero = {"stage": stage}
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    if mode == "fp32":
        cfg["bf16"] = {"enabled": True}
    else:  # what gen-config writes for a host mode
        cfg["bf16"] = dict(BF16_MASTER_KEYS)
        cfg["zero_force_ds_cpu_optimizer"] = False
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        if param_offload:
            zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    opt = build_optimizer(model.parameters(), mode, lr=LR)
    with accept_host_optimizer(opt):
        eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return eng, opt


def master(eng):
    full = safe_get_full_fp32_param(eng.module.weight)
    return full.float().clone()


def step(eng):
    eng.backward(eng())
    eng.step()


for mode, stage, param_offload in json.loads(sys.argv[1]):
    key = f"{mode}@{stage}" + ("+params" if param_offload else "")
    eng, opt = engine(mode, stage, param_offload)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(
        [[str(p.dtype), p.device.type, p.numel()] for g in o.param_groups for p in g["params"]]) if not seen else None)
    for _ in range(STEPS):
        step(eng)
    w = master(eng)
    row = {"dw": ((w - P.w0).norm() / P.w0.norm()).item(), "loss": P.loss_grad(w)[0], "stepped": seen[0]}
    eng, opt = engine(mode, stage, param_offload)
    for _ in range(5):
        step(eng)
    with tempfile.TemporaryDirectory() as tmp:
        ck = os.path.join(os.environ.get("FZ_CKPT_DIR", tmp), key)  # ranks share FZ_CKPT_DIR
        eng.save_checkpoint(ck, tag="s5")
        step(eng)
        eng2, _ = engine(mode, stage, param_offload)
        eng2.load_checkpoint(ck, tag="s5")
        torch.manual_seed(7)  # whatever the global generator does: the rounding noise is a hash of the step
        step(eng2)
        row["resume_max_diff"] = (master(eng) - master(eng2)).abs().max().item()
    print(json.dumps({key: row}), flush=True)
torch.distributed.destroy_process_group()
"""

CASES = [("fp32", 2, False), ("cpu-bf16-sr", 2, False), ("cpu-adamw8bit-sr", 3, False), ("cpu-bf16-sr", 3, True)]


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def _rows(stdout: str) -> dict:
    return {k: v for line in stdout.splitlines() if line.startswith("{") for k, v in json.loads(line).items()}


def _off(run, ref):
    return abs(run["dw"] / ref["dw"] - 1), abs(run["loss"] / ref["loss"] - 1)


@pytest.fixture(scope="module")
def runs():
    pytest.importorskip("torchao")
    r = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(CASES)],
        capture_output=True,
        text=True,
        timeout=800,
        cwd=ROOT,
        env=_env(),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "cpu_adam" not in r.stderr.lower()  # no DeepSpeedCPUAdam build was started
    return _rows(r.stdout)


@pytest.mark.slow
def test_host_modes_step_bf16_host_partitions_and_match_fp32_masters(runs):
    ref = runs["fp32@2"]
    assert ref["stepped"] == [["torch.float32", "cpu", 65536]]  # (a CPU machine: DeepSpeed's fp32 partition)
    for key in ("cpu-bf16-sr@2", "cpu-adamw8bit-sr@3", "cpu-bf16-sr@3+params"):
        assert runs[key]["stepped"] == [["torch.bfloat16", "cpu", 65536]], key
        dw, dl = _off(runs[key], ref)
        assert dw < BOUND and dl < BOUND, (key, dw, dl, runs[key])


@pytest.mark.slow
def test_host_modes_resume_exactly(runs):
    for key, run in runs.items():
        assert run["resume_max_diff"] == 0.0, (key, run["resume_max_diff"])


@pytest.mark.slow
def test_two_ranks_step_half_partitions_on_the_host_and_still_match(runs):
    """cpu-adamw8bit-sr at ZeRO 3 on 2 ranks: each rank steps half the bf16 partition in host memory; both see the
    same full-batch gradient, so the bar is the 1-rank fp32 reference's; resume exact on each rank."""
    port, ck = free_port(), tempfile.mkdtemp(prefix="fz-host-2rank-")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps([["cpu-adamw8bit-sr", 3, False]])],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(**rank_vars(r, 2, port), FZ_CKPT_DIR=ck),
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    shutil.rmtree(ck, ignore_errors=True)
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    for out, _ in outs:
        run = _rows(out)["cpu-adamw8bit-sr@3"]
        assert run["stepped"] == [["torch.bfloat16", "cpu", 32768]]
        dw, dl = _off(run, runs["fp32@2"])
        assert dw < BOUND and dl < BOUND, (dw, dl, run)
        assert run["resume_max_diff"] == 0.0
