"""The host modes through the trainer (launch/train.py, flux-tiny, CPU) with DeepSpeed's optimizer offload: the
engine starts (ZeRO's bf16-master offload check lets HostAdamW through), the optimizer steps bf16 partitions in host
memory, a run resumed from its checkpoint reproduces the uninterrupted one exactly, and the export holds the
trained weights. Quality against fp32 masters: tests/train/test_host_optim.py and test_host_optim_deepspeed.py."""
import json

import pytest
import torch
import yaml

from fluxzero.config.ds_config import build, options_from
from tests.helpers import train_ok

DATA = "synthetic:n=16,hw=4x4,txt=4,ctx=64,vec=32"


def _ds(mode: str, stage: int, **options) -> dict:
    """What `fluxzero gen-config --optimizer-mode MODE --offload-optimizer cpu` writes for flux-tiny on CPU."""
    return build(options_from(None, model="flux-tiny", optimizer_mode=mode, zero_stage=stage, offload_optimizer="cpu",
                              offload_pin_memory=False, micro_batch=2, grad_accum=1, checkpoint_every=0,
                              gradient_clipping=0.0, scheduler="none", lr=1e-3, **options))


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode, stage", [("cpu-bf16-sr", 2), ("cpu-adamw8bit-sr", 3)])
def test_host_mode_resumes_exactly_and_exports_the_trained_weights(tmp_path, mode, stage):
    if "8bit" in mode:
        pytest.importorskip("torchao")
    from safetensors.torch import load_file

    from fluxzero.train.consolidate import consolidated_state_dict

    ds = _ds(mode, stage)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu" and ds["bf16"]["bf16_optimizer_states"]
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    runs = {}
    for name in ("whole", "cut"):
        cfg = {"deepspeed": str(tmp_path / "ds.json"), "data": DATA, "output_dir": str(tmp_path / name),
               "steps": 4, "checkpoint_every": 2, "export_format": "bfl", "export_dtype": "fp32", "seed": 1}
        runs[name] = tmp_path / f"{name}.yaml"
        runs[name].write_text(yaml.safe_dump(cfg))
    train_ok(runs["whole"])
    train_ok(runs["cut"], "stop_after=2")
    train_ok(runs["cut"])
    losses = _losses(tmp_path / "whole")
    assert losses == _losses(tmp_path / "cut") and len(losses) == 4
    whole, cut = load_file(tmp_path / "whole" / "export.safetensors"), load_file(tmp_path / "cut" / "export.safetensors")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    # the optimizer really held bf16 master partitions and its own states (not DeepSpeed's CPU Adam's)
    ck = tmp_path / "whole" / "checkpoints"
    optim = next((ck / "step_00000004").glob("*optim_states.pt"))
    sd = torch.load(optim, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    states = sd["optimizer_state_dict"]["state"] if "optimizer_state_dict" in sd else sd["base_optimizer_state"]["state"]
    keys = set().union(*(s.keys() for s in states.values()))
    assert "sr_stream" in keys and ("exp_avg_codes" in keys) is ("8bit" in mode)
    # the export is the trained model: it moved after step 2
    first, _ = consolidated_state_dict(ck / "step_00000002")
    assert any(not torch.equal(first[k], whole[k]) for k in whole)
