"""benchmarks/bench_blocks.py runs end to end on CPU (the GPU run is the same code at full width)."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_blocks.py"


def test_bench_blocks_cpu_smoke(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bench_blocks", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("OUT", str(tmp_path))
    bench.main(["--device", "cpu", "--tiny", "--dtype", "fp32", "--iters", "1", "--warmup", "0"])
    result = json.loads((tmp_path / "bench_blocks.json").read_text())
    assert [(r["block"], r["batch"]) for r in result["rows"]] == [
        ("double", 1),
        ("double", 4),
        ("single", 1),
        ("single", 4),
    ]
    for r in result["rows"]:
        assert r["ours_ms"] > 0 and r["diffusers_ms"] > 0
        assert r["max_abs_diff"] <= 1e-5 * r["max_abs_output"]  # same weights, fp32: same outputs
    assert "| double | 4 |" in capsys.readouterr().out
