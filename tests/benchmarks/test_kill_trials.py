"""One kill -9 trial of benchmarks/kill_trials.py (the full set runs there; benchmarks/RESULTS.md has the counts):
a rank of a 2-rank ZeRO-2 run killed 0.1-35 ms after a checkpoint folder appeared, then resumed; the resumed run's
losses and final export must equal an uninterrupted run's bit for bit."""
import importlib.util
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _kill_trials():
    spec = importlib.util.spec_from_file_location("fluxzero_bench_kill_trials", ROOT / "benchmarks" / "kill_trials.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_kill_during_a_checkpoint_save_resumes_bit_exact(tmp_path):
    kill_trials = _kill_trials()
    ref = kill_trials.reference(tmp_path / "reference", stage=2)
    assert len(ref["losses"]) == kill_trials.STEPS and ref["export_sha256"]
    rec = kill_trials.trial("save", 2, tmp_path / "trial", random.Random(0), ref)
    assert rec["resume_exit"] == [0, 0] and not rec["resume_traceback"], rec
    assert not rec["survivor_traceback"], rec  # the rank left alive stops with one line, not a gloo traceback
    assert rec["losses_equal"] and rec["export_equal"], rec
