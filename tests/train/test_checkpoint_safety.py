"""What a resume and `fluxzero export` read from a checkpoint folder: nothing unpickled that the scan has not
passed, whatever its name (DeepSpeed's loader picks its files by wildcard), every file accounted for against what
a clean save writes, EMA shards checked (step, rank, world size, checksum) like data shards, and a checkpoint an
export reads held against the training's pruning.

The bar is test_bad_inputs.py's: a non-zero exit, one "error:" line, no traceback, no input file changed. The
resumes run as 2 gloo ranks (one process pair for every case, main() called once per case), the exports through
Click's CliRunner in this process.
"""

from __future__ import annotations

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

from tests.helpers import tiny_ds
from tests.test_bad_inputs import _meets_bar, damage, export_refused, tree_hash, two_rank_cases

DATA = "synthetic:n=8,hw=8x8,txt=4,ctx=64,vec=32"
RUNS = {  # name: (ZeRO stage, extra run-file keys): a full fine-tune at ZeRO-2, LoRA + EMA at ZeRO-3
    "z2": (2, {}),
    "z3_lora_ema": (3, {"lora": {"rank": 4, "alpha": 4}, "ema": {"decay": 0.5}}),
}
# names DeepSpeed's glob (mp_rank_*_model_states.pt, zero_pp_rank_N_mp_rank_*_model_states.pt) matches and that sort
# before the real file ('-' < '_'): its loader would unpickle them in place of the intact ones
PLANTED = {
    "z2": ["mp_rank_00-a_model_states.pt"],
    "z3_lora_ema": [f"zero_pp_rank_{r}_mp_rank_00-a_model_states.pt" for r in (0, 1)],
}
TAG, EARLIER = "step_00000002", "step_00000001"
Z3 = f"checkpoints/{TAG}"


def _run_file(folder: Path, stage: int, extra: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ds.json").write_text(json.dumps(tiny_ds(stage)))
    run = {
        "deepspeed": str(folder / "ds.json"),
        "data": DATA,
        "output_dir": str(folder / "out"),
        "steps": 2,
        "checkpoint": {"every": 1},
        "export": {"format": None},
        **extra,
    }
    (folder / "run.yaml").write_text(yaml.safe_dump(run))
    return folder / "run.yaml"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Both runs trained 2 steps on 2 ranks, a checkpoint after each step."""
    base = tmp_path_factory.mktemp("safety")
    # one process pair trains both, main() once per run (a pair's start costs more than a 2-step run)
    todo = [[name, ["--config", str(_run_file(base / name, stage, extra))]] for name, (stage, extra) in RUNS.items()]
    results, err1 = two_rank_cases(todo, base, timeout=600)
    assert {name: code for name, (code, _) in results.items()} == dict.fromkeys(RUNS, 0), (results, err1[-3000:])
    return base


@pytest.mark.slow
def test_a_clean_save_writes_exactly_the_names_the_check_expects(trained):
    from fluxzero.train.checkpoint.integrity import clean_save_files

    for name, (stage, extra) in RUNS.items():
        for tag in (EARLIER, TAG):
            got = set(os.listdir(trained / name / "out" / "checkpoints" / tag))
            assert got == clean_save_files(stage, False, 2, bool(extra.get("ema"))), (name, tag, sorted(got))


def _payload(path: Path, marker: Path) -> None:
    damage("pickle", str(path), str(marker))


def _flip_data_byte(path: str) -> None:
    """One byte of the first tensor's data (past the header), the file size unchanged."""
    raw = bytearray(Path(path).read_bytes())
    raw[8 + int.from_bytes(raw[:8], "little") + 3] ^= 0x01
    Path(path).write_bytes(bytes(raw))


EMA0, EMA1 = f"{Z3}/ema_rank_00000.safetensors", f"{Z3}/ema_rank_00001.safetensors"
# (name, run, damage: [(op, path in the copied output_dir, argument)], words the sentence holds)
CASES = [
    ("planted_z2", "z2", [("plant", f"checkpoints/{TAG}/{PLANTED['z2'][0]}", None)], PLANTED["z2"][0]),
    (
        "planted_z3",
        "z3_lora_ema",
        [("plant", f"{Z3}/{n}", None) for n in PLANTED["z3_lora_ema"]],
        PLANTED["z3_lora_ema"][0],
    ),
    ("ema_missing_rank0", "z3_lora_ema", [("unlink", EMA0, None)], "ema_rank_00000.safetensors is missing"),
    ("ema_missing_rank1", "z3_lora_ema", [("unlink", EMA1, None)], "ema_rank_00001.safetensors is missing"),
    ("ema_flipped", "z3_lora_ema", [("flip_data", EMA1, None)], "ema_rank_00001.safetensors fails its checksum"),
    (
        "ema_other_step",
        "z3_lora_ema",
        [("copy_file", EMA1, f"checkpoints/{EARLIER}/ema_rank_00001.safetensors")],
        "holds the EMA of step 1, not step 2's",
    ),
    ("ema_truncated", "z3_lora_ema", [("truncate", EMA0, 300)], "ema_rank_00000.safetensors is not a readable"),
    ("ema_pickle", "z3_lora_ema", [("pickle", EMA1, "PWNED")], "ema_rank_00001.safetensors is not a readable"),
    ("ema_rank0_over_rank1", "z3_lora_ema", [("copy_file", EMA1, EMA0)], "holds rank 0's EMA, not rank 1's"),
]


def _prepare(trained: Path, work: Path, name: str, run: str, ops) -> Path:
    """A copy of `run`'s output_dir, damaged by `ops`; returns the copy."""
    out = work / name
    shutil.copytree(trained / run / "out", out)
    for op, rel, arg in ops:
        if op == "plant":
            _payload(out / rel, work / "PWNED")
        elif op == "flip_data":
            _flip_data_byte(str(out / rel))
        elif op == "copy_file":
            shutil.copyfile(out / arg, out / rel)
        else:
            damage(op, str(out / rel), str(work / arg) if op == "pickle" else arg)
    return out


@pytest.mark.slow
def test_resume_refuses_a_planted_file_and_every_ema_shard_fault(trained, tmp_path):
    outs = {name: _prepare(trained, tmp_path, name, run, ops) for name, run, ops, _ in CASES}
    before = {name: tree_hash(out / "checkpoints") for name, out in outs.items()}  # the lock file is rewritten
    todo = [
        [name, ["--config", str(trained / run / "run.yaml"), f"output_dir={outs[name]}", "steps=3"]]
        for name, run, _, _ in CASES
    ]
    results, err1 = two_rank_cases(todo, tmp_path, timeout=900)
    assert "Traceback" not in err1, err1[-3000:]
    assert not (tmp_path / "PWNED").exists(), "a planted pickle ran code"
    missed = {}
    for name, _, _, words in CASES:
        code, text = results[name]
        problem = _meets_bar(code, text, tree_hash(outs[name] / "checkpoints") == before[name])
        if problem or words not in text:
            missed[name] = problem or text
    assert not missed, missed


@pytest.mark.slow
@pytest.mark.parametrize("name, run, ops, words", CASES)
def test_export_refuses_a_planted_file_and_every_ema_shard_fault(trained, tmp_path, name, run, ops, words):
    out = _prepare(trained, tmp_path, name, run, ops)
    flags = ["--weights", "ema"] if name.startswith("ema_") else []
    export_refused(out, tmp_path / "x.safetensors", flags, words, tmp_path / "PWNED")


@pytest.mark.slow
def test_export_of_ema_with_every_shard_deleted_names_the_missing_shard(trained, tmp_path):
    from fluxzero.cli import main

    out = _prepare(trained, tmp_path, "gone", "z3_lora_ema", [("unlink", EMA0, None), ("unlink", EMA1, None)])
    r = CliRunner().invoke(main, ["export", str(out), str(tmp_path / "x.safetensors"), "--weights", "ema"])
    assert r.exit_code != 0 and "ema_rank_00000.safetensors is missing" in r.output, r.output
    assert "no ema: section" not in r.output
    # the live weights still export, and the EMA of the intact checkpoint too
    r = CliRunner().invoke(
        main, ["export", str(trained / "z3_lora_ema" / "out"), str(tmp_path / "e.safetensors"), "--weights", "ema"]
    )
    assert r.exit_code == 0, r.output


def test_an_older_ema_shard_without_a_header_loads_unchecked_with_a_note(tmp_path):
    import torch
    from safetensors.torch import save_file

    from fluxzero.train.ema import ShardError, read_shard

    layout = {"rank": 1, "world": 2}
    sd = {
        "ema.0": torch.ones(3),
        "step": torch.tensor(4),
        "layout": torch.frombuffer(bytearray(json.dumps(layout).encode()), dtype=torch.uint8),
    }
    save_file(sd, tmp_path / "old.safetensors")
    got, note = read_shard(tmp_path / "old.safetensors", rank=1, world=2, step=4, advice="fix it")
    assert torch.equal(got["ema.0"], sd["ema.0"]) and "predates EMA shard checksums" in note
    with pytest.raises(ShardError, match=r"holds rank 1's EMA, not rank 0's \(copied from elsewhere\); fix it"):
        read_shard(tmp_path / "old.safetensors", rank=0, world=2, step=4, advice="fix it")


def test_an_ema_shard_whose_layout_points_past_its_buffer_is_one_sentence(tmp_path):
    import torch
    from safetensors.torch import save_file

    from fluxzero.train.distributed import TrainingError
    from fluxzero.train.export.consolidate import ema_state_dict

    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"ema": {"decay": 0.5}}))
    torch.save({"step": 4, "world_size": 1}, tmp_path / "trainer_state_rank0.pt")
    for pieces in ([["w", 0, 2, 0, 4]], [["w", 0, 0, 3, 4]], [["w", 1, 0, 0, 4]], [["v", 0, 0, 0, 4]]):
        layout = {"rank": 0, "world": 1, "replicated": False, "shapes": {"w": [2, 2]}, "pieces": pieces}
        save_file(
            {
                "ema.0": torch.ones(4),
                "layout": torch.frombuffer(bytearray(json.dumps(layout).encode()), dtype=torch.uint8),
            },
            tmp_path / "ema_rank_00000.safetensors",
        )  # an older shard: no header, loaded unchecked
        with pytest.raises(
            TrainingError,
            match=r"^the EMA shards of .* cannot be read \(rank 0's EMA shard places 4 "
            r"values of \w at \d of its buffer \d, which it does not hold\); ",
        ):
            ema_state_dict(tmp_path)


def test_a_lora_export_reads_the_settings_of_the_checkpoint_it_holds_before_pruning_takes_it(tmp_path, monkeypatch):
    """A pruning that takes the folder the moment the export's read lock is released (checkpoint.keep of a running
    training) must find the export done with it: the LoRA's settings (run.yaml) are read under the lock too."""
    import contextlib

    from fluxzero.train.checkpoint import locks
    from fluxzero.train.checkpoint import store as checkpoint
    from fluxzero.train.export.lora import export_lora
    from tests.helpers import train_ok

    pytest.importorskip("peft")
    run = _run_file(tmp_path, 2, {"lora": {"rank": 4, "alpha": 4}})
    train_ok(run)
    ck = tmp_path / "out" / "checkpoints"
    reading = locks.reading

    @contextlib.contextmanager
    def pruned_when_released(ckpt_dir, tag):
        with reading(ckpt_dir, tag):
            yield
        assert checkpoint.prune_checkpoints(ckpt_dir, "step_00000002", keep=1) == [tag]

    monkeypatch.setattr(locks, "reading", pruned_when_released)
    export_lora(ck / EARLIER, tmp_path / "lora.safetensors")
    assert (tmp_path / "lora.safetensors").is_file() and not (ck / EARLIER).exists()


# ---------------------------------------------------------------------------------------------------------
# An export beside a running training: pruning skips the checkpoint it reads
# ---------------------------------------------------------------------------------------------------------
def test_pruning_skips_a_checkpoint_an_export_is_reading_and_takes_it_next_time(tmp_path):
    from fluxzero.train.checkpoint import locks
    from fluxzero.train.checkpoint import store as checkpoint
    from fluxzero.train.distributed import TrainingError

    for tag in ("step_00000001", "step_00000002"):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "run.yaml").write_text("steps: 2\n")
    with locks.reading(tmp_path, "step_00000001"):  # the export's shared lock
        assert checkpoint.prune_checkpoints(tmp_path, "step_00000002", keep=1) == []
        assert (tmp_path / "step_00000001" / "run.yaml").read_text() == "steps: 2\n"  # intact while it is read
    assert checkpoint.prune_checkpoints(tmp_path, "step_00000002", keep=1) == ["step_00000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]
    with (
        pytest.raises(
            TrainingError,
            match=r"^step_00000001 was pruned by the running training \(checkpoint.keep"
            r"\) before it could be read; run export again",
        ),
        locks.reading(tmp_path, "step_00000001"),
    ):
        pass


def test_an_export_of_a_pruned_step_folder_says_so(tmp_path):
    from fluxzero.train.distributed import TrainingError
    from fluxzero.train.export.consolidate import resolve_checkpoint

    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "latest").write_text("step_00000002")
    with pytest.raises(TrainingError, match="step_00000001 is gone: pruned by the running training"):
        resolve_checkpoint(tmp_path / "step_00000001")


def test_a_reader_waiting_on_a_pruning_learns_the_folder_is_gone(tmp_path):
    """Pruning holds the lock while it renames the folder away; a reader that opened the lock file before gets it
    afterwards and must see that the folder went (a child process holds the exclusive lock, as the trainer does)."""
    from fluxzero.train.checkpoint import locks
    from fluxzero.train.distributed import TrainingError

    (tmp_path / "step_00000001").mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import fcntl, os, shutil, sys, time
        fd = os.open({str(tmp_path / "step_00000001" / locks.READ_LOCK)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(1.0)
        os.rename({str(tmp_path / "step_00000001")!r}, {str(tmp_path / ".pruning-step_00000001")!r})
        os.close(fd)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "held\n"
    with (
        pytest.raises(TrainingError, match="was pruned by the running training"),
        locks.reading(tmp_path, "step_00000001"),
    ):
        pass
    assert holder.wait(timeout=30) == 0


def test_a_universal_checkpoint_has_every_torch_file_in_its_tree_scanned(tmp_path):
    """load_universal: DeepSpeed reads its own tree (zero/<param>/fp32.pt, ...), so the names are not a closed set;
    every file torch.load could be handed, at any depth and under any name, must pass the pickle scan."""
    import torch

    from fluxzero.train.checkpoint.integrity import stray_files_problem

    (tmp_path / "zero" / "w").mkdir(parents=True)
    torch.save({"fp32": torch.zeros(2)}, tmp_path / "zero" / "w" / "fp32.pt")
    (tmp_path / "notes.json").write_text("{}")
    assert stray_files_problem(tmp_path, [], universal=True, advice="fix it") is None
    _payload(tmp_path / "zero" / "w" / "state", tmp_path / "PWNED")  # no .pt suffix: found by its zip header
    problem = stray_files_problem(tmp_path, [], universal=True, advice="fix it")
    assert problem.startswith(f"checkpoint {tmp_path} is incomplete or corrupt (state holds Python code references")
    assert problem.endswith("; fix it") and not (tmp_path / "PWNED").exists()
