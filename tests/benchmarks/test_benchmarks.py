"""benchmarks/sweep.py and report.py: the GPU sweep's exact code path, end to end on CPU with flux-tiny."""

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"fluxzero_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


sweep = _load("sweep")
report = _load("report")


def test_named_sets_are_well_formed():
    for name, (fn, budget, _) in sweep.SETS.items():
        cases = fn()
        assert cases, name
        assert len({c.name for c in cases}) == len(cases), f"{name}: two cases share a name"
        # the budget must leave each case its own timeout at least for the first case
        assert budget >= cases[0].timeout, name
    # every baseline row has a fluxzero row with the same settings: the matched comparison exists
    for name in ("lite1", "dev2"):
        cases = sweep.SETS[name][0]()
        ours = {
            tuple(
                getattr(c, k) if k not in ("zero_opts", "env") else json.dumps(getattr(c, k)) for k in report.MATCH_KEYS
            )
            for c in cases
            if c.impl == "fluxzero"
        }
        base = [c for c in cases if c.impl == "diffusers"]
        assert len(base) == 2
        for c in base:
            key = tuple(
                getattr(c, k) if k not in ("zero_opts", "env") else json.dumps(getattr(c, k)) for k in report.MATCH_KEYS
            )
            assert key in ours, c.name
    dev2 = sweep.SETS["dev2"][0]()
    assert {c.gpus for c in dev2} == {2} and {c.model for c in dev2} == {"flux-dev"}
    assert {(c.res, c.img_tokens) for c in dev2} == {(512, 1024), (1024, 4096)}


def test_every_gpu_case_gets_a_config_deepspeed_accepts():
    # configs are refused here, in seconds, not on the GPU machine after its start-up
    from fluxzero.config.deepspeed import check as ds_check
    from fluxzero.config.deepspeed import validate as ds_validate
    from fluxzero.config.deepspeed import view as ds_view

    seen = set()
    for name, (fn, _, _) in sweep.SETS.items():
        for case in fn():
            ds = sweep.deepspeed_config(case, case.gpus)
            # what loop.setup (ds_file.load_for_training) refuses, in one sentence, on the GPU machine
            assert not ds_check.check(ds, case.gpus), (name, case.name, ds_check.check(ds, case.gpus))
            assert ds["train_batch_size"] == case.mb * case.gpus and ds["zero_optimization"]["stage"] == case.zero
            assert ds["optimizer"]["params"].get("fused") is (True if case.optim == "torch-fused" else None)
            assert ds["optimizer"]["params"]["torch_adam"] is (case.optim != "deepspeed-fused")
            key = json.dumps({k: v for k, v in ds.items() if k != ds_view.FLUXZERO_SECTION}, sort_keys=True)
            if key not in seen:
                seen.add(key)
                assert not ds_validate.deepspeed_problems(
                    {k: v for k, v in ds.items() if k != ds_view.FLUXZERO_SECTION}, case.gpus
                ), case.name


def test_run_file_is_one_the_trainer_accepts_and_its_data_covers_the_case(tmp_path):
    from fluxzero.config import TrainConfig
    from fluxzero.data import build_dataloader

    case = sweep.Case(**sweep._cpu(zero=2, mb=2, gpus=2, warmup=2, steps=3))
    cfg = TrainConfig(**sweep.run_file(case, 2, tmp_path / "ds.json", tmp_path / "run"))
    assert (cfg.steps, cfg.model, cfg.attention, cfg.checkpoint.resume, cfg.export.format) == (
        5,
        "flux-tiny",
        "auto",
        False,
        None,
    )
    # one epoch holds every step of the case: no epoch boundary among the timed steps
    loader = build_dataloader(cfg.data, micro_batch=2, rank=1, world_size=2, seed=0)
    assert len(loader) == case.total_steps
    batch = next(iter(loader))
    assert batch["latents"].shape == (2, 16, case.latent, case.latent) and batch["t5"].shape[1] == case.txt
    # a shard folder replaces the synthetic source, and the case's name says so
    shards = sweep.Case(**sweep._cpu(zero=2, mb=2), data=str(tmp_path / "my-shards"))
    assert sweep.run_file(shards, 1, "ds.json", "out")["data"] == str(tmp_path / "my-shards")
    assert shards.name.endswith("data=my-shards")


def test_sweep_refuses_a_data_folder_without_shards_in_one_line(tmp_path):
    p = subprocess.run(
        [sys.executable, "benchmarks/sweep.py", "--device", "cpu", "--data", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "no manifest.json there" in p.stderr and len(p.stderr.splitlines()) == 1


def test_case_validation_names_the_field():
    with pytest.raises(ValueError, match="optim"):
        sweep.Case(optim="sgd")
    with pytest.raises(ValueError, match="res must be a multiple of 16"):
        sweep.Case(res=500)


def test_timeout_and_budget_rows(tmp_path):
    # a case that cannot start within 1 s becomes a "timeout" row; once the budget is spent, "not run" rows
    cases = [sweep.Case(**sweep._cpu(zero=0, mb=1, timeout=1)), sweep.Case(**sweep._cpu(zero=0, mb=2))]
    rows = sweep.sweep("t", cases[:1], tmp_path, "cpu", budget=100, grace=1, peak_tflops=1.0)
    assert rows[0]["status"].startswith("timeout after 1 s") and rows[0]["valid"] is False
    timed_out = rows[0]
    rows = sweep.sweep("b", cases[1:], tmp_path, "cpu", budget=0, grace=1, peak_tflops=1.0)
    assert rows[0]["status"].startswith("not run") and rows[0]["valid"] is False
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 1
    # every row, measured or not, names the code it ran: this checkout's commit
    code = sweep.provenance.code_version()
    for r in (timed_out, rows[0]):
        assert {k: r["versions"][k] for k in ("git_commit", "git_dirty")} == code
    assert len(rows[0]["date"]) == len("2026-11-30 12:38:05 UTC")  # seconds: reruns within a minute stay apart


def _git(cwd, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True
    )


@pytest.mark.skipif(not shutil.which("git"), reason="needs git")
def test_code_version_commit_dirty_and_unknown(tmp_path, monkeypatch):
    prov = sweep.provenance
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    (repo / "a.txt").write_text("1")
    _git(repo, "init", "-q")
    _git(repo, "add", "a.txt")
    _git(repo, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert prov.code_version(repo) == {"git_commit": head, "git_dirty": False}
    (repo / "untracked.txt").write_text("x")  # untracked files do not make the tree dirty
    assert prov.code_version(repo)["git_dirty"] is False
    (repo / "a.txt").write_text("2")
    assert prov.code_version(repo) == {"git_commit": head, "git_dirty": True}
    # a copy of the tree without .git, even inside another repository, and a machine without git: "unknown"
    assert prov.code_version(repo / "sub") == prov.UNKNOWN
    assert prov.code_version(tmp_path) == prov.UNKNOWN
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert prov.code_version(repo) == prov.UNKNOWN


@pytest.mark.slow
def test_cpu_sweep_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [
            sys.executable,
            "benchmarks/sweep.py",
            "--set",
            "cpu-test",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
            "--grace",
            "5",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "cpu-test.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [1, 2, 3, 4]
    from fluxzero.config import get_model_config

    cfg = get_model_config("flux-tiny")
    for r in rows[:3]:
        if r["inject_nan"]:
            # a step with non-finite gradients was skipped by DeepSpeed: measured, but not a training speed
            assert r["skipped_steps"] == 1 and r["valid"] is False and r["status"] == "skipped steps"
            assert not math.isfinite(r["grad_norms_rank0"][r["warmup"]])
        else:
            assert r["status"] == "ok" and r["valid"] is True, r["name"]
            assert r["skipped_steps"] == 0
            assert all(math.isfinite(x) for x in r["losses_rank0"] + r["grad_norms_rank0"])
        assert len(r["step_s_all"]) == r["steps"] and len(r["losses_rank0"]) == r["warmup"] + r["steps"]
        assert min(r["step_s"], r["fwd_s"], r["bwd_s"], r["opt_s"]) > 0
        assert r["fwd_s"] + r["bwd_s"] + r["opt_s"] <= r["step_s"] * 1.05
        assert r["samples_per_s"] == pytest.approx(r["mb"] * r["gpus"] / r["step_s"])
        flops = 3 * cfg.flops_per_sample(r["img_tokens"], r["txt"]) * r["mb"] / r["step_s"]
        assert r["tflops_per_gpu"] == pytest.approx(flops / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] / r["peak_tflops"])
        assert len(r["peak_alloc_gib"]) == r["gpus"]
        assert "torch.optim.adamw.AdamW (fused=True" in r["optimizer"]  # "fused" reached torch's AdamW
        assert r["ds_config"]["zero_optimization"]["stage"] == r["zero"]
    # the fluxzero rows ran the trainer's own setup and TrainStep on its loader; the baseline its own step
    assert rows[0]["impl"] == "fluxzero" and rows[0]["engine_api"] == "fluxzero.train.loop.setup + TrainStep"
    assert rows[2]["engine_api"] == rows[0]["engine_api"] and rows[1]["engine_api"] == sweep.BASELINE_API
    assert rows[0]["ds_config_source"] == "fluxzero.config.deepspeed.build"
    assert rows[0]["data_source"].startswith("synthetic:n=12,hw=8x8,txt=16,")  # 2 ranks x mb 2 x 3 steps
    assert rows[0]["ds_config"]["fluxzero"]["activation_checkpointing"]["every_k_blocks"] == 1
    assert all(r["data_s"] > 0 for r in rows[:3])  # next(loader) + prepare_batch, timed by on_phase marks
    assert rows[1]["impl"] == "diffusers" and rows[1]["versions"]["diffusers"]
    assert rows[2]["ckpt"] == 2 and rows[2]["gpus"] == 1 and rows[2]["inject_nan"]
    assert rows[3]["status"] == "OOM at backward" and rows[3]["valid"] is False
    assert "[4/4]" in p.stdout and "OOM at backward" in p.stdout and "INVALID skipped steps" in p.stdout

    md = report.render(rows)
    assert "**OOM at backward**" in md and "**INVALID: skipped steps** (1 skipped)" in md
    assert "| tiny z3 bf16 ck1 mb2 64px auto 2g |" in md  # the matched fluxzero-vs-diffusers line
    if importlib.util.find_spec("matplotlib"):
        assert report.plot(rows, str(tmp_path / "sweep.png"))
        assert (tmp_path / "sweep.png").stat().st_size > 1000


def _tiny_shards(path, latent_hw, n):
    import torch

    from fluxzero.data import ShardWriter

    g = torch.Generator().manual_seed(0)
    with ShardWriter(path, samples_per_shard=4) as w:  # flux-tiny widths: T5 64, CLIP 32; 16 T5 tokens
        for i in range(n):
            w.add(
                torch.randn(16, *latent_hw, generator=g),
                torch.randn(16, 64, generator=g),
                torch.randn(32, generator=g),
                caption=f"sample {i}",
            )


@pytest.mark.slow
def test_cpu_sweep_on_real_shards(tmp_path):
    # 8x12 latents (64x96 px: 4x6 = 24 packed tokens) while the case says 64 px (16 tokens): the row's tokens
    # and FLOPs must come from what the trainer's loader read
    _tiny_shards(tmp_path / "shards", (8, 12), 8)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [
            sys.executable,
            "benchmarks/sweep.py",
            "--device",
            "cpu",
            "--model",
            "flux-tiny",
            "--zero",
            "2",
            "--mb",
            "2",
            "--res",
            "64",
            "--txt",
            "16",
            "--attn",
            "auto",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--data",
            str(tmp_path / "shards"),
            "--peak-tflops",
            "1",
            "--out",
            str(tmp_path / "o"),
            "--name",
            "shards",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (row,) = [json.loads(line) for line in (tmp_path / "o" / "shards.jsonl").read_text().splitlines()]
    assert row["status"] == "ok", row["status"]
    assert row["data_source"] == str((tmp_path / "shards").resolve()) and row["name"].endswith("data=shards")
    assert (row["img_tokens"], row["txt_tokens"]) == (24, 16)
    from fluxzero.config import get_model_config

    flops = 3 * get_model_config("flux-tiny").flops_per_sample(24, 16) * 2 / row["step_s"]
    assert row["tflops_per_gpu"] == pytest.approx(flops / 1e12)
    assert len(row["losses_rank0"]) == 3 and all(math.isfinite(x) for x in row["losses_rank0"])


def _row(index, impl="fluxzero", gpus=1, sps=1.0, alloc=10.0, **kw):
    case = sweep.Case(impl=impl, gpus=gpus, mb=4, **{k: v for k, v in kw.items() if k in ("zero", "mb", "compile")})
    row = {
        "set": "t",
        "index": index,
        "name": case.name,
        **sweep.dataclasses.asdict(case),
        "status": "ok",
        "valid": True,
        "samples_per_s": sps,
        "img_tokens_per_s": sps * 1024,
        "tflops_per_gpu": 100.0,
        "mfu": 0.25,
        "step_s": 4 * gpus / sps,
        "data_s": 0.01,
        "fwd_s": 0.1,
        "bwd_s": 0.2,
        "opt_s": 0.05,
        "peak_alloc_gib": [alloc] * gpus,
        "peak_reserved_gib": [alloc + 2] * gpus,
        "init_s": 3.0,
    }
    row.update({k: v for k, v in kw.items() if k not in ("zero", "mb", "compile")})
    return row


def test_profile_busy_time_is_a_union_of_kernel_spans():
    assert sweep._union([(5, 6), (0, 2), (1, 3), (2.5, 2.7)]) == pytest.approx(4.0)
    assert sweep._union([]) == 0.0


def test_report_comparison_scaling_and_plot(tmp_path):
    rows = [
        _row(
            1,
            sps=2.6,
            alloc=60.0,
            profile={
                "wall_s": 1.5,
                "gpu_busy_s": 1.2,
                "compute_busy_s": 1.0,
                "gpu_idle_s": 0.3,
                "exposed_comm_s": 0.2,
                "kernel_s": {"attention": 0.4, "gemm": 0.6},
            },
        ),
        _row(2, impl="diffusers", sps=2.0, alloc=80.0),
        _row(3, gpus=2, sps=4.94),
        _row(4, zero=3, status="OOM at backward", valid=False),
        _row(5, zero=2, status="skipped steps", valid=False, skipped_steps=2),
        # torch.compile'd blocks next to the eager row 1: compared with it, and not with the baseline
        _row(
            6,
            compile=True,
            sps=3.25,
            alloc=58.0,
            losses_rank0=[1.0, 0.5],
            compile_graphs=2,
            compile_graph_breaks=0,
            warmup_s_all=[61.2, 1.1, 1.0],
        ),
    ]
    rows[0]["losses_rank0"] = [1.0, 0.501]
    for r in rows[3:4]:
        for k in ("samples_per_s", "step_s"):
            r.pop(k)
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in reversed(rows)) + "\n")  # rows come back in case order
    loaded = report.load([path])
    assert [r["index"] for r in loaded] == [1, 2, 3, 4, 5, 6]
    md = report.render(loaded)
    # fluxzero vs the matched baseline row: speed, allocated and reserved, the target
    assert "| t#1 / t#2 | 2.60 | 2.00 | 1.30x | 60.00 / 80.00 (-20.00) | 62.00 / 82.00 (-20.00) | met |" in md
    assert md.count("| 1.30x |") == 1 and "| 3.25 | 2.00 |" not in md  # the compiled row is not matched with it
    assert "| 2.60 | 3.25 | 1.25x | 58.0 vs 60.0 GiB | 2.0e-03 | 2 / 0 | 61 |" in md  # compiled vs eager twin
    assert "| 2.60 | 4.94 | 1.90x (95% efficiency) |" in md  # 2 GPUs vs 1 at the same per-GPU batch
    assert "**OOM at backward**" in md and "**INVALID: skipped steps** (2 skipped)" in md
    assert "| 1.500 | 1.200 | 0.300 | 0.200 | 0.400 | 0.600 | 0.000 |" in md  # the profiled row
    if importlib.util.find_spec("matplotlib"):
        assert report.plot(loaded, str(tmp_path / "t.png")) and (tmp_path / "t.png").stat().st_size > 1000


def test_report_pairs_measured_rows_of_the_same_sweep_and_lists_repeats():
    # the committed case: lite1 measured the matched pair; a later sweep (lite_after) left the fluxzero case "not
    # run". The old report kept the last row per configuration and printed the pair as "not run".
    a = dict(set="lite1", date="2026-11-30 12:38 UTC", parallel=2)
    fz = _row(3, sps=11.82, alloc=59.3, **a)
    base = _row(5, impl="diffusers", sps=11.81, alloc=59.0, **a)
    later = _row(
        2, set="lite_after", date="2026-11-30 12:51 UTC", status="not run (sweep budget 55 s spent)", valid=False
    )
    for k in ("samples_per_s", "step_s"):
        later.pop(k)
    md = report.render([fz, base, later])
    assert "| lite1#3 (parallel 2) / lite1#5 (parallel 2) | 11.82 | 11.81 | 1.00x | 59.30 / 59.00 (+0.30) |" in md
    assert "missed: 1.00x < 1.3x, allocated +0.30 GiB, reserved +0.30 GiB |" in md  # each miss, with its numbers
    assert "not run (sweep budget 55 s spent) | 11.81" not in md
    # the duplicate is listed, not hidden
    assert "lite1#3 (parallel 2) 2026-11-30 12:38 UTC: 11.82 samples/s" in md
    assert "lite_after#2 2026-11-30 12:51 UTC: not run (sweep budget 55 s spent)" in md
    # a configuration that never ran anywhere still shows why
    md = report.render([later, _row(9, impl="diffusers", sps=1.0, set="lite_after", date=later["date"])])
    assert "| lite_after#2 / lite_after#9 | not run (sweep budget 55 s spent) | 1.00 | - |" in md


def test_report_scaling_shows_every_one_gpu_row_same_sweep_first(tmp_path):
    early = _row(13, sps=10.46, set="lite1", date="12:38", parallel=2, step_s_all=[0.75, 0.79])
    one = _row(1, sps=8.785, set="scale", date="12:50", step_s_all=[0.79, 0.93, 0.91])
    two = _row(2, gpus=2, sps=17.167, set="scale", date="12:50")
    path = tmp_path / "scale.jsonl"  # a rerun under the same --name appends a second sweep to the file
    path.write_text("".join(json.dumps(r) + "\n" for r in (two, early, one)))
    assert [(r["date"], r["index"]) for r in report.load([path])] == [("12:38", 13), ("12:50", 1), ("12:50", 2)]
    md = report.render([early, one, two])
    lines = [ln for ln in md.splitlines() if "efficiency" in ln]
    assert lines[0].endswith("| scale#1 / scale#2 | 8.79 | 17.17 | 1.95x (98% efficiency) |")
    assert lines[1].endswith(
        "| lite1#13 (parallel 2) / scale#2 | 10.46 | 17.17 | 1.64x (82% efficiency); rows from different sweeps |"
    )
    assert "| 0.911 (0.79-0.93) |" not in md and "(0.79-0.93)" in md  # the step range sits next to the median
    assert "scale#1 12:50: 8.79 samples/s, timed steps 0.79-0.93 s (n=3)" in md


def test_report_header_has_each_sweeps_peak_date_and_code():
    a = _row(
        1,
        set="lite1",
        date="2026-11-30 12:38 UTC",
        parallel=2,
        peak_tflops=774.8,
        versions={"torch": "2.11.0", "deepspeed": "0.19.8", "device": "NVIDIA H200"},
    )
    b = _row(
        1,
        set="dev2",
        date="2026-11-30 12:44 UTC",
        peak_tflops=759.5,
        versions={
            "torch": "2.11.0",
            "deepspeed": "0.19.8",
            "device": "NVIDIA H200",
            "git_commit": "0123456789abcdef0123456789abcdef01234567",
            "git_dirty": True,
        },
    )
    md = report.header([a, b])
    assert "| lite1 | 2026-11-30 12:38 UTC | 1 (1) | 2 | NVIDIA H200 | 774.8 | 2.11.0 |" in md
    assert "| dev2 | 2026-11-30 12:44 UTC | 1 (1) | 1 | NVIDIA H200 | 759.5 |" in md
    assert md.count("not recorded") == 1 and "0123456789 +changes |" in md


def _stamped(d: dict) -> None:
    """A result names when it ran (UTC, to the second) and what it ran on, code included."""
    import time

    time.strptime(d["date"], "%Y-%m-%d %H:%M:%S UTC")
    v = d["versions"]
    assert v["torch"] and v["deepspeed"] and v["python"] and "cuda" in v
    assert {k: v[k] for k in ("git_commit", "git_dirty")} == sweep.provenance.code_version()


def test_bench_blocks_json_records_time_and_versions(tmp_path, monkeypatch):
    pytest.importorskip("diffusers")
    bench = _load("bench_blocks")
    monkeypatch.setenv("OUT", str(tmp_path))
    bench.main(["--device", "cpu", "--tiny", "--dtype", "fp32", "--batches", "1", "--iters", "1", "--warmup", "0"])
    result = json.loads((tmp_path / "bench_blocks.json").read_text())
    _stamped(result)
    assert result["versions"]["diffusers"] == result["diffusers"]


_FAKE_PIP = """#!/bin/sh
# stands in for `python3 -m pip ...` in benchmarks/device_wheels.sh: download/wheel write files, install nothing
shift 2; cmd=$1; shift; out=""; pkgs=""; sdist=""
while [ $# -gt 0 ]; do
  case $1 in
    -d|-w) out=$2; shift;;
    --no-binary=*) sdist=1;;
    --python-version|--implementation|--platform) shift;;
    -*) ;;
    *) pkgs="$pkgs $1";;
  esac; shift
done
echo "$cmd$pkgs" >> "$FAKE_LOG"
if [ "$cmd" = download ] && [ -n "$sdist" ]; then
  v=${pkgs#*==}; mkdir -p "$out/deepspeed-$v"; tar czf "$out/deepspeed-$v.tar.gz" -C "$out" "deepspeed-$v"
elif [ "$cmd" = download ]; then
  for p in $pkgs; do touch "$out/$(echo "$p" | sed 's/==/-/')-py3-none-any.whl"; done
elif [ "$cmd" = wheel ]; then
  touch "$out/$(basename "$PWD")-py3-none-any.whl"
fi
"""


@pytest.mark.skipif(not shutil.which("bash") or not shutil.which("tar"), reason="needs bash and tar")
def test_device_wheels_empties_the_folder_and_its_pins_are_in_the_readme(tmp_path):
    script = ROOT / "benchmarks" / "device_wheels.sh"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(_FAKE_PIP)
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "log")}
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "deepspeed-0.18.0-py3-none-any.whl").write_text("stale")
    p = subprocess.run(["bash", str(script), str(wheels)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = sorted(x.name for x in wheels.iterdir())
    assert "deepspeed-0.18.0-py3-none-any.whl" not in got and "deepspeed-0.19.8-py3-none-any.whl" in got
    assert "diffusers-0.42.1-py3-none-any.whl" in got and len(got) == 9  # the PINS wheels and deepspeed
    # a folder holding anything but wheels is refused with one sentence, and nothing in it is deleted
    (wheels / "notes.txt").write_text("mine")
    p = subprocess.run(["bash", str(script), str(wheels)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "holds files other than wheels" in p.stderr and len(p.stderr.splitlines()) == 1
    assert (wheels / "notes.txt").exists() and (wheels / "diffusers-0.42.1-py3-none-any.whl").exists()
    # the README lists every pin, and its device command lines stop when the install fails
    text = script.read_text()
    pins = text.split('PINS="')[1].split('"')[0].split() + ["deepspeed==" + text.split("DS_VERSION:-")[1].split("}")[0]]
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    assert [x for x in pins if f"`{x}`" not in readme] == []
    installs = [ln for ln in readme.splitlines() if "pip install -q --no-index" in ln]
    assert installs and all(".whl/*.whl || exit 1;" in ln for ln in installs)
    assert "../shared/" not in readme  # .whl/ itself is in .gitignore


@pytest.mark.parametrize("name", ["fit-lora16-512px-24gb", "fit-lora16-512px-24gb-fp8mm", "fit-full-512px-80gb"])
def test_capped_runs_reads_what_fit_writes_and_prints(tmp_path, name):
    """The `fit` set runs what `gen-config --fit` chose: its micro batch, its lora: line and its predicted peak come
    from the CLI's own output, so a change of that wording must show here, not as empty rows on a GPU."""
    capped = _load("capped_runs")
    case = next(c for c in capped.SETS["fit"] if c.name == name)
    chose = capped._gen_config(case, tmp_path / "ds.json")
    config = json.loads((tmp_path / "ds.json").read_text())
    assert chose["micro_batch"] == config["train_micro_batch_size_per_gpu"] >= 1
    assert chose["fit_chose"].startswith("chose ZeRO-") and chose["fit_predicted_gib"] > 1
    if "--base-quant" in case.fit:  # pinned: the lora: line names it, and the base stays resident
        assert chose["lora"]["rank"] == 16 and chose["lora"]["base_quant"] == "fp8-matmul"
        assert config["fluxzero"].get("offload_blocks", 0) == 0
    elif "--lora-rank" in case.fit:
        # the 24 GB choice: a bf16 base with its last 40 blocks streamed from host memory
        assert chose["lora"]["rank"] == 16 and chose["lora"].get("base_quant", "none") == "none"
        assert config["fluxzero"]["offload_blocks"] == 40
    else:
        assert "lora" not in chose


def test_every_capped_runs_case_without_fit_writes_its_config(tmp_path):
    """The hand-written cases (lora24, lora-defaults, fused): gen-config takes each one's arguments, and the JSON says
    what the case is named for (its stage, micro batch and streamed blocks)."""
    capped = _load("capped_runs")
    for name, cases in capped.SETS.items():
        for case in (c for c in cases if c.fit is None and not name.startswith("cpu")):
            path = tmp_path / f"{case.name}.json"
            assert capped._gen_config(case, path) == {}, case.name
            config = json.loads(path.read_text())
            assert config["train_micro_batch_size_per_gpu"] == case.micro_batch, case.name
            stage = case.gen_config[case.gen_config.index("--zero-stage") + 1]
            assert config["zero_optimization"]["stage"] == int(stage), case.name
            if "--offload-blocks" in case.gen_config:
                blocks = case.gen_config[case.gen_config.index("--offload-blocks") + 1]
                assert config["fluxzero"]["offload_blocks"] == int(blocks), case.name


PEER_FEED = r"""
import json, sys, threading
sys.path.insert(0, "benchmarks")
import sweep
from fluxzero.config import TrainConfig
from fluxzero.train import distributed

rank, world, device = distributed.init_distributed()
out = {}
for prefetch in (0, 1):
    case = sweep.Case(**sweep._cpu(impl="diffusers", zero=2, ckpt=0, mb=2, workers=None))
    ds = f"{sys.argv[1]}/ds{prefetch}.json"
    open(ds, "w").write(json.dumps(sweep.deepspeed_config(case, world)))
    cfg = TrainConfig(**{**sweep.run_file(case, world, ds, f"{sys.argv[1]}/o{prefetch}"), "prefetch_batches": prefetch})
    engine, step = sweep.baseline_runner(case, cfg, rank, world, device, hook=lambda name: None)
    losses = [step().loss for _ in range(3)]
    ahead = any(t.name == "fluxzero-prefetch" and t.is_alive() for t in threading.enumerate())
    step.close()
    out[prefetch] = {"losses": losses, "prefetch_thread": ahead}
print("RESULT " + json.dumps(out))
"""


def test_the_peer_gets_its_batches_the_way_the_trainer_does(tmp_path):
    """The diffusers peer's step takes batches the trainer's prefetch thread prepared ahead of it (before, it read
    and prepared each batch inside its timed step, which the trainer does not), and the numbers are the same."""
    p = subprocess.run(
        [sys.executable, "-c", PEER_FEED, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert out["1"]["prefetch_thread"] and not out["0"]["prefetch_thread"]
    assert out["1"]["losses"] == out["0"]["losses"]
