"""Run file, DeepSpeed cross-checks, user errors of the trainer (exit 1, one sentence, no checkpoint harmed),
the `fluxzero train` / `fluxzero export` commands and the quick start.

DeepSpeed itself never runs in the pytest process (later fork-based DataLoader workers could hang): every
training case runs in one child process that calls fluxzero.train.loop.main once per case.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from fluxzero.config import FlowConfig, TrainConfig
from tests.helpers import TRAINER_CHILD, popen_ranks, tiny_ds

ROOT = Path(__file__).resolve().parents[2]
DATA = "synthetic:n=8,hw=8x8,txt=4,ctx=64,vec=32"


def _ds(**kw):
    return tiny_ds(**kw)


# ---------------------------------------------------------------------------------------------------------
# Pure: run file and cross-checks
# ---------------------------------------------------------------------------------------------------------
def test_load_config_with_overrides(tmp_path):
    from fluxzero.config.runfile import load_config

    run = tmp_path / "run.yaml"
    run.write_text("deepspeed: ds.json\ndata: d\noutput_dir: o\nsteps: 5\nflow:\n  guidance: 3.5\n")
    cfg = load_config(str(run), ["steps=7", "flow.shift=none", "weights=null", "export.format=diffusers"])
    assert cfg.steps == 7 and cfg.flow.shift == "none" and cfg.flow.guidance == 3.5
    assert cfg.weights is None and cfg.export.format == "diffusers"
    assert TrainConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg  # the saved run.yaml
    from fluxzero.config.runfile import ConfigError

    for over, match in [
        ("steps.x=3", "steps is a value, not a section"),
        ("flow.guidance.x=1", "flow.guidance is a value"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(str(run), [over])
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe")
    for path, match in [
        (tmp_path, "run file .* is a folder; pass a YAML"),
        (tmp_path / "bin.yaml", "is not a text file"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(str(path))


@pytest.mark.parametrize(
    "data, match",
    [
        ({"deepspeed": "a", "data": "b"}, "must set output_dir"),
        (
            {"deepspeed": "a", "data": "b", "output_dir": "c", "stpes": 3},
            r"unknown run-file keys \['stpes'\] \(did you mean 'steps' for 'stpes'\?\)",
        ),
        (
            {"deepspeed": "a", "data": "b", "output_dir": "c", "flow": {"shfit": "none"}},
            "unknown flow keys .* 'shift' for 'shfit'",
        ),
        (
            {"deepspeed": "a", "data": "b", "output_dir": "c", "precision": "fp8"},
            r"^precision is set in the DeepSpeed config now \(bf16.enabled / fp16.enabled in a\): remove it",
        ),
        ({"deepspeed": "a", "data": "b", "output_dir": "c", "model": "flux-huge"}, "unknown model preset"),
        (
            {"deepspeed": "a", "data": "b", "output_dir": "c", "micro_batch": 0},
            r"^micro_batch is set in the DeepSpeed config now \(train_micro_batch_size_per_gpu in a\)",
        ),
        ({"deepspeed": "a", "data": "b", "output_dir": "c", "steps": "abc"}, "steps must be a whole number, got 'abc'"),
        (
            {"deepspeed": "a", "data": "b", "output_dir": "c", "checkpoint": {"resume": "maybe"}},
            "checkpoint.resume must be true or false",
        ),
        ({"deepspeed": "a", "data": "b", "output_dir": 5}, "output_dir must be text"),
        (
            {"deepspeed": "a", "data": "b", "output_dir": "c", "flow": {"guidance": "x"}},
            "flow.guidance must be a number",
        ),
        ({"deepspeed": "a", "data": "b", "output_dir": " "}, "output_dir is empty"),
    ],
)
def test_bad_run_files(data, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_dict(data)


def test_home_folder_paths_are_expanded():
    cfg = TrainConfig.from_dict({"deepspeed": "~/ds.json", "data": "synthetic:n=4", "output_dir": "~/runs/a"})
    assert cfg.output_dir == os.path.expanduser("~/runs/a") and not cfg.output_dir.startswith("~")
    assert cfg.deepspeed == os.path.expanduser("~/ds.json") and cfg.data == "synthetic:n=4"


def test_flag_style_override_says_how_to_write_it(capsys):
    from fluxzero.cli import main
    from fluxzero.train.loop import parse_args

    r = CliRunner().invoke(main, ["train", "--config", str(ROOT / "launch/tiny.yaml"), "--steps", "5"])
    assert r.exit_code == 2 and "run-file settings are overridden as steps=VALUE" in r.output, r.output
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", "run.yaml", "--export-format", "null"])
    assert e.value.code == 2 and "overridden as export.format=VALUE" in capsys.readouterr().err
    assert parse_args(["--config", "r.yaml", "--local_rank=1", "steps=3"]).overrides == ["steps=3"]


def test_other_ranks_leave_command_line_errors_to_rank_0(monkeypatch, capsys):
    from fluxzero.train.loop import parse_args

    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", "run.yaml", "--steps", "5"])
    assert e.value.code == 2 and capsys.readouterr().err == ""


def test_progress_bar_shows_the_loss_of_the_step_it_counts(tmp_path, monkeypatch, capsys):
    import torch

    from fluxzero.train.metrics import Metrics

    monkeypatch.delenv("FLUXZERO_NO_PROGRESS", raising=False)
    m = Metrics(
        str(tmp_path),
        0,
        1,
        torch.device("cpu"),
        total_steps=3,
        start_step=0,
        global_batch=1,
        train_flops=None,
        dtype=torch.float32,
    )
    m.bar.mininterval = 0  # draw at every update, as a step slower than 0.1 s does
    for step, loss in [(1, 0.5), (2, 0.25)]:
        m.log(step, loss, 1e-3, None, 0, img_tokens=4, txt_tokens=4, log=False)
        frame = capsys.readouterr().err.split("\r")[-1]
        assert f"{step}/3" in frame and f"loss={loss:.4f}" in frame, frame
    m.close()


def test_export_is_current_only_in_the_same_layout_and_dtype(tmp_path):
    import torch
    from safetensors.torch import save_file

    from fluxzero.train.export.consolidate import export_is_current

    latest = tmp_path / "latest"
    latest.write_text("step_00000004")
    out = tmp_path / "export.safetensors"
    assert not export_is_current(out, latest, "bfl", "bf16")
    save_file({"img_in.weight": torch.zeros(2, 2, dtype=torch.bfloat16)}, str(out))
    assert export_is_current(out, latest, "bfl", "bf16")
    assert not export_is_current(out, latest, "bfl", "fp32") and not export_is_current(out, latest, "comfyui", "bf16")
    os.utime(latest, (out.stat().st_mtime + 1,) * 2)  # a newer checkpoint
    assert not export_is_current(out, latest, "bfl", "bf16")


def test_flow_config_validates():
    with pytest.raises(ValueError, match="timestep_sampling"):
        FlowConfig(timestep_sampling="beta")


def test_tiny_default_files():
    from fluxzero.cli import main

    run = yaml.safe_load((ROOT / "launch/tiny.yaml").read_text())
    cfg = TrainConfig.from_dict(run)
    ds = json.loads((ROOT / cfg.deepspeed).read_text())
    from fluxzero.config.deepspeed.file import load_for_training

    _, v = load_for_training(ROOT / cfg.deepspeed, 2)  # the 2 ranks tiny.yaml's comment launches
    assert (v.micro_batch, v.grad_accum, v.precision) == (2, 1, "fp32")
    # the committed DeepSpeed config is exactly what the gen-config command in tiny.yaml's comment writes
    text = (ROOT / "launch/tiny.yaml").read_text()
    cmd = " ".join(
        line.strip("# \\")
        for line in text.splitlines()
        if line.startswith("#   fluxzero gen-config") or line.startswith("#     --warmup")
    )
    args = cmd.split()[2:]
    out = CliRunner().invoke(main, ["gen-config", *args[:-2]])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == ds


def test_process_group_is_torn_down_before_interpreter_exit():
    """A gloo group left to interpreter teardown can SIGABRT a finished rank: init_distributed owns its group.

    atexit runs handlers last-registered first, so one registered before init_distributed sees the state
    after fluxzero's own handler.
    """
    child = textwrap.dedent("""
        import atexit, sys
        import torch.distributed as dist
        atexit.register(lambda: print("group alive at exit:", dist.is_initialized()))
        from fluxzero.train.distributed import init_distributed
        init_distributed()
        dist.barrier()
    """)
    p = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "group alive at exit: False" in p.stdout


# ---------------------------------------------------------------------------------------------------------
# Training cases, one child process
# ---------------------------------------------------------------------------------------------------------
CHILD = TRAINER_CHILD + textwrap.dedent("""
    import contextlib, io, resource
    results = {}
    for name, argv, fsize, prep in json.load(open(sys.argv[1])):
        for path, text in prep.items():  # damage a file the earlier cases left
            open(path, "w").write(text)
        err = io.StringIO()
        if fsize:  # "disk full": writes past fsize bytes fail with EFBIG (Python ignores SIGXFSZ)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.RLIM_INFINITY))
        with contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except Exception:  # an error main() should have reported: fail this case, not all of them
                import traceback
                code = "raised"
                traceback.print_exc()
        if fsize:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        results[name] = [code, err.getvalue()]
    json.dump(results, open(sys.argv[2], "w"))
""")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    import torch

    from fluxzero.data import ShardWriter

    tmp = tmp_path_factory.mktemp("train_cases")
    (tmp / "ds.json").write_text(json.dumps(_ds()))
    nan = _ds(gradient_clipping=0.0)
    nan["optimizer"]["params"]["lr"] = 1e30  # the first update blows the weights up: step 2 is non-finite
    (tmp / "nan.json").write_text(json.dumps(nan))
    (tmp / "empty").mkdir()
    shards = tmp / "shards"
    with ShardWriter(shards, samples_per_shard=2) as w:
        for _ in range(4):
            w.add(torch.randn(16, 8, 8), torch.randn(4, 64), torch.randn(32))
    old_version = tmp / "old_version"
    shutil.copytree(shards, old_version)
    manifest = json.loads((old_version / "manifest.json").read_text())
    (old_version / "manifest.json").write_text(json.dumps({**manifest, "version": 999}))
    victim = sorted(shards.glob("shard-*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated shard
    (tmp / "ds3.json").write_text(json.dumps(_ds(zero_optimization={"stage": 3})))
    (tmp / "ds_list.json").write_text("[1, 2]")
    (tmp / "ds_bf16.json").write_text(json.dumps(_ds(bf16={"enabled": True})))
    (tmp / "ds_fp16.json").write_text(json.dumps(_ds(fp16={"enabled": True})))
    (tmp / "a_file").write_text("")
    (tmp / "export_blocked").mkdir()  # the export goes through a link into a folder that does not exist
    os.symlink(tmp / "no_such_folder" / "export.safetensors", tmp / "export_blocked" / "export.safetensors")
    from fluxzero.model import build_model
    from fluxzero.model.weights import save_weights

    save_weights(build_model("flux-tiny-schnell").state_dict(), tmp / "schnell.safetensors")
    run = {
        "deepspeed": str(tmp / "ds.json"),
        "data": DATA,
        "steps": 4,
        "export": {"format": None},
    }  # micro batch 2: _ds
    (tmp / "run.yaml").write_text(yaml.safe_dump(run))

    def case(name, *over, fsize=0, out=None, prep=None):
        return [
            name,
            ["--config", str(tmp / "run.yaml"), f"output_dir={tmp / (out or name)}", *over],
            fsize,
            prep or {},
        ]

    todo = [
        case("missing_data", f"data={tmp / 'nope'}"),
        case("empty_data", f"data={tmp / 'empty'}"),
        case("corrupt_shard", f"data={shards}"),
        case("wide_t5", "data=synthetic:n=8,hw=8x8,txt=4,ctx=4096,vec=32"),
        case("odd_latent", "data=synthetic:n=8,hw=7x8,txt=4,ctx=64,vec=32"),
        case("old_manifest", f"data={old_version}"),
        case("wrong_weights_zero3", f"deepspeed={tmp / 'ds3.json'}", f"weights={tmp / 'schnell.safetensors'}"),
        case("micro_in_run_file", "micro_batch=1"),
        case("precision_in_run_file", "precision=bf16"),
        case("ds_not_object", f"deepspeed={tmp / 'ds_list.json'}"),
        case("fp16_on_cpu", f"deepspeed={tmp / 'ds_fp16.json'}", "stop_after=2", "checkpoint.every=2"),
        case("fp16_resumed", f"deepspeed={tmp / 'ds_fp16.json'}", "export.format=bfl", out="fp16_on_cpu"),
        case("unwritable_output", out="a_file/run"),
        case("export_blocked", "steps=1", "export.format=bfl"),
        case("nan", f"deepspeed={tmp / 'nan.json'}", "checkpoint.every=1"),
        case(
            "bad_saved_run",
            f"deepspeed={tmp / 'nan.json'}",
            out="nan",
            prep={str(tmp / "nan/checkpoints/step_00000001/run.yaml"): "model: [flux-tiny\n"},
        ),
        case("first", "stop_after=2", "checkpoint.every=2", out="disk"),
        case("tensorboard_disk_full", fsize=1, out="disk"),  # a rerun on a full disk: no log can start
        case("disk_full", fsize=600_000, out="disk"),  # the model states file alone is ~2 MB
        case("jsonl_disk_full", fsize=1, out="disk"),  # steps 3-4 of metrics.jsonl must go: rewriting fails
        case("after_disk_full", "export.format=bfl", out="disk"),
        case("rerun_finished", "export.format=bfl", out="disk"),
        case("no_resume_over_checkpoints", "checkpoint.resume=false", out="disk"),
        case("other_model", "model=flux-tiny-schnell", out="disk"),
        case("other_stage", f"deepspeed={tmp / 'ds3.json'}", out="disk"),
        case("other_precision", f"deepspeed={tmp / 'ds_bf16.json'}", out="disk"),
        case("other_data", f"data={DATA.replace('n=8', 'n=16')}", "flow.shift=none", out="disk"),
        case("other_seed", "seed=1", out="disk"),
        case("other_data_allowed", f"data={DATA.replace('n=8', 'n=16')}", "allow_config_change=true", out="disk"),
        case("keep_two", "checkpoint.every=1", "checkpoint.keep=2"),
        case("before_sections", "stop_after=2", "checkpoint.every=2"),
        # its checkpoint's run.yaml as the version before the sections wrote it: flat keys, resumed and exported
        case(
            "after_sections",
            "export.format=bfl",
            out="before_sections",
            prep={
                str(tmp / "before_sections/checkpoints/step_00000002/run.yaml"): yaml.safe_dump(
                    {
                        **{k: v for k, v in run.items() if k != "export"},
                        "output_dir": str(tmp / "before_sections"),
                        "model": "flux-tiny",
                        "seed": 0,
                        "stop_after": 2,
                        "checkpoint_every": 2,
                        "keep_checkpoints": 0,
                        "resume": True,
                        "export_format": None,
                        "export_dtype": "bf16",
                        "export_merged": False,
                        "export_weights": "live",
                        "sample_every": 0,
                        "sample_size": "512x512",
                        "sample_seeds": [0],
                        "validation_data": None,
                        "validation_timesteps": [0.1, 0.3, 0.5, 0.7, 0.9],
                    },
                    sort_keys=False,
                )
            },
        ),
    ]
    (tmp / "cases.json").write_text(json.dumps(todo))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp / "cases.json"), str(tmp / "results.json")],
        check=True,
        env=env,
        cwd=tmp,
        timeout=600,
    )
    return tmp, json.loads((tmp / "results.json").read_text())


def _one_sentence_error(result):
    code, err = result
    assert code == 1
    lines = [l for l in err.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    "name, match",
    [
        ("missing_data", "nope"),
        ("empty_data", "empty"),
        ("corrupt_shard", "shard"),
        ("wide_t5", "4096"),
        ("odd_latent", "7x8"),
        ("old_manifest", "version 999"),
        ("no_resume_over_checkpoints", "already holds checkpoints (latest step_00000004) and checkpoint.resume is off"),
        ("other_model", "is a checkpoint of flux-tiny but the run file trains flux-tiny-schnell"),
        ("other_stage", "was written under ZeRO stage 2 but"),
        ("other_precision", "was written in fp32 but"),
        ("wrong_weights_zero3", "guidance_in"),  # pretrained load into the partitioned model checks names first
        ("micro_in_run_file", "micro_batch is set in the DeepSpeed config now (train_micro_batch_size_per_gpu in "),
        ("precision_in_run_file", "precision is set in the DeepSpeed config now (bf16.enabled / fp16.enabled in "),
        ("ds_not_object", "ds_list.json must be a JSON object"),
        ("unwritable_output", "cannot write to output_dir"),
        ("export_blocked", "cannot write the export"),
        ("bad_saved_run", "step_00000001/run.yaml is not valid YAML"),
        (
            "other_data",
            "step_00000004 was trained with data=synthetic:n=8,hw=8x8,txt=4,ctx=64,vec=32, flow.shift="
            "resolution but this run has data=synthetic:n=16,hw=8x8,txt=4,ctx=64,vec=32, flow.shift=none; "
            "resume with the checkpoint's values, choose another output_dir, or add allow_config_change=true",
        ),
        (
            "other_seed",
            "was trained with seed=0 but this run has seed=1; resume with the checkpoint's values, or "
            "choose another output_dir",
        ),
    ],
)
def test_user_errors_exit_with_one_sentence(cases, name, match):
    _, results = cases
    assert match in _one_sentence_error(results[name])


def test_fp16_trains_resumes_and_exports_where_the_accelerator_supports_it_and_is_one_sentence_elsewhere(cases):
    from deepspeed.accelerator import get_accelerator

    tmp, results = cases
    accel = get_accelerator()  # it decides, not the test: some CPUs train fp16 (AVX512-FP16 / AMX), most do not
    if not accel.is_fp16_supported():
        for name in ("fp16_on_cpu", "fp16_resumed"):
            assert (
                f"trains in fp16, which DeepSpeed's {accel.device_name()} accelerator does not support"
                in _one_sentence_error(results[name])
            )
        return
    assert results["fp16_on_cpu"][0] == 0 and results["fp16_resumed"][0] == 0, results["fp16_resumed"][1][-2000:]
    assert (tmp / "fp16_on_cpu" / "export.safetensors").is_file()
    assert (tmp / "fp16_on_cpu" / "checkpoints" / "latest").read_text() == "step_00000004"


def test_non_finite_loss_stops_without_saving(cases):
    tmp, results = cases
    msg = _one_sentence_error(results["nan"])
    assert "loss is nan at step 2" in msg and "step_00000001" in msg
    assert "(in the micro batch holding synthetic sample " in msg  # the samples of the batch are named
    ck = tmp / "nan" / "checkpoints"
    assert (ck / "latest").read_text() == "step_00000001" and not (ck / "step_00000002").exists()


def test_disk_full_keeps_previous_checkpoint_loadable(cases):
    tmp, results = cases
    assert results["first"][0] == 0
    msg = _one_sentence_error(results["disk_full"])
    assert "could not save checkpoint step_00000004" in msg and "step_00000002 is intact" in msg
    # the next run resumed from step 2 (latest never moved to the broken step 4) and finished
    assert results["after_disk_full"][0] == 0
    assert (tmp / "disk" / "checkpoints" / "latest").read_text() == "step_00000004"
    assert (tmp / "disk" / "export.safetensors").is_file()


def test_full_disk_outside_checkpoints_is_one_sentence(cases):
    """A rerun on a full disk fails where logging starts: TensorBoard's first event, or metrics.jsonl."""
    tmp, results = cases
    for name, what in [
        ("tensorboard_disk_full", f"TensorBoard logs in {tmp / 'disk' / 'tensorboard'}"),
        ("jsonl_disk_full", str(tmp / "disk" / "metrics.jsonl")),
    ]:
        msg = _one_sentence_error(results[name])
        assert msg.startswith(
            f"error: cannot write {what} (File too large): the disk holding {tmp / 'disk'} is "
            f"probably full; training stopped at step 2 and the last complete checkpoint "
            f"{tmp / 'disk' / 'checkpoints'}/step_00000002 is intact: free disk space there and "
            f"run the same command again to resume from it"
        ), msg


def test_resumed_steps_are_logged_once(cases):
    """disk_full logged steps 3-4 and failed to save step 4; after_disk_full resumed step 2 and logged 3-4 again."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, results = cases
    assert results["disk_full"][0] == 1 and results["after_disk_full"][0] == 0
    steps = [json.loads(l)["step"] for l in (tmp / "disk" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    events = EventAccumulator(str(tmp / "disk" / "tensorboard")).Reload().Scalars("train/loss")
    assert [e.step for e in events] == [1, 2, 3, 4]  # purge_step: the event files of later runs hide 3-4


def test_rerun_of_a_finished_run_does_nothing(cases):
    tmp, results = cases
    code, err = results["rerun_finished"]
    assert code == 0 and "done: step 4/4" in err and "(up to date: not written again)" in err, err
    assert results["other_data_allowed"][0] == 0, results["other_data_allowed"][1]


def test_export_command(cases, tmp_path):
    from fluxzero.cli import main
    from fluxzero.model.weights import load_weights

    tmp, _ = cases
    run_dir = tmp / "disk"
    r = CliRunner().invoke(main, ["export", str(run_dir), str(tmp_path / "w.safetensors"), "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    assert "step_00000004" in r.output
    ours = load_weights(tmp_path / "w.safetensors")
    bf16 = load_weights(run_dir / "export.safetensors")  # written by the run itself (export.dtype bf16)
    assert all(bf16[k].equal(v.bfloat16()) for k, v in ours.items())
    r = CliRunner().invoke(main, ["export", str(run_dir), str(tmp_path / "w.safetensors")])
    assert r.exit_code == 2 and "--overwrite" in r.output
    r = CliRunner().invoke(main, ["export", str(tmp_path), str(tmp_path / "x.safetensors")])
    assert r.exit_code == 2 and "not a fluxzero checkpoint" in r.output
    # a lost `latest`: the newest complete step folder, named, as a resume takes it
    lost = tmp_path / "lost"
    shutil.copytree(run_dir / "checkpoints", lost / "checkpoints")
    (lost / "checkpoints" / "latest").unlink()
    r = CliRunner().invoke(main, ["export", str(lost), str(tmp_path / "lost.safetensors"), "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    assert (
        f"note: {lost / 'checkpoints' / 'latest'} is missing; exporting step_00000004, the newest complete "
        "checkpoint there" in r.output
    ), r.output
    again = load_weights(tmp_path / "lost.safetensors")
    assert all(again[k].equal(v) for k, v in ours.items())
    for tag in ("step_00000002", "step_00000004"):  # saves killed before their last files
        (lost / "checkpoints" / tag / "ds_config.json").unlink()
    r = CliRunner().invoke(main, ["export", str(lost), str(tmp_path / "none.safetensors")])
    assert (
        r.exit_code == 2
        and "has no 'latest' file and none of its step folders is a complete checkpoint" in r.output
        and not (tmp_path / "none.safetensors").exists()
    ), r.output
    (tmp_path / "a_file").write_text("")
    r = CliRunner().invoke(main, ["export", str(run_dir), str(tmp_path / "a_file" / "x.safetensors")])
    assert r.exit_code == 2 and "cannot write the export" in r.output, r.output
    # run.yaml names what was trained: unreadable, or another model than the weights, is one sentence
    copy = tmp_path / "copy"
    shutil.copytree(run_dir / "checkpoints" / "step_00000004", copy)
    for text, words in (
        ("model: [unclosed", "is not valid YAML"),
        ("model: flux-nope\n", "does not name a known model"),
        ("model: flux-dev\n", "cannot export"),
    ):
        (copy / "run.yaml").write_text(text)
        r = CliRunner().invoke(main, ["export", str(copy), str(tmp_path / "y.safetensors")])
        assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, r.output


def test_truncated_checkpoint_is_one_sentence(cases, tmp_path):
    from fluxzero.cli import main
    from fluxzero.train.checkpoint.integrity import unreadable_files

    tmp, _ = cases
    shutil.copytree(tmp / "disk", tmp_path / "run")
    tag = tmp_path / "run" / "checkpoints" / "step_00000004"
    victim = sorted(tag.glob("*optim_states.pt"))[-1]
    victim.write_bytes(victim.read_bytes()[:1000])  # what a killed copy or a full disk leaves
    assert unreadable_files(tag) == [victim.name]  # resume checks these on every rank before DeepSpeed loads
    r = CliRunner().invoke(main, ["export", str(tmp_path / "run"), str(tmp_path / "x.safetensors")])
    assert r.exit_code == 2 and f"checkpoint {tag} is incomplete or corrupt" in r.output, r.output


def test_ctrl_c_exits_cleanly_with_checkpoint_to_resume(tmp_path):
    """SIGINT mid-run: exit 130, one line naming the last complete checkpoint, no traceback."""
    import signal
    import time

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "launch/train.py",
        "--config",
        "launch/tiny.yaml",
        "steps=100000",
        "checkpoint.every=2",
        "export.format=null",
        f"output_dir={out}",
    ]
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "FLUXZERO_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # a CI shell may ignore it
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 120
    while not latest.is_file() and p.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    line = [l for l in err.splitlines() if l.startswith("error: ")]
    tag = latest.read_text()
    assert len(line) == 1 and f"the last complete checkpoint is {out / 'checkpoints' / tag}" in line[0], err[-3000:]
    assert (out / "checkpoints" / tag / "trainer_state_rank0.pt").is_file()


# ---------------------------------------------------------------------------------------------------------
# Two ranks: each error printed once, by the rank that knows it
# ---------------------------------------------------------------------------------------------------------
MULTI = textwrap.dedent("""
    import json, os, sys
    os.environ["FLUXZERO_NO_PROGRESS"] = "1"
    from fluxzero.train.loop import main  # first, as launch/train.py: it quiets other ranks before DeepSpeed's import
    from fluxzero.train.distributed import init_distributed
    init_distributed()
    rank = int(os.environ["RANK"])
    for name, argv, lose_shard_on in json.load(open(sys.argv[1])):
        if lose_shard_on == rank:  # a shard is deleted the moment this rank first needs it (its third)
            from fluxzero.data import shards
            real, opened = shards.ShardSource._handle, []
            def handle(self, s):
                if s not in opened:
                    opened.append(s)
                    if len(opened) == 3:
                        (self.data_dir / self.manifest["shards"][s]["file"]).unlink()
                return real(self, s)
            shards.ShardSource._handle = handle
        code = main(argv)
        sys.stderr.write(f"@@ {name} {code}\\n")
        sys.stderr.flush()
    os._exit(0)  # the last case broke the process group: no teardown
""")


def _by_case(stderr: str) -> dict:
    out, text = {}, ""
    for line in stderr.splitlines(keepends=True):
        if line.startswith("@@ "):
            _, name, code = line.split()
            out[name], text = (text, int(code)), ""
        else:
            text += line
    return out


@pytest.mark.slow
def test_two_ranks_print_each_error_once(tmp_path):
    """Errors both ranks hit: rank 0 prints them, rank 1 nothing. A shard lost by rank 1 mid-run: rank 1
    names it, rank 0 (in a collective with it) says another rank stopped, no gloo traceback. Rank 1 prints
    no DeepSpeed warnings."""

    import torch

    from fluxzero.data import ShardWriter

    (tmp_path / "ds.json").write_text(json.dumps(_ds()))
    shards = tmp_path / "shards"
    with ShardWriter(shards, samples_per_shard=1) as w:  # one sample a shard: a rank's shards are its own
        for _ in range(8):
            w.add(torch.randn(16, 8, 8), torch.randn(4, 64), torch.randn(32))
    run = {"deepspeed": str(tmp_path / "ds.json"), "data": str(shards), "steps": 2, "export": {"format": None}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    argv = ["--config", str(tmp_path / "run.yaml"), f"output_dir={tmp_path / 'out'}"]
    todo = [
        ["bad_override", [*argv, "steps=abc"], None],
        ["missing_data", [*argv, f"data={tmp_path / 'nope'}"], None],
        ["shard_gone", argv, 1],
    ]
    (tmp_path / "cases.json").write_text(json.dumps(todo))
    procs = popen_ranks([sys.executable, "-c", MULTI, str(tmp_path / "cases.json")], cwd=tmp_path)
    (out0, err0), (out1, err1) = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], err0[-3000:] + err1[-3000:]
    r0, r1 = _by_case(err0), _by_case(err1)
    assert r0["bad_override"] == ("error: steps must be a whole number, got 'abc'\n", 1)
    assert r0["missing_data"][0].startswith(f"error: data directory {tmp_path / 'nope'} does not exist")
    assert r0["missing_data"][0].count("\n") == 1
    assert r1["bad_override"] == r1["missing_data"] == ("", 1)
    assert r1["shard_gone"][1] == r0["shard_gone"][1] == 1
    assert r1["shard_gone"][0].startswith(f"\n[rank 1] error: shard {shards}/shard-"), err1
    assert "could not be read" in r1["shard_gone"][0] and r1["shard_gone"][0].count("\n") == 2
    summary, gone0 = r0["shard_gone"][0].split("\n", 1)  # rank 0's start-up line, then its one error
    assert summary.startswith("training flux-tiny: "), err0
    assert gone0.startswith("error: another rank stopped (its error is above; if there is none, it was killed"), err0
    assert "WARNING" not in out1 and "WARNING" not in err1


# ---------------------------------------------------------------------------------------------------------
# Quick start: the README's command 1, shortened, on 2 ranks under torchrun
# ---------------------------------------------------------------------------------------------------------
QUICK_START = "torchrun --nproc_per_node 2 launch/train.py --config launch/tiny.yaml"


def test_readme_quick_start_is_what_ci_and_this_file_run():
    """README command 2 is .ci/run's test line; command 1 is the run the next test makes (shortened)."""
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start") : readme.index("\n## ", readme.index("## Quick start") + 1)]
    commands = [b.split("\n")[1].strip() for b in quick.split("```bash")[1:]]
    assert len(commands) == 2, commands
    assert commands[0] == f"pip install torch==2.13.0 && pip install -e '.[train]' && {QUICK_START}"
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    assert commands[1] in ci, "the README's test command must be a line of .ci/run, unchanged"


@pytest.mark.slow
def test_quick_start_torchrun_two_ranks(tmp_path):
    from fluxzero.model.weights import load_weights

    out = tmp_path / "tiny"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *QUICK_START.split()[1:],
        "steps=12",
        "checkpoint.every=6",
        "log_every=3",
        f"output_dir={out}",
    ]
    p = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "FLUXZERO_PEAK_TFLOPS": "1"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "done: step 12/12" in p.stderr
    assert (out / "checkpoints" / "latest").read_text() == "step_00000012"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(out / "tensorboard")).Reload().Tags()["scalars"]
    assert {
        "train/loss",
        "train/skipped_steps",
        "per_rank/step_time_s/rank0",
        "per_rank/step_time_s/rank1",
        "per_rank/peak_memory_gb/rank1",
    } <= set(tags)
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 6, 9, 12]
    assert len(records[0]["step_time_s_per_rank"]) == 2 and records[-1]["samples_per_s"] > 0
    assert 0 < records[-1]["mfu"] < 1  # CPU has no known peak; FLUXZERO_PEAK_TFLOPS=1 stands in for one
    w = load_weights(out / "export.safetensors")
    assert w["img_in.weight"].shape == (64, 64)
    saved = yaml.safe_load((out / "checkpoints" / "step_00000006" / "run.yaml").read_text())
    assert saved["steps"] == 12 and saved["output_dir"] == str(out)


# The deepspeed launcher's two ranks: tests/cluster/test_launch_multinode.py (its one-node run).


def test_an_incomplete_diffusers_export_is_not_up_to_date(tmp_path):
    """The index is written last: shards without it are an export that stopped midway and must be redone."""
    from fluxzero.model.layouts import DIFFUSERS_INDEX, DIFFUSERS_WEIGHTS
    from fluxzero.train.export.consolidate import _diffusers_files

    shards = [f"diffusion_pytorch_model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    (tmp_path / shards[0]).write_bytes(b"x")
    assert _diffusers_files(tmp_path) == []
    (tmp_path / DIFFUSERS_INDEX).write_text(json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}}))
    assert _diffusers_files(tmp_path) == []  # the index names a shard that is not there
    (tmp_path / shards[1]).write_bytes(b"x")
    assert _diffusers_files(tmp_path) == [tmp_path / s for s in shards]
    single = tmp_path / "single"
    single.mkdir()
    (single / DIFFUSERS_WEIGHTS).write_bytes(b"x")
    assert _diffusers_files(single) == [single / DIFFUSERS_WEIGHTS]


def test_a_checkpoint_saved_before_the_run_file_sections_resumes_and_exports(cases):
    tmp, results = cases
    assert results["before_sections"][0] == 0, results["before_sections"]
    code, err = results["after_sections"]
    assert code == 0 and "resuming from step 2 " in err and "Traceback" not in err, err
    assert (tmp / "before_sections" / "export.safetensors").is_file()
    saved = yaml.safe_load((tmp / "before_sections/checkpoints/step_00000004/run.yaml").read_text())
    assert saved["export"]["format"] == "bfl" and "export_format" not in saved  # saved again, in sections


def test_keep_checkpoints_leaves_the_newest(cases):
    tmp, results = cases
    assert results["keep_two"][0] == 0, results["keep_two"]
    ckpt = tmp / "keep_two" / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000003", "step_00000004"]
    assert (ckpt / "latest").read_text() == "step_00000004"
