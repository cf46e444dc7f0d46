"""The device rule of the trainer's own collectives (fluxzero.train.distributed): under NCCL a CPU tensor never
reaches the group, whatever the offload settings (ZeRO-3 parameter offload keeps the weights, and a flag built
from them, on the CPU; NCCL then fails with "No backend type associated with device type cpu").

CPU CI has only gloo, which reduces CPU tensors, so the slow test runs real 2-rank gloo training with the rule
enforced from outside: a prelude wraps torch.distributed's collectives so that a call from fluxzero code other than
the helpers fails as NCCL would, and FLUXZERO_COMM_CHECK makes the helpers judge each tensor as if the group were
NCCL and record who called them, so the test sees that every trainer collective path ran through them.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import TRAIN_PY, popen_ranks, tiny_ds, tiny_weights

DATA = "synthetic:n=4,hw=8x8,txt=4,ctx=64,vec=32"


def test_rule_is_the_backends_device(monkeypatch):
    from fluxzero.train.distributed import backend_device, placement_problem

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert backend_device("gloo") == torch.device("cpu")
    assert backend_device("nccl") == torch.device("cuda", 1)  # this rank's GPU, not cuda:0
    assert "no CPU backend" in placement_problem(torch.device("cpu"), "nccl")
    assert placement_problem(torch.device("cpu"), "gloo") is None
    assert placement_problem(torch.device("cuda", 0), "nccl") is None


# Runs launch/train.py after wrapping torch.distributed's collectives: fluxzero code must call the helpers of
# fluxzero.train.distributed, which place the tensor on the backend's device (DeepSpeed's calls pass).
GUARDED_TRAIN = r"""
import functools, runpy, sys
import torch.distributed as dist

def guarded(fn, name):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("fluxzero") and caller != "fluxzero.train.distributed":
            raise RuntimeError(f"No backend type associated with device type cpu (as under NCCL): {caller} called "
                               f"torch.distributed.{name} directly")
        return fn(*args, **kwargs)
    return call

for name in ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
             "gather", "scatter", "broadcast_object_list", "all_gather_object", "gather_object"):
    setattr(dist, name, guarded(getattr(dist, name), name))
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# every collective path of the trainer's own, as the helpers record it (module.function op)
EXPECTED = {
    "fluxzero.train.checkpoint.resume.decide_resume broadcast_object_list",  # the resume decision
    "fluxzero.train.checkpoint.resume.decide_resume all_gather_object",  # all_ranks_ok: every rank's own problem
    "fluxzero.train.engine.load_pretrained broadcast_object_list",  # ZeRO-3: rank 0 reads the weights
    "fluxzero.train.ema.ShardedEMA._check_coverage all_reduce",
    "fluxzero.train.step.TrainStep._reduce_and_check all_reduce",  # loss and stop flag, one reduction
    "fluxzero.train.metrics.Metrics.log all_gather",
    "fluxzero.train.evaluate.Validation.__call__ all_reduce",
    "fluxzero.train.checkpoint.store.weights_finite all_reduce",  # the crash of a ZeRO-3 parameter-offload save
    "fluxzero.train.loop._check_finite all_gather_object",  # a non-finite loss names its samples
}


def _ranks(cmd, env_extra, monkeypatch, timeout=300):
    for k, v in env_extra.items():
        monkeypatch.setenv(k, v)
    procs = popen_ranks(cmd, 2)
    out = [p.communicate(timeout=timeout) for p in procs]
    return [p.returncode for p in procs], [e for _, e in out]


@pytest.mark.slow
def test_trainer_collectives_follow_the_nccl_rule_under_zero3_parameter_offload(tmp_path, monkeypatch):
    # ZeRO-3 with parameter offload alone (gen-config --preset zero3 --offload-param cpu), LoRA + EMA +
    # validation: save at step 2, resume to 4 (final save, export), then a resume with an lr that blows up
    zero = {"stage": 3, "offload_param": {"device": "cpu"}}
    (tmp_path / "ds.json").write_text(json.dumps(tiny_ds(3, clipping=0.0, lr=1e-2, zero_optimization=zero)))
    (tmp_path / "nan.json").write_text(json.dumps(tiny_ds(3, clipping=0.0, lr=1e30, zero_optimization=zero)))
    run = {
        "deepspeed": str(tmp_path / "ds.json"),
        "data": DATA,
        "validation": {"data": DATA, "every": 2},
        "output_dir": str(tmp_path / "out"),
        "weights": str(tiny_weights(tmp_path / "base.safetensors")),
        "steps": 4,
        "stop_after": 2,
        "checkpoint": {"every": 2},
        "lora": {"rank": 4, "alpha": 8},
        "ema": {"decay": 0.5},
        "export": {"format": "diffusers"},
        "seed": 3,
    }
    (tmp_path / "run.yaml").write_text(json.dumps(run))
    cmd = [sys.executable, "-c", GUARDED_TRAIN, str(TRAIN_PY), "--config", str(tmp_path / "run.yaml")]
    env = {"FLUXZERO_COMM_CHECK": str(tmp_path / "comm")}
    codes, errs = _ranks(cmd, env, monkeypatch)
    assert codes == [0, 0], errs[0][-3000:]
    codes, errs = _ranks(cmd + ["stop_after=0"], env, monkeypatch)
    assert codes == [0, 0], errs[0][-3000:]
    assert (tmp_path / "out" / "lora.safetensors").is_file()
    codes, errs = _ranks(cmd + ["steps=6", "stop_after=0", f"deepspeed={tmp_path / 'nan.json'}"], env, monkeypatch)
    assert codes == [1, 1] and "loss is nan at step 6" in errs[0], errs[0][-3000:]
    for rank in (0, 1):
        seen = set(Path(f"{tmp_path / 'comm'}.rank{rank}").read_text().splitlines())
        assert seen >= EXPECTED, sorted(EXPECTED - seen)
