"""benchmarks/bucketed_speed.py end to end on CPU with flux-tiny: the GPU command's code path produces its rows
(launch/train.py and the diffusers peer, plain and with PEFT adapters, with Dynamo's automatic dynamic shapes off
and as it comes, on bucketed data). No timing is checked."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench(out: Path, *args: str) -> list[dict]:
    subprocess.run(
        [
            sys.executable,
            "benchmarks/bucketed_speed.py",
            "--res",
            "128",
            "--steps",
            "3",
            "--last",
            "2",
            "--data",
            "bucketed",
            "--timeout",
            "300",
            "--out",
            str(out),
            *args,
        ],
        check=True,
        cwd=ROOT,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.slow
def test_rows_for_the_trainer_and_the_peer_on_the_same_buckets(tmp_path):
    rows = _bench(tmp_path / "b.jsonl", "--workloads", "tiny")
    rows += _bench(tmp_path / "l.jsonl", "--workloads", "tiny-lora", "--impls", "peer")
    # --cache portable: another empty Inductor folder and the cold run's compile_cache.bin (eager on a CPU: none)
    portable = _bench(tmp_path / "p.jsonl", "--workloads", "tiny", "--impls", "fluxzero", "--cache", "portable")
    assert [(r["cache"], r["status"], r.get("compile_cache_bytes")) for r in portable] == [
        ("cold", "ok", None),
        ("portable", "ok", 0),
    ], [r.get("log_tail") for r in portable]
    assert [(r["impl"], r["workload"], r["status"]) for r in rows] == [
        ("fluxzero", "tiny", "ok"),
        ("peer-static", "tiny", "ok"),  # the default peer: Dynamo's automatic dynamic shapes off
        ("peer", "tiny-lora", "ok"),
    ], [r.get("log_tail") for r in rows]
    assert [r.get("automatic_dynamic_shapes") for r in rows] == [None, False, True]
    for r in rows:
        assert r["wall_s"] >= r["first_step_s"] > 0 and r["steady_samples_per_s"] > 0
        assert r["steady_wall_samples_per_s"] > 0 and r["recompiles"] == 0  # eager on the CPU
        assert r["data_spec"].startswith("synthetic:n=6,buckets=128,")
        assert r["versions"]["torch"] and "git_commit" in r["versions"]
    # both take their batches from the trainer's loader: the same bucket sequence
    assert rows[0]["img_tokens_per_step"] == rows[1]["img_tokens_per_step"]
    assert len(rows[0]["img_tokens_per_step"]) == 3


def test_recompiles_are_counted_with_their_guard_failures_from_torchs_own_log():
    from tests.benchmarks.test_benchmarks import _load

    code = (
        "import torch\n"
        "f = torch.compile(lambda x: x * 2, backend='eager', dynamic=False)\n"
        "f(torch.ones(3)); f(torch.ones(4)); f(torch.ones(5, 2))\n"
    )
    log = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "TORCH_LOGS": "recompiles"},
        timeout=300,
    ).stderr
    count, reasons = _load("bucketed_speed").recompiles(log)
    assert count == 2, log
    assert "size mismatch at index 0. expected 3, actual 4" in reasons[0] and "rank mismatch" in reasons[1]


@pytest.mark.parametrize("step, tokens", [(None, {1024, 1008, 960}), (64, {1024, 1008, 960}), (16, {1024, 999, 1014})])
def test_the_bucket_step_gives_the_buckets_fluxzero_cache_makes_with_it(step, tokens):
    """The photo mix as `fluxzero cache` buckets it at 512 px: by default (64 px sides) every image token count a
    multiple of 16; --bucket-step 16 gives 999 and 1014, which Inductor's alignment guard on attention splits."""
    from fluxzero.data.loader import open_source
    from tests.benchmarks.test_benchmarks import _load

    spec = _load("bucketed_speed").data_spec("flux-tiny", 512, "bucketed", n=10, bucket_step=step)
    assert {h * w // 4 for h, w in open_source(spec).latent_sizes()} == tokens
