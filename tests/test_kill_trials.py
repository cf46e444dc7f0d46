"""One kill -9 trial of benchmarks/kill_trials.py (the full set runs there; benchmarks/RESULTS.md has the counts):
a rank of a 2-rank ZeRO-2 run killed 0.1-35 ms after a checkpoint folder appeared, then resumed; the resumed run's
losses and final export must equal an uninterrupted run's bit for bit."""
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kill_trials  # noqa: E402


@pytest.mark.slow
def test_kill_during_a_checkpoint_save_resumes_bit_exact(tmp_path):
    ref = kill_trials.reference(tmp_path / "reference", stage=2)
    assert len(ref["losses"]) == kill_trials.STEPS and ref["export_sha256"]
    rec = kill_trials.trial("save", 2, tmp_path / "trial", random.Random(0), ref)
    assert rec["resume_exit"] == [0, 0] and not rec["resume_traceback"], rec
    assert not rec["survivor_traceback"], rec  # the rank left alive stops with one line, not a gloo traceback
    assert rec["losses_equal"] and rec["export_equal"], rec
