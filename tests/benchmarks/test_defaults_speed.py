"""benchmarks/defaults_speed.py's cases without a GPU: every case's gen-config arguments make a config that
`fluxzero gen-config` writes (and so DeepSpeed's parser accepts), every peer case is a command benchmarks/sweep.py
takes, and every named set names known cases. A typo in a case costs a GPU call otherwise."""

from __future__ import annotations

import json

from click.testing import CliRunner

from fluxzero.cli import main as cli
from tests.benchmarks.test_benchmarks import _load, sweep

ds = _load("defaults_speed")


def test_every_case_is_a_config_gen_config_writes(tmp_path):
    failed = {}
    for name in ds.CASES:
        out = tmp_path / f"{name}.json"
        r = CliRunner().invoke(cli, ["gen-config", *ds.gen_config_args(name), "-o", str(out)])
        if r.exit_code or not out.is_file():
            failed[name] = r.output[-300:]
            continue
        cfg = json.loads(out.read_text())
        lora = ds.CASES[name][4]
        if "--fit" in ds.CASES[name][2] and lora:  # --fit sized the LoRA it was told of, not a full fine-tune
            assert "--lora-rank" in ds.gen_config_args(name) and cfg["optimizer"]["params"]["lr"] == 1e-4, name
    assert not failed, failed


def test_every_peer_case_is_a_sweep_command_and_every_set_names_known_cases():
    for name, args in ds.PEERS.items():
        a = sweep.parse_args(["--impl", "diffusers", "--res", "512", *args])
        assert a.impl == ["diffusers"] and a.compile == [0 if name.endswith("-eager") else 1], name
        assert a.lora_rank == (16 if "lora" in name else 0), name
    assert sweep.parse_args(["--impl", "diffusers", "--res", "512", *ds.PEERS["peer:lora-1024-mb1"]]).res == [1024]
    for name, cases in ds.SETS.items():
        assert set(cases) <= set(ds.CASES) | set(ds.PEERS), name


def test_a_peer_row_records_the_largest_rank_peak_the_sweep_wrote():
    # benchmarks/sweep.py writes peak_alloc_gib, one value per rank (None off CUDA); the peer rows read other keys
    # before and recorded no peak at all
    assert ds._sweep_peak_gb({"peak_alloc_gib": [60.0, 61.5]}) == round(61.5 * 2**30 / 1e9, 3)
    assert ds._sweep_peak_gb({"peak_alloc_gib": [None]}) is None


def test_a_peer_row_runs_the_sweep_with_the_trainers_workers_and_records_its_data_wait(tmp_path):
    """defaults_speed's peer row on the CPU: the sweep's diffusers baseline with `--workers auto` (the trainer's
    own worker count) and the step's wait for its batch recorded beside its samples/s."""
    row = ds.run_peer("peer:cpu-smoke-eager", tmp_path / "w", timeout=240)
    assert row["status"] == "ok" and row["samples_per_s"] > 0, row
    assert row["data_s"] is not None and 0 <= row["data_s"] < row["step_s"], row
    sweep_rows = [json.loads(line) for f in (tmp_path / "w").glob("*.jsonl") for line in f.read_text().splitlines()]
    assert "workers=auto" in sweep_rows[-1]["name"]
