"""What the trainer does when a run goes wrong: SIGTERM / SIGUSR1 save at the next step boundary (every rank the
same step) and resume bit-exactly, a diverged update is never saved, an output_dir in use or holding a finished
run's results is refused, another lr scheduler on resume and duplicate run-file keys are one sentence.

Real runs of launch/train.py (flux-tiny, CPU, gloo), each in its own process; two ranks are started by hand
(RANK/WORLD_SIZE set, no launcher) so that a signal can reach one rank alone.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import start_ranks, tiny_ds, train

_ds = tiny_ds

DATA = "synthetic:n=64,hw=8x8,txt=4,ctx=64,vec=32"


def _files(tmp, ds=None, **run):
    (tmp / "ds.json").write_text(json.dumps(ds or tiny_ds()))
    cfg = {
        "deepspeed": str(tmp / "ds.json"),
        "data": DATA,
        "output_dir": str(tmp / "out"),
        "steps": 6,
        "export": {"format": None},
        "log_every": 1,
        **run,
    }
    (tmp / "run.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "run.yaml"


def _train(run_file, *over, env=None, timeout=300):
    return train(run_file, *over, env=env, timeout=timeout)


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows}


def _wait_for_step(out: Path, step: int, procs, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / "metrics.jsonl").is_file() and max(_losses(out), default=0) >= step:
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(
                "a rank ended before the signal: " + "".join(p.communicate()[1][-2000:] for p in procs)
            )
        time.sleep(0.05)
    raise AssertionError("training did not reach the step in time")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-rank run both signals' runs must reproduce (one run for both: same files, seed, data)."""
    ref = _files(tmp_path_factory.mktemp("ref"), steps=12)
    procs = start_ranks(ref)
    assert [p.wait(timeout=300) for p in procs] == [0, 0], procs[0].stderr.read()[-3000:]
    return _losses(ref.parent / "out")


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_stop_signal_to_one_rank_saves_the_same_step_on_both_and_resumes_exactly(tmp_path, sig, reference):
    assert sorted(reference) == list(range(1, 13))
    (tmp_path / "cut").mkdir()
    cut = _files(tmp_path / "cut", steps=12)
    out = tmp_path / "cut" / "out"
    procs = start_ranks(cut)
    _wait_for_step(out, 3, procs)
    sent = time.monotonic()
    procs[1].send_signal(getattr(signal, sig))  # rank 1 only: rank 0 learns of it in the loss all-reduce
    codes = [p.wait(timeout=120) for p in procs]
    grace = time.monotonic() - sent
    errs = [p.stderr.read() for p in procs]
    assert codes == [143, 143], errs
    assert "stopped: stopped by" in errs[0] and "Traceback" not in errs[0] + errs[1], errs
    saved = (out / "checkpoints" / "latest").read_text()
    step = int(saved.split("_")[1])
    assert 3 <= step < 12 and f"after step {step} of 12" in errs[0]
    assert (out / "checkpoints" / saved / "trainer_state_rank1.pt").is_file()  # both ranks saved that step
    assert grace < 60, grace  # one step and one save of flux-tiny, with a wide margin for a loaded machine

    procs = start_ranks(cut)
    assert [p.wait(timeout=300) for p in procs] == [0, 0], procs[0].stderr.read()[-3000:]
    assert _losses(out) == reference  # bit-exact: the resumed run continues the same noise, data and optimizer


def test_a_diverged_update_is_never_saved_and_the_good_checkpoint_stays(tmp_path):
    # step 1 at lr 1e-3, step 2 at 1e39: torch's fused AdamW (what gen-config writes) applies it, the weights
    # after step 2 are inf while the loss of step 2 (computed before that update) is still finite
    boom = _ds(
        gradient_clipping=0.0,
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e39, "warmup_num_steps": 1, "warmup_type": "linear"},
        },
    )
    boom["optimizer"]["params"]["fused"] = True
    run = _files(tmp_path, boom, steps=3, checkpoint={"every": 1, "keep": 1})
    r = _train(run)
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    # the first step at the large lr (DeepSpeed's WarmupLR reaches it at its second or third step) diverges
    bad = int(re.search(r"the weights after step (\d+) are not finite", lines[0]).group(1))
    good = f"step_{bad - 1:08d}"
    assert bad >= 2 and f"{good} is kept" in lines[0], lines[0]
    ck = tmp_path / "out" / "checkpoints"
    assert (ck / "latest").read_text() == good and sorted(p.name for p in ck.glob("step_*")) == [good]


def test_refusals_in_one_sentence(tmp_path):
    from fluxzero.train.checkpoint import locks

    run = _files(tmp_path, steps=1, checkpoint={"every": 1})
    assert _train(run).returncode == 0

    def refused(*over, run_file=run):
        r = _train(run_file, *over)
        lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        return lines[0]

    (tmp_path / "sched.json").write_text(
        json.dumps(
            _ds(
                scheduler={
                    "type": "WarmupLR",
                    "params": {
                        "warmup_min_lr": 0.0,
                        "warmup_max_lr": 1e-3,
                        "warmup_num_steps": 2,
                        "warmup_type": "linear",
                    },
                }
            )
        )
    )
    assert "was trained with lr scheduler none but" in refused(f"deepspeed={tmp_path / 'sched.json'}", "steps=2")

    # a finished run whose checkpoints were deleted: its export would be overwritten
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "export.safetensors").write_bytes(b"weights")
    msg = refused(f"output_dir={tmp_path / 'done'}")
    assert "holds the results of an earlier run (export.safetensors) but no checkpoint" in msg
    assert (tmp_path / "done" / "export.safetensors").read_bytes() == b"weights"

    # an output_dir another run holds: this test process takes the lock the trainer takes
    locks.lock_output_dir(tmp_path / "busy")
    try:
        msg = refused(f"output_dir={tmp_path / 'busy'}")
        assert f"output_dir {tmp_path / 'busy'} is in use by another run (process {os.getpid()}" in msg
    finally:
        locks.release_output_dir()
    assert _train(run, f"output_dir={tmp_path / 'busy'}").returncode == 0  # the lock went with its holder

    dup = tmp_path / "dup.yaml"
    dup.write_text(run.read_text() + "steps: 5\n")
    assert "key 'steps' appears twice" in refused(run_file=dup)


def test_a_killed_writers_temp_file_is_removed_at_the_next_export(tmp_path):
    from fluxzero.fsutil import remove_stale_temps

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has ended
    (tmp_path / f".export.safetensors.tmp-{pid}").write_bytes(b"half an export")
    (tmp_path / f".export.safetensors.tmp-{os.getpid()}").write_bytes(b"a live writer's")
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / f".diffusion_pytorch_model-00001-of-00002.safetensors.tmp-{pid}").write_bytes(b"x")
    assert remove_stale_temps(tmp_path / "export.safetensors") == [f".export.safetensors.tmp-{pid}"]
    assert remove_stale_temps(tmp_path / "export") == [f".diffusion_pytorch_model-00001-of-00002.safetensors.tmp-{pid}"]
    assert (tmp_path / f".export.safetensors.tmp-{os.getpid()}").is_file()


def test_an_lr_edited_for_the_resume_is_applied_and_said(tmp_path):
    # without a scheduler DeepSpeed's checkpoint load would restore the old lr (the optimizer's param groups)
    run = _files(tmp_path, steps=4)
    assert _train(run, "stop_after=2").returncode == 0
    (tmp_path / "half.json").write_text(json.dumps(tiny_ds(lr=5e-4)))
    r = _train(run, f"deepspeed={tmp_path / 'half.json'}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "note: lr is 0.0005 from the DeepSpeed config (the checkpoint trained at 0.001)" in r.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["lr"] for row in rows] == [1e-3, 1e-3, 5e-4, 5e-4]


def _validation_shards(folder: Path, nan_sample: int | None = None) -> Path:
    """4 held-out samples of flux-tiny's sizes in one shard; sample `nan_sample` with a NaN latent (its checksum
    is right: the bytes are what the writer was given)."""
    import torch

    from fluxzero.data import ShardWriter

    torch.manual_seed(3)
    with ShardWriter(folder, samples_per_shard=4) as w:
        for i in range(4):
            latents = torch.randn(16, 8, 8)
            if i == nan_sample:
                latents[0, 0, 0] = float("nan")
            w.add(latents, torch.randn(4, 64), torch.randn(32))
    return folder


def _flip_latent_byte(shard_dir: Path, sample: int) -> None:
    """One byte of `sample`'s latents changed in place (same file, same size: what a disk error leaves)."""
    shard = next(shard_dir.glob("shard-*.safetensors"))
    with open(shard, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        start = json.loads(f.read(n))["latents"]["data_offsets"][0]
        offset = 8 + n + start + sample * 16 * 8 * 8 * 4 + 100  # latents float32 (4, 16, 8, 8)
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_a_damaged_or_nan_validation_sample_is_refused_before_training(tmp_path):
    flipped = _validation_shards(tmp_path / "flipped")
    _flip_latent_byte(flipped, 2)
    nan = _validation_shards(tmp_path / "nan", nan_sample=1)
    run = _files(tmp_path, steps=2)
    for data, words in (
        (flipped, "sample 2 (global index 2) fails its checksum"),
        (nan, "sample 1 (global index 1) holds non-finite latents values"),
    ):
        r = _train(run, f"validation.data={data}", f"output_dir={tmp_path / data.name / 'out'}")
        lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert lines[0].startswith("error: validation.data: ") and words in lines[0], lines[0]
        assert not (tmp_path / data.name / "out" / "metrics.jsonl").exists()  # refused before the first step


def test_a_validation_sample_damaged_mid_run_stops_after_saving_the_training(tmp_path):
    val = _validation_shards(tmp_path / "val")
    run = _files(tmp_path, steps=40, validation={"data": str(val), "every": 20}, checkpoint={"every": 0})
    out = tmp_path / "out"
    procs = start_ranks(run, world=1)
    _wait_for_step(out, 1, procs)
    _flip_latent_byte(val, 3)  # after the start's check, before the first validation (step 20)
    code = procs[0].wait(timeout=300)
    err = procs[0].stderr.read()
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert "sample 3 (global index 3) fails its checksum" in lines[0], lines[0]
    assert "training was saved first: " in lines[0] and "step_00000020 holds step 20" in lines[0], lines[0]
    assert (out / "checkpoints" / "latest").read_text() == "step_00000020"  # checkpoint_every 0 saved it anyway


def test_a_lost_latest_resumes_from_the_newest_complete_step_folder(tmp_path):
    import shutil

    run = _files(tmp_path, steps=6, checkpoint={"every": 2})
    assert _train(run, "stop_after=4").returncode == 0
    out, ck = tmp_path / "out", tmp_path / "out" / "checkpoints"
    (ck / "latest").unlink()
    shutil.copytree(ck / "step_00000004", ck / "step_00000006")  # a save killed before rank 0's last files
    (ck / "step_00000006" / "ds_config.json").unlink()
    r = _train(run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        f"note: {ck / 'latest'} is missing; resuming from step_00000004, the newest complete checkpoint there"
        in r.stderr
        and "resuming from step 4 " in r.stderr
    ), r.stderr[-3000:]
    assert sorted(_losses(out)) == [1, 2, 3, 4, 5, 6]
    assert (ck / "latest").read_text() == "step_00000006" and (ck / "step_00000002" / "run.yaml").is_file()


def test_ctrl_c_and_the_launchers_sigterm_together_interrupt_once():
    """Ctrl-C reaches a rank with the launcher's SIGTERM right behind it: the first interrupts, the second must not
    raise again inside the cleanup the first started (before the loop, where SIGTERM means 'stop now'); the next
    run in the same process is interruptible again. In a child process: an escaping interrupt would stop pytest."""
    code = (
        "import os, signal, time\n"
        "from fluxzero.train import distributed\n"
        "old = distributed.install_stop_handlers()\n"
        "try:\n    os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
        "except KeyboardInterrupt:\n    os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.05); print('cleaned')\n"
        "distributed.restore_handlers(old)\n"
        "old = distributed.install_stop_handlers()\n"
        "try:\n    os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n"
        "except KeyboardInterrupt:\n    print('interrupted again')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n")[:2] == ["cleaned", "interrupted again"], out.stdout + out.stderr
