"""benchmarks/memory_calibration.py runs its cases through the trainer's code path: smoke-tested on CPU.

CPU gives no memory numbers (the GPU run does); this proves that a case builds gen-config's DeepSpeed config,
starts its own 2-process group, trains real steps under ZeRO-3 with checkpointing, and reports back.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_list_is_pure_and_predicts_every_case():
    r = subprocess.run(
        [sys.executable, "benchmarks/memory_calibration.py", "--grid", "dev2", "--list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| dev2-")]
    assert len(rows) >= 10 and "dev2-z2-ck1-mb1-512-fused-expandable" in r.stdout


@pytest.mark.slow
def test_tiny_zero3_case_trains_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OUT=str(tmp_path), OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "benchmarks/memory_calibration.py", "--grid", "tiny", "--cases", "tiny2-z3-ck2-mb1-64"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = (tmp_path / "memory_calibration.jsonl").read_text().splitlines()
    rec = json.loads(line)
    assert rec["measured"]["status"] == "ok", rec["measured"]
    assert rec["case"]["stage"] == 3 and rec["case"]["gpus"] == 2
    assert rec["predicted"]["allocated"] > 0 and rec["measured"]["host_per_node_rss"] > 0


def test_blocks_mode_matches_on_cpu(tmp_path):
    """--blocks counts what one block of each kind saves; on CPU memory.py is exact (device="cpu")."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OUT=str(tmp_path))
    r = subprocess.run(
        [
            sys.executable,
            "benchmarks/memory_calibration.py",
            "--blocks",
            "--blocks-model",
            "flux-tiny",
            "--blocks-px",
            "64,128",
            "--blocks-txt",
            "16",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(line) for line in (tmp_path / "memory_blocks.jsonl").read_text().splitlines()]
    assert len(recs) == 8  # 2 kinds x 2 resolutions x 2 attention kernels
    for rec in recs:
        assert rec["saved_gib"] == pytest.approx(rec["saved_pred_gib"], rel=1e-12), rec
