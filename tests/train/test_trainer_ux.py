"""What a new user meets around the trainer: the grad norm in every optimizer mode, one sentence for a missing
peft, a moved base at `export --merge`, resume refusals that name the key to change, a resume's own line,
and did-you-means for misspelled keys (flux-tiny on CPU; the trainer runs in child processes)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.helpers import ROOT, TRAIN_PY, TRAINER_CHILD, rank_env, tiny_ds, tiny_weights, train, train_cmd

DATA = "synthetic:n=4,hw=8x8,txt=4,ctx=64,vec=32"


def _error(r: subprocess.CompletedProcess) -> str:
    """The one error line of a failed launch/train.py (no traceback)."""
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    return line


# ---------------------------------------------------------------------------------------------------------
# (8) the grad norm in every mode
# ---------------------------------------------------------------------------------------------------------
_NORMS = (
    TRAINER_CHILD
    + """
from fluxzero.config import TrainConfig
norms = {}
for name, cfg in json.load(open(sys.argv[1])):
    train(TrainConfig.from_dict(cfg))
    norms[name] = [json.loads(line)["grad_norm"] for line in open(cfg["output_dir"] + "/metrics.jsonl")]
json.dump(norms, open(sys.argv[2], "w"))
"""
)


@pytest.mark.slow
def test_grad_norm_is_logged_in_every_mode(tmp_path):
    pytest.importorskip("torchao")
    from fluxzero.config.optim_modes import get_mode

    cases = {"z0": tiny_ds(0), "z1": tiny_ds(1), "z0_bf16_sr": tiny_ds(0, fluxzero={"optimizer_mode": "bf16-sr"})}
    assert get_mode("bf16-sr").ds_bf16_section(0) == {}  # bf16 off: the model is cast, the engine has no wrapper
    jobs = []
    for name, ds in cases.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(ds))
        jobs.append(
            [
                name,
                {
                    "deepspeed": str(tmp_path / f"{name}.json"),
                    "data": DATA,
                    "steps": 2,
                    "seed": 1,
                    "output_dir": str(tmp_path / name),
                    "export": {"format": None},
                },
            ]
        )
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    subprocess.run(
        [sys.executable, "-c", _NORMS, str(tmp_path / "jobs.json"), str(tmp_path / "out.json")],
        cwd=ROOT,
        check=True,
        timeout=600,
        env=rank_env(),
    )
    norms = json.loads((tmp_path / "out.json").read_text())
    assert all(isinstance(n, float) and n > 0 for ns in norms.values() for n in ns), norms
    # step 1: the same weights and batch, so the same gradient; ZeRO-1's norm is DeepSpeed's own (fp32: the
    # summation order differs only)
    assert norms["z0"][0] == pytest.approx(norms["z1"][0], rel=1e-5)
    assert norms["z0_bf16_sr"][0] == pytest.approx(norms["z0"][0], rel=0.05)  # a bf16 model's gradient


# ---------------------------------------------------------------------------------------------------------
# (12) no peft; (14) a missing weights file, a batch for another world size: one sentence before any build
# ---------------------------------------------------------------------------------------------------------
NO_PEFT = r"""
import runpy, sys
sys.modules["peft"] = None  # as if not installed: `import peft` raises ImportError
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_lora_without_peft_names_the_extra(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps(tiny_ds(2)))
    run = {
        "deepspeed": str(tmp_path / "ds.json"),
        "data": DATA,
        "output_dir": str(tmp_path / "out"),
        "steps": 1,
        "lora": {"rank": 4},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    r = subprocess.run(
        [sys.executable, "-c", NO_PEFT, str(TRAIN_PY), "--config", str(tmp_path / "run.yaml")],
        capture_output=True,
        text=True,
        env=rank_env(),
        timeout=300,
    )
    assert "pip install -e '.[lora]'" in _error(r)


def test_missing_weights_and_a_batch_for_other_ranks_name_what_to_change(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps(tiny_ds(2)))
    (tmp_path / "ds8.json").write_text(json.dumps(tiny_ds(2, train_batch_size=16)))  # 2 per rank: for 8 ranks
    run = {
        "deepspeed": str(tmp_path / "ds.json"),
        "data": DATA,
        "output_dir": str(tmp_path / "out"),
        "steps": 1,
        "weights": "moved.safetensors",
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    line = _error(
        subprocess.run(
            train_cmd(tmp_path / "run.yaml"), capture_output=True, text=True, env=rank_env(), timeout=300, cwd=tmp_path
        )
    )
    assert "weights: moved.safetensors" in line and f"relative to the folder you launch from ({tmp_path})" in line
    line = _error(train(tmp_path / "run.yaml", f"deepspeed={tmp_path / 'ds8.json'}", "weights=null"))
    assert (
        "the batch sizes are written for 8 ranks; launch 8 ranks (torchrun --nproc_per_node 8, or deepspeed "
        "--num_gpus 8), or set gradient_accumulation_steps to 8 for the same global batch on 1 rank"
    ) in line


# ---------------------------------------------------------------------------------------------------------
# (14) resume: its line, refusals naming the DeepSpeed key; (13) export --merge of a run whose base moved
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_resume_line_refusals_and_a_moved_base(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from fluxzero.cli import main as cli

    tiny_weights(tmp_path / "base.safetensors")
    (tmp_path / "ds.json").write_text(json.dumps(tiny_ds(0)))
    (tmp_path / "ds_mb4.json").write_text(json.dumps(tiny_ds(0, train_micro_batch_size_per_gpu=4)))
    run = {
        "deepspeed": "ds.json",
        "data": DATA,
        "output_dir": "out",
        "steps": 2,
        "stop_after": 1,
        "weights": "base.safetensors",
        "lora": {"rank": 4},
        "export": {"format": None},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))

    def start(*overrides):  # from the run's folder: its paths are relative to it
        return subprocess.run(
            train_cmd(tmp_path / "run.yaml", *overrides),
            capture_output=True,
            text=True,
            env=rank_env(),
            timeout=300,
            cwd=tmp_path,
        )

    r = start()
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming" not in r.stderr
    line = _error(start("deepspeed=ds_mb4.json"))
    assert (
        "was trained with train_micro_batch_size_per_gpu=2 but this run has train_micro_batch_size_per_gpu=4 "
        "in ds_mb4.json"
    ) in line
    r = start("stop_after=0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from step 1 (checkpoint {os.path.join('out', 'checkpoints', 'step_00000001')})" in r.stderr

    shutil.move(tmp_path / "base.safetensors", tmp_path / "elsewhere.safetensors")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["export", "out", "merged.safetensors", "--merge"])
    assert res.exit_code != 0
    assert (
        "its base is the run's weights: base.safetensors (in its run.yaml, a path relative to the folder "
        "training was launched from)"
    ) in res.output and "pass --base" in res.output, res.output
    res = CliRunner().invoke(cli, ["export", "out", "merged.safetensors", "--merge", "--base", "elsewhere.safetensors"])
    assert res.exit_code == 0, res.output


# ---------------------------------------------------------------------------------------------------------
# (15) misspelled keys
# ---------------------------------------------------------------------------------------------------------
def test_misspelled_lora_keys_and_the_lr_in_the_run_file():
    from fluxzero.config import LoraConfig, TrainConfig

    with pytest.raises(ValueError, match=r"unknown lora keys \['rnak'\] \(did you mean 'rank' for 'rnak'\?\)"):
        LoraConfig.from_dict({"rnak": 4})
    for key in ("lr", "learning_rate"):
        with pytest.raises(ValueError, match=r"optimizer\.params\.lr"):
            LoraConfig.from_dict({"rank": 4, key: 1e-4})
        with pytest.raises(
            ValueError,
            match=rf"{key} is set in the DeepSpeed config now \(optimizer\.params\.lr in "
            r"ds\.json\)",
        ):
            TrainConfig.from_dict({"deepspeed": "ds.json", "data": "d", "output_dir": "o", key: 1e-4})


# ---------------------------------------------------------------------------------------------------------
# issue 38 (22): a start-up line before the progress bar; no lock file left after the run
# ---------------------------------------------------------------------------------------------------------
def test_a_run_says_what_it_trains_and_leaves_no_lock_file(tmp_path):
    import re

    (tmp_path / "ds.json").write_text(json.dumps(tiny_ds(2)))
    run = {
        "deepspeed": str(tmp_path / "ds.json"),
        "data": DATA,
        "output_dir": str(tmp_path / "out"),
        "steps": 2,
        "lora": {"rank": 4},
        "export": {"format": None},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    r = train(tmp_path / "run.yaml")
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("training ")]
    m = re.fullmatch(
        r"training flux-tiny LoRA rank 4: ([\d,]+) trainable parameters; 4 samples in 1 bucket\(s\); "
        r"1 rank\(s\), ZeRO-2, global batch 2 x 1 accumulation x 1 = 2; steps 1-2 of 2",
        line,
    )
    assert m and int(m.group(1).replace(",", "")) > 0, line
    assert not (tmp_path / "out" / ".fluxzero.lock").exists()  # removed by the run that held it


@pytest.mark.slow
def test_under_torchrun_the_error_sentence_ends_its_summary(tmp_path):
    """torchrun prints a summary of the failed ranks last; its `traceback :` lines carry the trainer's sentence."""
    from tests.helpers import free_port

    (tmp_path / "ds.json").write_text(json.dumps(tiny_ds(2)))
    run = {
        "deepspeed": str(tmp_path / "ds.json"),
        "data": DATA,
        "output_dir": str(tmp_path / "out"),
        "steps": 1,
        "lora": {"rank": 4},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    (tmp_path / "no_peft.py").write_text(NO_PEFT)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(tmp_path / "no_peft.py"),
            str(TRAIN_PY),
            "--config",
            str(tmp_path / "run.yaml"),
        ],
        capture_output=True,
        text=True,
        env=rank_env(),
        timeout=300,
    )
    sentence = "error: a LoRA run needs the peft package, which is not installed: pip install -e '.[lora]'"
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and lines[-1].startswith("====="), r.stderr[-3000:]
    assert lines[-2].strip() == f"traceback : {sentence}", r.stderr[-3000:]  # the root cause: rank 0
    assert sum(line.strip() == f"traceback : {sentence}" for line in lines) == 2  # and rank 1's failure


def test_the_compile_note_names_bucket_token_counts_that_compile_apart():
    """16 px bucket sides give token counts such as 999 (27 x 37 patches) that Inductor's alignment guard compiles
    apart; the note says so, and says nothing for 64 px buckets (multiples of 16) or a single shape."""
    from fluxzero.data.buckets import make_buckets
    from fluxzero.train.loop import unaligned_buckets_note

    fine = [(h // 8, w // 8) for h, w in make_buckets(512, step=16)]
    coarse = [(h // 8, w // 8) for h, w in make_buckets(512)]
    note = unaligned_buckets_note(fine)
    assert "are not multiples of 8" in note and "--bucket-step 64" in note, note
    assert unaligned_buckets_note(coarse) == ""
    assert unaligned_buckets_note([(74, 54)]) == ""  # one shape: nothing compiles apart
    assert unaligned_buckets_note([(74, 54), (78, 52)]) == ""  # 999 and 1014: neither aligned, one graph for both
    # a Kontext pair's attention sees target and reference: 972 tokens are not a multiple of 8, 2 x 972 is
    assert (
        unaligned_buckets_note([(64, 64), (36, 108)]) != "" and unaligned_buckets_note([(64, 64), (36, 108)], 2) == ""
    )
    assert "e.g. 1998" in unaligned_buckets_note([(64, 64), (74, 54)], 2)  # 2 x 999
