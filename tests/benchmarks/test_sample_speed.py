"""benchmarks/sample_speed.py end to end on CPU: flux-tiny, a tiny VAE, 2 steps (the GPU run is the same code with
flux-dev, FLUX.1's VAE shapes and 28 steps). CPU timings are noise here; what is checked is that every row runs
the command's and the pipeline's own code, that both sides make the same images, and the JSON the lead reads."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "sample_speed.py"
SMOKE = [
    "--device",
    "cpu",
    "--size",
    "32",
    "--steps",
    "2",
    "--runs",
    "1",
    "--warmup-steps",
    "1",
    "--t5-tokens",
    "8",
    "--tiny-vae",
    "--images",
    "2",
]


def _bench():
    spec = importlib.util.spec_from_file_location("sample_speed", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _rows(path: Path) -> dict:
    return {r["row"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_sample_speed_cpu_smoke(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "rows.jsonl"
    assert bench.main([*SMOKE, "--rows", "fluxzero,diffusers,fluxzero-batch4", "--out", str(out)]) == 0
    rows = _rows(out)
    assert list(rows) == ["fluxzero", "diffusers", "fluxzero-batch4", "summary"]
    for name in ("fluxzero", "diffusers", "fluxzero-batch4"):
        r = rows[name]
        assert r["status"] == "ok" and len(r["run_s"]) == 1 and r["step_s"] > 0 and r["loop_s"] > 0
        assert r["images_vs"] == "fluxzero" and r["images_match"]
        assert r["image_max_abs_levels"] <= 1  # fp32: the same noise, grid and model give the same pixels
        assert r["versions"]["diffusers"] and r["model"] == "flux-tiny"
    assert (rows["fluxzero"]["calls"], rows["fluxzero-batch4"]["calls"]) == (2, 1)  # --batch-size 1 vs 4
    speedups = rows["summary"]["speedup_vs_diffusers"]  # the eager pipeline's median / the row's
    assert set(speedups) == {"fluxzero", "diffusers", "fluxzero-batch4"} and speedups["diffusers"] == 1.0
    assert speedups["fluxzero"] == round(rows["diffusers"]["median_s"] / rows["fluxzero"]["median_s"], 3)
    assert "| fluxzero-batch4 |" in capsys.readouterr().out


def test_sample_speed_catches_other_work(tmp_path, monkeypatch):
    """A pipeline on another time grid (schnell's unshifted scheduler) makes other images: the row says so."""
    bench = _bench()
    from diffusers import FlowMatchEulerDiscreteScheduler

    monkeypatch.setattr(
        bench, "scheduler", lambda: FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
    )
    out = tmp_path / "rows.jsonl"
    assert bench.main([*SMOKE, "--rows", "fluxzero,diffusers", "--out", str(out)]) == 0
    assert not _rows(out)["diffusers"]["images_match"]


def test_ema_update_cpu_smoke(tmp_path):
    """--ema on the trainer's own run with the optimizer mode --fit picks for FLUX.1-dev on one H200 (bf16-kahan,
    ZeRO-0: the EMA averages the bf16 weights in fp32). In its own process: it starts a process group."""
    out = tmp_path / "ema.jsonl"
    p = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--device",
            "cpu",
            "--ema",
            "--ema-updates",
            "3",
            "--ema-resolution",
            "64",
            "--gen-config-extra",
            "--optimizer-mode bf16-kahan",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    r = _rows(out)["ema-update"]
    assert r["status"] == "ok" and r["ds_config"]["fluxzero"]["optimizer_mode"] == "bf16-kahan"
    assert (r["ema_kind"], r["ema_dtype"], r["master_dtype"], r["ema_config"]["every"]) == (
        "params",
        "float32",
        "bfloat16",
        1,
    )
    assert r["ema_bytes"] == 4 * r["ema_numel"] and r["updates"] == 3 and r["median_update_s"] > 0
    assert r["check"].startswith("ok: "), r["check"]  # one more update against a reference computed apart
    assert "| EMA update |" in p.stdout


def test_sample_speed_speed_option_rows_and_profile(tmp_path):
    """The rows of the command's speed options (--compile, --attention cudnn, all at once) and diffusers under
    cuDNN attention, each with --profile: the options reach the model, the images stay the first row's (fp32:
    cuDNN runs as math on the CPU, compiled blocks compute what eager ones do), and the profile table is written.
    Dynamo's eager backend: the wiring, in seconds (Inductor's numbers: tests/sampling/test_sampling.py)."""
    bench = _bench()
    out = tmp_path / "rows.jsonl"
    rows_run = ["fluxzero", "fluxzero-compile", "fluxzero-cudnn", "fluxzero-fast", "diffusers-cudnn"]
    assert (
        bench.main([*SMOKE, "--rows", ",".join(rows_run), "--profile", "--compile-backend", "eager", "--out", str(out)])
        == 0
    )
    rows = _rows(out)
    assert list(rows) == [*rows_run, "summary"]
    for name in rows_run:
        r = rows[name]
        assert r["status"] == "ok" and r["images_match"] and r["image_max_abs_levels"] <= 1, (name, r)
        p = r["profile"]
        assert p["timing"] == "CPU operator self time" and p["wall_ms"] > 0 and p["events"] > 0
        assert set(p["ms"]) == {"attention", "matmul", "other", "host_gaps"} and p["ms"]["matmul"] > 0
        assert abs(sum(p["ms"].values()) - p["wall_ms"]) <= 0.01 * p["wall_ms"] + 0.01 or p["ms"]["host_gaps"] == 0
    assert rows["fluxzero-compile"]["options"] == dict(batch_size=1, compile=True, attention="any", grid=True)
    assert rows["fluxzero-fast"]["options"] == dict(batch_size=4, compile=True, attention="math", grid=False)
    assert rows["fluxzero-cudnn"]["options"]["attention"] == "math"  # no cuDNN attention on the CPU
    assert rows["diffusers-cudnn"]["options"]["cudnn"] and rows["fluxzero-fast"]["calls"] == 1
    assert set(rows["summary"]["speedup_vs_diffusers_cudnn"]) == set(rows_run)
    text = (tmp_path / "rows_profile.txt").read_text()
    assert "| fluxzero-fast | 2 |" in text and "top kernels" in text


def test_compile_rows_count_their_compile_in_the_budget():
    bench = _bench()
    args = bench.parse_args(["--device", "cpu", "--budget-s", "100", "--runs", "1", "--steps", "28"])
    import time

    t0 = time.monotonic()
    assert bench.fits("fluxzero-cudnn", args, t0, 20.0)  # ~21 s: fits
    assert not bench.fits("fluxzero-compile", args, t0, 20.0)  # + the compile allowance: does not
    assert not bench.fits("fluxzero-fast", args, t0, 20.0)
    args.profile = True
    assert bench.fits("fluxzero-cudnn", args, t0, 20.0)


def test_the_default_row_is_what_the_command_chooses():
    """The "fluxzero" row measures `fluxzero sample` at its defaults: on a GPU 4 images a call, eager, for the
    benchmark's 4 images of 28 steps at 1024 px, compiled from about 10 images on (it pinned one image a call,
    eager, after the command's defaults had changed); fluxzero-batch1 keeps the old row."""
    bench = _bench()
    assert bench.row_options("fluxzero", "cuda", 4, 28, 1024) == {
        "batch_size": 4,
        "compile": False,
        "attention": "any",
        "grid": True,
    }
    many = bench.row_options("fluxzero", "cuda", 12, 28, 1024)
    assert (many["batch_size"], many["compile"]) == (4, True)
    assert bench.row_options("fluxzero", "cpu", 4, 28, 1024)["batch_size"] == 1
    assert bench.row_options("fluxzero-batch1", "cuda", 4, 28, 1024)["batch_size"] == 1
