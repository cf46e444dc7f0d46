"""A run on several datasets (a masked set repeated, a regularization set with its own loss weight and caption
dropout) killed with SIGKILL mid-run resumes to exactly the losses of the uninterrupted run: the loader draws the
same samples, repeats, masks, weights and dropped captions after the restart.

Real runs of launch/train.py (flux-tiny, CPU, one rank), each in its own process, as a user's would be.
"""

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import rank_env, tiny_ds, train_all_ok, train_cmd, train_ok

STEPS = 12  # the kill comes at step 4 or later: the rest leaves a wide margin on a loaded machine


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows}


def _run_file(tmp: Path, shards: Path, name: str, weight: float = 0.5, floor: float = 0.1) -> Path:
    (tmp / "ds.json").write_text(json.dumps(tiny_ds()))
    data = [
        {"path": str(shards), "repeats": 2},
        {"path": "synthetic:n=6,hw=8x8,txt=4,ctx=64,vec=32", "loss_weight": weight, "caption_dropout": 0.3},
    ]
    cfg = {
        "deepspeed": str(tmp / "ds.json"),
        "data": data,
        "output_dir": str(tmp / name),
        "steps": STEPS,
        "export": {"format": None},
        "checkpoint": {"every": 2},
        "flow": {"mask_floor": floor},
    }
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / f"{name}.yaml"


@pytest.mark.slow
def test_a_killed_run_on_several_datasets_resumes_exactly(tmp_path):
    from fluxzero.data import ShardWriter

    g = torch.Generator().manual_seed(0)
    with ShardWriter(tmp_path / "masked", samples_per_shard=2) as w:
        for i in range(5):
            mask = (torch.rand(4, 4, generator=g) > 0.5).float() if i != 2 else None  # one sample without
            w.add(
                torch.randn(16, 8, 8, generator=g),
                torch.randn(4, 64, generator=g),
                torch.randn(32, generator=g),
                mask=mask,
            )
    reference = _run_file(tmp_path, tmp_path / "masked", "reference")
    unweighted = _run_file(tmp_path, tmp_path / "masked", "unweighted", weight=1.0, floor=1.0)
    train_all_ok((reference,), (unweighted, "steps=1"))
    want = _losses(tmp_path / "reference")
    assert sorted(want) == list(range(1, STEPS + 1))
    # the same first batch without masks and weights: another loss, so the trainer applied them
    assert abs(_losses(tmp_path / "unweighted")[1] - want[1]) > 1e-3 * want[1]

    cut = _run_file(tmp_path, tmp_path / "masked", "cut")
    out = tmp_path / "cut"
    p = subprocess.Popen(train_cmd(cut), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=rank_env())
    deadline = time.monotonic() + 240
    while not ((out / "metrics.jsonl").is_file() and max(_losses(out), default=0) >= 4):
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not reach step 4 in time"
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)  # no chance to save: the resume starts from the last periodic checkpoint
    p.communicate(timeout=60)
    saved = int((out / "checkpoints" / "latest").read_text().split("_")[1])
    assert 2 <= saved < STEPS
    train_ok(cut)
    assert _losses(out) == want  # bit-exact: the same samples, masks, weights and captions after the restart
