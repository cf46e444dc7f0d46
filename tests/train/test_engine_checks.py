"""fluxzero.train.engine's checks that need no process group: the DeepSpeed config the trainer accepts, the ZeRO-0
fp32 master weights of an export, damaged checkpoint files and `latest`. The distributed side (every rank
stops with one sentence) is in test_train_distributed.py."""

import glob
import json
from pathlib import Path

import pytest
import torch

from fluxzero.config.deepspeed import check as ds_check
from fluxzero.config.deepspeed.file import load_for_training
from fluxzero.config.deepspeed.view import DSConfigError
from fluxzero.train.checkpoint.integrity import file_problem
from fluxzero.train.distributed import TrainingError
from fluxzero.train.export.consolidate import _stage0_master_weights, consolidated_state_dict, resolve_checkpoint

ROOT = Path(__file__).resolve().parents[2]
GOOD = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
    "steps_per_print": 10**9,
}


def _load(tmp_path, ds, world=1):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return load_for_training(str(path), world)


def _with(**changes):
    ds = json.loads(json.dumps(GOOD))
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        d = ds
        for p in parents:
            d = d.setdefault(p, {})
        d[key] = value
    return ds


@pytest.mark.parametrize(
    "ds, message",
    [
        # each of these trained silently at another setting, or died in a DeepSpeed/pydantic traceback
        (
            {**{k: v for k, v in GOOD.items() if k != "zero_optimization"}, "zero_optimisation": {"stage": 2}},
            "unknown key 'zero_optimisation' (did you mean 'zero_optimization'?)",
        ),
        (_with(optimizer__type="AdamWW"), 'optimizer.type "AdamWW" is not an optimizer DeepSpeed can build'),
        (_with(zero_optimization__stage=4), "zero_optimization.stage must be 0, 1, 2 or 3, got 4"),
        (_with(optimizer__params__lr="1e-3"), 'optimizer.params.lr must be a number > 0, got "1e-3"'),
        (
            _with(fluxzero__activation_checkpointing__every_k_blocks="all"),
            'fluxzero.activation_checkpointing.every_k_blocks must be an integer >= 0 (0 = off), got "all"',
        ),
        (_with(scheduler={"type": "Cosine"}), 'scheduler.type "Cosine" is not a DeepSpeed or torch LR scheduler'),
        ({k: v for k, v in GOOD.items() if k != "gradient_clipping"}, "gradient_clipping is not set"),
    ],
)
def test_trainer_refuses_what_check_config_reports(tmp_path, ds, message):
    with pytest.raises(DSConfigError) as e:
        _load(tmp_path, ds)
    assert str(e.value).startswith(f"DeepSpeed config {tmp_path / 'ds.json'}: {message}"), str(e.value)
    assert "more; run" not in str(e.value)  # one finding each


def test_several_findings_name_the_first_and_count_the_rest(tmp_path):
    ds = _with(zero_optimization__stage=4, optimizer__type="AdamWW", steps_per_print=0)
    with pytest.raises(
        DSConfigError,
        match=r": steps_per_print must be a positive integer, got 0 \(2 more; run "
        r"`fluxzero check-config .*ds.json`\)$",
    ):
        _load(tmp_path, ds)


def test_batch_sizes_come_from_the_deepspeed_config(tmp_path):
    # the DeepSpeed config owns the batch arithmetic; the trainer completes what DeepSpeed would derive
    ds = {k: v for k, v in GOOD.items() if k != "gradient_accumulation_steps"}
    out, v = _load(tmp_path, ds, world=3)
    assert (out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"], out["train_batch_size"]) == (
        2,
        1,
        6,
    )
    assert (v.micro_batch, v.grad_accum, v.global_batch) == (2, 1, 6)
    out, v = _load(tmp_path, {**ds, "train_batch_size": 12}, world=3)
    assert (v.micro_batch, v.grad_accum) == (2, 2)
    assert "fluxzero" not in _load(tmp_path, {**GOOD, "fluxzero": {"compile": {"blocks": False}}})[0]
    with pytest.raises(
        DSConfigError,
        match=r"train_batch_size 8 != train_micro_batch_size_per_gpu 2 x "
        r"gradient_accumulation_steps 1 x world size 2",
    ):
        _load(tmp_path, {**GOOD, "train_batch_size": 8}, world=2)
    with pytest.raises(DSConfigError, match="train_micro_batch_size_per_gpu is not set"):
        _load(tmp_path, {**GOOD, "train_micro_batch_size_per_gpu": "auto"})
    with pytest.raises(DSConfigError, match="has no optimizer section"):
        _load(tmp_path, {k: v for k, v in GOOD.items() if k != "optimizer"})


@pytest.mark.parametrize(
    "path", sorted(glob.glob(str(ROOT / "ds_configs/*.json")) + glob.glob(str(ROOT / "launch/*.json")))
)
def test_every_committed_config_passes_the_trainer(path):
    from deepspeed.accelerator import get_accelerator

    from fluxzero.train.engine import check_supported

    world = ds_check.implied_world_size(json.loads(Path(path).read_text())) or 1
    _, v = load_for_training(path, world)
    accel = get_accelerator()  # it decides: some CPUs train fp16 (AVX512-FP16 / AMX), most do not
    if v.precision == "fp16" and not accel.is_fp16_supported():  # refused after every check passed
        with pytest.raises(TrainingError, match=f"trains in fp16, which DeepSpeed's {accel.device_name()} accelerator"):
            check_supported(v, path)
        return
    check_supported(v, path)


# ---------------------------------------------------------------------------------------------------------
# ZeRO-0 export: fp32 masters of DeepSpeed's FP16 optimizer wrappers (layouts as deepspeed 0.19.8 saves them)
# ---------------------------------------------------------------------------------------------------------
def _states(masters, optimizer):
    module = {
        "a.weight": masters[0].bfloat16(),
        "a.bias": masters[1].bfloat16(),
        "norm.scale": masters[2].bfloat16(),
        "rope.freqs": torch.arange(3.0),
    }
    return {"module": module, "buffer_names": ["rope.freqs"], "optimizer": optimizer}


MASTERS = [torch.randn(3, 4), torch.randn(3), torch.randn(5)]


def test_stage0_masters_from_the_unfused_wrapper():
    sd = _stage0_master_weights(_states(MASTERS, {"fp32_groups": [MASTERS[:2], MASTERS[2:]], "cur_scale": 1.0}))
    assert all(torch.equal(sd[k], m) for k, m in zip(["a.weight", "a.bias", "norm.scale"], MASTERS))
    assert torch.equal(sd["rope.freqs"], torch.arange(3.0))  # buffers from the module


def test_stage0_masters_from_the_fused_wrapper():
    flat = [torch.cat([MASTERS[0].reshape(-1), MASTERS[1]]), MASTERS[2]]
    sd = _stage0_master_weights(_states(MASTERS, {"fp32_groups_flat": flat}))
    assert all(torch.equal(sd[k], m) for k, m in zip(["a.weight", "a.bias", "norm.scale"], MASTERS))
    assert sd["a.weight"].shape == (3, 4)


def test_stage0_fp32_run_exports_its_module():
    states = _states(MASTERS, {"state": {}, "param_groups": []})  # plain torch optimizer: no masters elsewhere
    assert _stage0_master_weights(states) is states["module"]


def test_stage0_masters_that_do_not_pair_up_are_refused():
    swapped = [MASTERS[0], torch.randn(3), MASTERS[2]]  # same shapes, other values: a wrong pairing
    with pytest.raises(TrainingError, match="do not pair up with its module weights"):
        _stage0_master_weights(_states(MASTERS, {"fp32_groups": [swapped]}))
    with pytest.raises(TrainingError, match="do not pair up"):
        _stage0_master_weights(_states(MASTERS, {"fp32_groups": [MASTERS[:2]]}))


# ---------------------------------------------------------------------------------------------------------
# Damaged files and `latest`
# ---------------------------------------------------------------------------------------------------------
def test_torch_files_overwritten_in_place_fail_their_crc(tmp_path):
    f = tmp_path / "x.pt"
    torch.save({"w": torch.randn(100_000)}, f)
    assert file_problem(f) is None
    data = bytearray(f.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 2000] = bytes(2000)  # same size: torch.load would not notice
    f.write_bytes(bytes(data))
    torch.load(f, weights_only=True)
    assert file_problem(f).startswith("x.pt fails its CRC-32 check in x/data/")
    f.write_bytes(bytes(data[:1000]))
    assert file_problem(f) == "x.pt is not a complete torch file"
    assert file_problem(tmp_path / "y.pt") == "y.pt is missing"


def test_export_refuses_a_broken_latest(tmp_path):
    ck = tmp_path / "checkpoints"
    (ck / "step_00000002").mkdir(parents=True)
    (ck / "latest").write_text("\n")
    with pytest.raises(
        TrainingError,
        match=r"latest is empty; export one of its checkpoint folders instead, such as "
        r".*step_00000002$",
    ):
        resolve_checkpoint(tmp_path)
    (ck / "latest").write_text("step_00000004")
    with pytest.raises(TrainingError, match="latest names 'step_00000004', which is not a folder in"):
        resolve_checkpoint(ck)
    (ck / "latest").write_text("step_00000002")
    with pytest.raises(
        TrainingError,
        match=r"step_00000002 is incomplete or corrupt \(it has no DeepSpeed model "
        r"states file\)",
    ):
        consolidated_state_dict(ck)


def test_prune_keeps_the_newest_and_never_touches_newer_or_foreign_folders(tmp_path):
    from fluxzero.train.checkpoint.store import prune_checkpoints

    for name in (
        "step_00000010",
        "step_00000020",
        "step_00000030",
        "step_00000040",
        "step_00000050",
        "step_backup",
        "other",
    ):
        (tmp_path / name).mkdir()
    # latest is step 40 (say, pointed back at by hand after step 50 was damaged)
    assert prune_checkpoints(tmp_path, "step_00000040", keep=2) == ["step_00000010", "step_00000020"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "other",
        "step_00000030",
        "step_00000040",
        "step_00000050",
        "step_backup",
    ]
    assert prune_checkpoints(tmp_path, "step_00000040", keep=1) == ["step_00000030"]
