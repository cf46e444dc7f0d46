"""The optimizer modes through real DeepSpeed engines (one rank, gloo, CPU): quality and exact resume.

Same least-squares problem and 5% bar as test_optim_quality.py, now with DeepSpeed's bf16 forward/backward
and its ZeRO wrappers between the loss and the optimizer. Each mode runs at a stage it is meant for; the
reference is fp32 masters (DeepSpeed's own, bf16 on) with torch's AdamW / Adafactor at the same stage kind.
The engines run in one subprocess (DeepSpeed in the pytest process would leave a process group behind).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("torchao")

ROOT = Path(__file__).resolve().parents[2]
BOUND = 0.05

WORKER = r"""
import json, os, sys, tempfile, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, os.getcwd())  # the checkout: fluxzero, tests.train.test_optim_quality
import torch, deepspeed
from deepspeed.utils import safe_get_full_fp32_param
from fluxzero.train.distributed import init_distributed
from fluxzero.train.engine import join_deepspeed_comm
init_distributed()  # the trainer's own (a one-rank group when the 2-rank test sets no rank variables)
join_deepspeed_comm()
torch.set_num_threads(1)
from fluxzero.config.optim_modes import get_mode
from fluxzero.train.optim.optimizers import build_optimizer
from tests.train.test_optim_quality import LR, LR_ADAFACTOR, STEPS, LeastSquares, LeastSquaresLayer

P = LeastSquares()


def Layer():
    return LeastSquaresLayer(P)


def engine(mode, stage):
    mode, _, chunk = mode.partition(":")  # "bf16-kahan:16384": step the flat partition 16384 values at a time
    torch.manual_seed(0)
    model = Layer()
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10**9}
    if mode == "fp32-adafactor":  # the Adafactor reference: torch's on DeepSpeed's fp32 masters
        cfg["bf16"] = {"enabled": True}
        opt = torch.optim.Adafactor(model.parameters(), lr=LR_ADAFACTOR, foreach=False)
    else:
        bf16 = get_mode(mode).ds_bf16_section(stage)
        if bf16:
            cfg["bf16"] = bf16
        else:
            model = model.bfloat16()  # ZeRO 0, bf16 off: the engine steps the model's own bf16 weight
        lr = LR_ADAFACTOR if mode.startswith("adafactor") else LR
        opt = build_optimizer(model.parameters(), mode, lr=lr, allow_comparison_only=True)
        if chunk:
            opt.step_chunk = int(chunk)
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return eng, opt


def master(eng):
    # the tensor the optimizer holds (fp32 master, or the bf16 one), gathered under ZeRO-3
    p = eng.module.weight
    full = safe_get_full_fp32_param(p) if eng.zero_optimization_stage() else None
    return (full if full is not None else p.detach()).float().clone()


def step(eng):
    loss = eng()
    eng.backward(loss)
    eng.step()


out = {}
for mode, stage in json.loads(sys.argv[1]):
    eng, opt = engine(mode, stage)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(
        [[str(p.dtype), list(p.shape)] for g in o.param_groups for p in g["params"]]) if not seen else None)
    torch.manual_seed(1)
    for _ in range(STEPS):
        step(eng)
    w = master(eng)
    row = {"dw": ((w - P.w0).norm() / P.w0.norm()).item(), "loss": P.loss_grad(w)[0], "stepped": seen[0],
           "states": sorted({f"{k}:{type(v).__name__}" for st in opt.state.values() for k, v in st.items()})}
    # exact resume: save at 5 steps; step 6 here and in a fresh engine that loaded the checkpoint
    eng, opt = engine(mode, stage)
    for _ in range(5):
        step(eng)
    with tempfile.TemporaryDirectory() as tmp:
        ck = os.path.join(os.environ.get("FZ_CKPT_DIR", tmp), f"{mode}@{stage}")  # ranks share FZ_CKPT_DIR
        eng.save_checkpoint(ck, tag="s5")
        torch.manual_seed(7)
        step(eng)
        eng2, _ = engine(mode, stage)
        eng2.load_checkpoint(ck, tag="s5")
        torch.manual_seed(7)
        step(eng2)
        row["resume_max_diff"] = (master(eng) - master(eng2)).abs().max().item()
        row["resume_global_steps"] = [eng.global_steps, eng2.global_steps]
    out[f"{mode}@{stage}"] = row
    print(json.dumps({f"{mode}@{stage}": row}), flush=True)
torch.distributed.destroy_process_group()  # a gloo group left to interpreter teardown can abort the process
"""

CASES = [
    ("fp32", 2),
    ("bf16-rtn", 2),
    ("bf16-sr", 2),
    ("bf16-kahan", 3),
    ("adamw8bit-sr", 1),
    ("fp32-adafactor", 0),
    ("adafactor-sr", 0),
    ("bf16-kahan:16384", 3),
    ("adafactor-sr", 2),
    ("adafactor-sr:16384", 2),
]


def _env(**extra) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        **extra,
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get(
            "TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "fluxzero-inductor")
        ),
    }


def _rows(stdout: str) -> dict:
    rows = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            rows.update(json.loads(line))
    return rows


@pytest.fixture(scope="module")
def runs():
    r = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(CASES)],
        capture_output=True,
        text=True,
        timeout=800,
        cwd=ROOT,
        env=_env(),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _rows(r.stdout)
    assert sorted(rows) == sorted(f"{m}@{s}" for m, s in CASES)
    return rows


def _off(run, ref):
    return abs(run["dw"] / ref["dw"] - 1), abs(run["loss"] / ref["loss"] - 1)


@pytest.mark.slow
def test_bf16_master_modes_step_bf16_partitions_and_match_fp32_masters(runs):
    ref = runs["fp32@2"]
    assert ref["stepped"] == [["torch.float32", [65536]]]  # DeepSpeed's flat fp32 master partition
    for key in ("bf16-sr@2", "bf16-kahan@3", "adamw8bit-sr@1"):
        assert runs[key]["stepped"] == [["torch.bfloat16", [65536]]], key  # so stochastic rounding applies
        dw, dl = _off(runs[key], ref)
        assert dw < BOUND and dl < BOUND, (key, dw, dl, runs[key])
    # a 65536-value partition is a multiple of torchao's 256-value block, so the states really are 8-bit
    assert "exp_avg:OptimState8bit" in runs["adamw8bit-sr@1"]["states"]
    dw, dl = _off(runs["bf16-rtn@2"], ref)
    assert dw > BOUND and dl > BOUND, ("round-to-nearest should fail the bound", dw, dl)


@pytest.mark.slow
def test_adafactor_sr_keeps_shapes_at_zero0_and_matches_fp32_adafactor(runs):
    run, ref = runs["adafactor-sr@0"], runs["fp32-adafactor@0"]
    assert run["stepped"] == [["torch.bfloat16", [256, 256]]]  # 2-D: factored second moments
    assert "row_var:Tensor" in run["states"] and "variance:Tensor" not in run["states"]
    dw, dl = _off(run, ref)
    assert dw < BOUND and dl < BOUND, (dw, dl, run, ref)


@pytest.mark.slow
def test_chunked_steps_of_a_deepspeed_partition_equal_whole_ones(runs):
    """The 65536-value flat partition stepped 16384 values at a time (ZeRO 3 swaps it into the optimizer only
    for the step; ZeRO 2 hands over its own flat copy): the same weights to the last bit (CPU); resume is
    exact too (test_every_mode_resumes_exactly)."""
    for mode, stage in (("bf16-kahan", 3), ("adafactor-sr", 2)):
        whole, chunked = runs[f"{mode}@{stage}"], runs[f"{mode}:16384@{stage}"]
        assert chunked["stepped"] == whole["stepped"] == [["torch.bfloat16", [65536]]], mode
        assert "variance:Tensor" in runs["adafactor-sr@2"]["states"]  # flat: unfactored
        assert (chunked["dw"], chunked["loss"]) == (whole["dw"], whole["loss"]), (mode, chunked, whole)
        assert chunked["dw"] > 0.01  # the weights moved


@pytest.mark.slow
def test_every_mode_resumes_exactly(runs):
    for key, run in runs.items():
        assert run["resume_global_steps"] == [6, 6], key
        assert run["resume_max_diff"] == 0.0, (key, run["resume_max_diff"])


@pytest.mark.slow
def test_two_ranks_step_half_partitions_in_bf16_and_still_match(runs):
    """bf16-sr at ZeRO 2 on 2 ranks (two processes, as torchrun starts them): each rank steps half the flat
    bf16 partition; both see the same full-batch gradient, so the bar is the 1-rank fp32 reference's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ck = tempfile.mkdtemp(prefix="fz-optim-2rank-")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps([["bf16-sr", 2]])],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                OMP_NUM_THREADS="1",
                FZ_CKPT_DIR=ck,
            ),
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    shutil.rmtree(ck, ignore_errors=True)
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    for out, _ in outs:
        run = _rows(out)["bf16-sr@2"]
        assert run["stepped"] == [["torch.bfloat16", [32768]]]
        dw, dl = _off(run, runs["fp32@2"])
        assert dw < BOUND and dl < BOUND, (dw, dl, run)
        assert run["resume_max_diff"] == 0.0
