"""One kill -9 trial of benchmarks/kill_trials.py (the full set runs there; benchmarks/RESULTS.md has the counts):
a rank of a 2-rank run killed 0.1-35 ms after a checkpoint folder appeared, then resumed; the resumed run's losses
and final files (the export and every file of the final checkpoint, by sha256) must equal an uninterrupted run's.
A full fine-tune at ZeRO-2, a LoRA with an EMA (its shards in every checkpoint, its export at the end) at ZeRO-3,
and a full fine-tune in the fused mode (stage 0: each update applied in backward, two blocks streamed from the
host)."""

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
@pytest.mark.parametrize("stage, lora_ema, mode", [(2, False, None), (3, True, None), (0, False, "fused-adafactor-sr")])
def test_kill_during_a_checkpoint_save_resumes_bit_exact(tmp_path, stage, lora_ema, mode):
    kill_trials = _kill_trials()
    ref = kill_trials.reference(tmp_path / "reference", stage=stage, lora_ema=lora_ema, mode=mode)
    assert len(ref["losses"]) == kill_trials.STEPS and ref["export_sha256"]
    if lora_ema:
        assert ref["export"] == "lora_ema.safetensors" and any("ema_rank_00001" in f for f in ref["files"]), ref
    rec = kill_trials.trial("save", stage, tmp_path / "trial", random.Random(0), ref)
    assert rec["resume_exit"] == [0, 0] and not rec["resume_traceback"], rec
    assert not rec["survivor_traceback"], rec  # the rank left alive stops with one line, not a gloo traceback
    # every final file byte-identical, LoRA files included: their headers are written in a fixed order (issue 26
    # item 7), so a header in another key order fails here
    # (stage 0: DeepSpeed writes module and optimizer states into one file, no per-rank optimizer partitions)
    assert rec["losses_equal"] and rec["files_equal"] and rec["files_compared"] >= (7 if stage == 0 else 8), rec
