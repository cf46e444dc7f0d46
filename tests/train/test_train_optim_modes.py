"""The memory-saving optimizer modes through the trainer (launch/train.py, flux-tiny, CPU): a run resumed from
its checkpoint reproduces the uninterrupted one exactly, and the export holds the trained weights.

The modes' training quality against fp32 masters is proven in tests/train/test_optim_quality.py (plain PyTorch) and
tests/train/test_optim_deepspeed.py (real engines); here: that the trainer builds, checkpoints and exports them.
"""

import json

import pytest
import torch
import yaml

from tests.helpers import tiny_ds, train_all_ok, train_ok

pytest.importorskip("torchao")

DATA = "synthetic:n=16,hw=4x4,txt=4,ctx=64,vec=32"


def _ds(mode: str, stage: int) -> dict:
    from fluxzero.config.optim_modes import get_mode

    fz = {"optimizer_mode": mode}
    if get_mode(mode).fused:  # two of flux-tiny's four blocks streamed: their host copies are what is saved
        fz["offload_blocks"] = 2
    ds = tiny_ds(stage, clipping=0.0, weight_decay=0.0, fluxzero=fz)
    section = get_mode(mode).ds_bf16_section(stage)
    if section:
        ds["bf16"] = section
    if stage:
        ds["zero_allow_untested_optimizer"] = True
    if get_mode(mode).needs_offload:  # the host modes step DeepSpeed's offloaded bf16 partitions
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        ds["zero_force_ds_cpu_optimizer"] = False
    return ds


_train = train_ok


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "mode, stage",
    [
        ("bf16-kahan", 2),
        ("adafactor-sr", 0),
        ("bf16-sr", 3),
        ("cpu-bf16-sr", 2),
        ("cpu-adamw8bit-sr", 3),
        ("adamw8bit-sr", 0),
        ("adamw8bit-sr", 2),
        ("adamw8bit-sr", 3),
        ("fused-adafactor-sr", 0),
    ],
)
def test_mode_resumes_exactly_and_exports_the_trained_weights(tmp_path, monkeypatch, mode, stage):
    from safetensors.torch import load_file

    if mode == "adamw8bit-sr":  # torchao compiles its step per tensor (~50 s on CPU); eager runs the same math
        monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")

    (tmp_path / "ds.json").write_text(json.dumps(_ds(mode, stage)))
    runs = {}
    for name in ("whole", "cut"):
        cfg = {
            "deepspeed": str(tmp_path / "ds.json"),
            "data": DATA,
            "output_dir": str(tmp_path / name),
            "steps": 4,
            "checkpoint": {"every": 2},
            "export": {"format": "bfl", "dtype": "fp32"},
            "seed": 1,
        }
        runs[name] = tmp_path / f"{name}.yaml"
        runs[name].write_text(yaml.safe_dump(cfg))
    train_all_ok([runs["whole"]], [runs["cut"], "stop_after=2"])  # one process; the resume in a new one:
    _train(runs["cut"])
    assert _losses(tmp_path / "whole") == _losses(tmp_path / "cut")
    whole, cut = (
        load_file(tmp_path / "whole" / "export.safetensors"),
        load_file(tmp_path / "cut" / "export.safetensors"),
    )
    assert all(torch.equal(whole[k], cut[k]) for k in whole)

    # the export is the trained model: the bf16 module weights DeepSpeed saved at the last step, exactly
    # (the bf16 masters and the module weights are the same values in these modes)
    tag = tmp_path / "whole" / "checkpoints" / "step_00000004"
    if stage == 3:  # ZeRO-3 keeps module weights partitioned: compare with the step-2 export instead
        from fluxzero.train.export.consolidate import consolidated_state_dict

        first, _ = consolidated_state_dict(tmp_path / "whole" / "checkpoints" / "step_00000002")
        assert any(not torch.equal(first[k], whole[k]) for k in whole)  # the weights moved after step 2
        if mode == "adamw8bit-sr":  # the 8-bit states themselves were saved and resumed, not a bf16 fallback
            states = torch.load(next(tag.glob("*optim_states.pt")), map_location="cpu", weights_only=False)
            zero3 = states["optimizer_state_dict"]["optimizer_state_dict"]  # DeepSpeed's wrapper, then torch's
            assert zero3["state"][0]["exp_avg"]["codes"].dtype == torch.uint8
        return
    module = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    moved = 0
    for k, v in whole.items():
        assert torch.equal(v.bfloat16(), module[k].bfloat16()), k
        moved += 1
    assert moved == len(module)
