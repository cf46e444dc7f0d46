"""gen-config / check-config without deepspeed: option rules, config checks, CLI behaviour, import hygiene."""

from __future__ import annotations

import json
import os
import stat

import pytest
from click.testing import CliRunner

from fluxzero import fsutil
from fluxzero.cli import main
from fluxzero.commands import config as config_cmd
from fluxzero.config.deepspeed import build as ds_config
from fluxzero.config.deepspeed import check as ds_check
from fluxzero.config.deepspeed.build import build, options_from
from fluxzero.config.deepspeed.check import check
from fluxzero.config.deepspeed.view import DSConfigError
from tests.pure_python import run_without_torch


def run(*args):
    return CliRunner().invoke(main, list(args))


def gen(*args) -> dict:
    r = run("gen-config", *args)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


# ---------------------------------------------------------------------------------------------------------
# gen-config output


def test_defaults_are_explicit_and_world_free():
    cfg = gen()
    assert "train_batch_size" not in cfg  # unknown world size: DeepSpeed derives it at launch
    assert cfg["train_micro_batch_size_per_gpu"] == 1 and cfg["gradient_accumulation_steps"] == 1
    assert cfg["gradient_clipping"] == 1.0  # always written: deepspeed 0.19.8 would clip at 1.0 silently
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert cfg["optimizer"]["params"]["torch_adam"] is True
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["fluxzero"] == {"activation_checkpointing": {"every_k_blocks": 1, "implementation": "torch"}}
    assert check(cfg) == []


@pytest.mark.parametrize(
    "how, world",
    [
        (["--world-size", "6"], 6),
        (["--nodes", "2", "--gpus-per-node", "4"], 8),
        (["--gpus-per-node", "3"], 3),
    ],
)
def test_batch_arithmetic(how, world):
    cfg = gen("--micro-batch", "2", "--grad-accum", "3", *how)
    assert cfg["train_batch_size"] == 2 * 3 * world
    cfg = gen("--micro-batch", "2", "--global-batch", str(2 * 5 * world), *how)
    assert (cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == (5, 2 * 5 * world)


def test_world_size_from_hostfile(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# two nodes\nnode-a slots=4\nnode-b slots=2\n")
    cfg = gen("--hostfile", str(hosts), "--micro-batch", "1", "--global-batch", "12")
    assert (cfg["train_batch_size"], cfg["gradient_accumulation_steps"]) == (12, 2)
    hosts.write_text("node-a slots=four\n")
    r = run("gen-config", "--hostfile", str(hosts))
    assert r.exit_code == 2 and "--hostfile" in r.output and "hosts:1:" in r.output


def test_batch_mismatch_names_the_three_numbers():
    r = run("gen-config", "--micro-batch", "4", "--grad-accum", "3", "--world-size", "2", "--global-batch", "32")
    assert r.exit_code == 2
    assert "--global-batch 32 != micro batch 4 x accumulation steps 3 x world size 2 (= 24)" in r.output
    r = run("gen-config", "--micro-batch", "4", "--world-size", "2", "--global-batch", "30")
    assert r.exit_code == 2 and "30 is not a multiple of micro batch 4 x world size 2" in r.output
    r = run("gen-config", "--global-batch", "32")
    assert r.exit_code == 2 and "needs the world size" in r.output


def test_presets_and_overrides():
    cfg = gen("--preset", "zero3-offload")
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"]["device"] == "cpu" and z["offload_optimizer"]["device"] == "cpu"
    h = 3072  # flux-dev hidden size
    assert (z["reduce_bucket_size"], z["stage3_param_persistence_threshold"]) == (h * h, 10 * h)
    cfg = gen("--preset", "zero3-offload", "--offload-param", "none", "--model", "flux-tiny", "--no-offload-pin-memory")
    z = cfg["zero_optimization"]
    assert "offload_param" not in z and z["offload_optimizer"]["pin_memory"] is False
    assert z["reduce_bucket_size"] == 64 * 64
    cfg = gen("--preset", "fp16")
    assert cfg["fp16"]["loss_scale"] == 0.0 and cfg["fp16"]["initial_scale_power"] == 12
    assert cfg["optimizer"]["params"]["torch_adam"] is False and "bf16" not in cfg
    assert "bf16" not in gen("--precision", "fp32") and "fp16" not in gen("--precision", "fp32")


def test_deepspeed_checkpointing_section():
    cfg = gen(
        "--model",
        "flux-tiny",
        "--checkpoint-impl",
        "deepspeed",
        "--checkpoint-every",
        "3",
        "--partition-activations",
        "--contiguous-memory-optimization",
        "--cpu-checkpointing",
    )
    ac = cfg["activation_checkpointing"]
    assert ac["partition_activations"] and ac["cpu_checkpointing"] and ac["contiguous_memory_optimization"]
    assert ac["number_checkpoints"] == 2  # flux-tiny has 4 blocks; blocks 0 and 3 are checkpointed
    assert cfg["fluxzero"]["activation_checkpointing"] == {"every_k_blocks": 3, "implementation": "deepspeed"}
    assert "activation_checkpointing" not in gen("--checkpoint-impl", "torch")
    assert gen("--checkpoint-every", "0")["fluxzero"]["activation_checkpointing"]["every_k_blocks"] == 0


def test_schedulers():
    # DeepSpeed runs optimizer step k at scheduler iteration k - 2 (steps 1 and 2 at warmup_min_lr): step 1 runs at
    # lr / N, the peak comes at step N (test_ds_config_deepspeed.py reads the lr of real engines)
    s = gen("--lr", "2e-5", "--warmup-steps", "7")["scheduler"]
    assert s == {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": pytest.approx(2e-5 / 7),
            "warmup_max_lr": 2e-5,
            "warmup_num_steps": 5,
            "warmup_type": "linear",
        },
    }
    assert gen("--warmup-steps", "7", "--warmup-type", "log")["scheduler"]["params"]["warmup_num_steps"] == 6
    s = gen(
        "--scheduler",
        "WarmupCosineLR",
        "--total-steps",
        "50",
        "--warmup-steps",
        "10",
        "--lr",
        "1e-4",
        "--min-lr",
        "1e-5",
    )["scheduler"]
    # step 1 of a ramp from 1e-5 to 1e-4 over 10 steps: 1e-5 + 9e-5 / 10 = 1.9e-5 (ratio 0.19)
    assert s["params"]["total_num_steps"] == 49 and s["params"]["warmup_min_ratio"] == pytest.approx(0.19)
    assert gen("--scheduler", "WarmupDecayLR", "--total-steps", "500")["scheduler"]["params"]["total_num_steps"] == 499
    assert gen("--warmup-steps", "1")["scheduler"]["params"]["warmup_min_lr"] == pytest.approx(1e-5)  # no warm-up
    assert "scheduler" not in gen("--scheduler", "none")


def test_tensorboard_section():
    tb = gen("--tensorboard-dir", "runs/tb", "--job-name", "dev")["tensorboard"]
    assert tb == {"enabled": True, "output_path": "runs/tb", "job_name": "dev"}
    assert "tensorboard" not in gen()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "zero2", "--offload-param", "cpu"], "--offload-param cpu needs --zero-stage 3"),
        (["--zero-stage", "0", "--offload-optimizer", "cpu"], "--offload-optimizer cpu needs --zero-stage 1, 2 or 3"),
        (
            ["--zero-stage", "2", "--offload-optimizer", "nvme", "--nvme-path", "/nvme"],
            "--offload-optimizer nvme needs --zero-stage 3",
        ),
        (["--preset", "zero3-nvme"], "NVMe offload needs --nvme-path"),
        (["--nvme-path", "/nvme"], "--nvme-path is only used with"),
        (
            ["--adam-impl", "fused", "--offload-optimizer", "cpu"],
            "--adam-impl fused cannot run with --offload-optimizer",
        ),
        (["--adam-impl", "cpu"], "--adam-impl cpu (DeepSpeedCPUAdam) needs --offload-optimizer"),
        (["--zero-stage", "2", "--stage3-max-live-parameters", "5"], "--stage3-max-live-parameters applies only at"),
        (["--zero-stage", "0", "--reduce-bucket-size", "5"], "--reduce-bucket-size applies only at"),
        (["--zero-stage", "3", "--allgather-bucket-size", "5"], "--allgather-bucket-size applies only at stage 1 or 2"),
        (["--fp16-initial-scale-power", "8"], "--fp16-initial-scale-power applies only with --precision fp16"),
        (["--partition-activations"], "--partition-activations takes effect only with --checkpoint-impl deepspeed"),
        (
            ["--checkpoint-impl", "deepspeed", "--contiguous-memory-optimization"],
            "--contiguous-memory-optimization needs --partition-activations",
        ),
        (["--model", "flux-tiny", "--checkpoint-every", "5"], "exceeds the 4 blocks of flux-tiny"),
        (["--scheduler", "WarmupDecayLR"], "--scheduler WarmupDecayLR needs --total-steps"),
        (
            ["--scheduler", "WarmupCosineLR", "--total-steps", "10", "--warmup-steps", "20"],
            "smaller than --warmup-steps",
        ),
        (["--total-steps", "10"], "--total-steps is used only by"),
        (["--warmup-steps", "3"], "--warmup-steps 3 is too short for DeepSpeed's linear warm-up"),
        (
            ["--optimizer-mode", "bf16-sr", "--offload-optimizer", "cpu", "--adam-impl", "torch"],
            "--optimizer-mode bf16-sr keeps bf16 master weights, which deepspeed 0.19.8 offloads only for its own",
        ),
        (["--optimizer-mode", "bf16-sr", "--precision", "fp16"], "--optimizer-mode bf16-sr trains in bf16, not fp16"),
        (["--optimizer-mode", "bf16-sr", "--adam-impl", "fused"], "--adam-impl fused chooses DeepSpeed's own AdamW"),
        (["--min-lr", "1"], "--min-lr 1.0 must be below --lr"),
        (["--job-name", "x"], "also pass --tensorboard-dir"),
        (["--world-size", "2", "--nodes", "1", "--gpus-per-node", "2"], "give the world size one way only"),
        (["--nodes", "2"], "--nodes needs --gpus-per-node"),
        (["--micro-batch", "0"], "'--micro-batch': 0 is not in the range"),
        (["--lr", "0"], "'--lr': 0.0 is not in the range"),
        (["--reduce-bucket-size", "-5"], "'--reduce-bucket-size': -5 is not in the range"),
    ],
)
def test_bad_flags_are_usage_errors(tmp_path, args, message):
    out = tmp_path / "ds.json"
    r = run("gen-config", *args, "-o", str(out))
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert isinstance(r.exception, SystemExit) and "Traceback" not in r.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_options_are_checked_for_python_callers_too():
    with pytest.raises(DSConfigError) as e:
        build(ds_config.DSOptions(micro_batch=0, lr=-1.0, zero_stage=5, precision="fp8"))
    text = str(e.value)
    for part in (
        "--micro-batch must be a positive integer, got 0",
        "--lr must be a number > 0",
        "--zero-stage must be 0, 1, 2 or 3",
        "--precision must be one of bf16, fp16, fp32",
    ):
        assert part in text
    with pytest.raises(DSConfigError, match="unknown preset 'zero9'"):
        options_from("zero9")


def test_every_option_field_is_a_flag():
    """DSOptions is the command's schema: every field (bar world_size) must be settable from the CLI."""
    cmd = config_cmd.gen_config
    names = {p.name for p in cmd.params}
    fields = {f.name for f in ds_config.dataclasses.fields(ds_config.DSOptions)} - {"world_size"}
    assert fields <= names, fields - names


# ---------------------------------------------------------------------------------------------------------
# atomic -o


def test_output_written_atomically(tmp_path, monkeypatch):
    out = tmp_path / "ds.json"
    r = run("gen-config", "--preset", "zero1", "-o", str(out))
    assert r.exit_code == 0 and json.loads(out.read_text())["zero_optimization"]["stage"] == 1
    before = out.read_bytes()
    # a failing rename (disk full, killed run) must leave the old file and no temporary behind
    monkeypatch.setattr(fsutil.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    r = run("gen-config", "--preset", "zero3", "-o", str(out))
    assert r.exit_code == 2 and "cannot write" in r.output
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["ds.json"]
    # a bad flag leaves an existing file alone as well
    monkeypatch.undo()
    assert run("gen-config", "--zero-stage", "7", "-o", str(out)).exit_code == 2
    assert out.read_bytes() == before


def test_output_permissions_and_symlinks(tmp_path):
    """-o makes a file others can read (umask applies), keeps a replaced file's mode and follows symlinks."""
    old = os.umask(0o022)
    try:
        out = tmp_path / "new.json"
        assert run("gen-config", "--preset", "zero1", "-o", str(out)).exit_code == 0
        assert stat.S_IMODE(out.stat().st_mode) == 0o644
        out.chmod(0o640)
        assert run("gen-config", "--preset", "zero2", "-o", str(out)).exit_code == 0
        assert stat.S_IMODE(out.stat().st_mode) == 0o640
        link = tmp_path / "link.json"
        link.symlink_to(out)
        assert run("gen-config", "--preset", "zero3", "-o", str(link)).exit_code == 0
        assert link.is_symlink() and json.loads(out.read_text())["zero_optimization"]["stage"] == 3
    finally:
        os.umask(old)


# ---------------------------------------------------------------------------------------------------------
# check(): hand-written configs


def _good() -> dict:
    return build(options_from("zero2", world_size=2, micro_batch=4, grad_accum=2))


def test_check_accepts_generated_configs():
    for name in ds_config.PRESETS:
        o = options_from(name, nvme_path="/nvme" if "nvme" in name else None, world_size=4)
        assert check(build(o), 4) == [], name


def test_untested_zero_optimizer_is_reported():
    """DeepSpeed's engine asserts at start for an optimizer ZeRO is not tested with (zero/utils.py)."""
    cfg = _good()  # stage 2
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    assert check(cfg, 2) == [
        "optimizer.type SGD is not one ZeRO is tested with (DeepSpeed stops at engine "
        "start): use AdamW, or set zero_allow_untested_optimizer: true"
    ]
    assert check({**cfg, "zero_allow_untested_optimizer": True}, 2) == []
    cfg["zero_optimization"] = {"stage": 0}
    assert check(cfg, 2) == []
    cfg["optimizer"]["type"] = "Lion"
    assert check(_good() | {"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}}, 2) == []


def test_silently_ignored_settings_are_reported():
    """What DeepSpeed's parser accepts and then ignores: misspelled keys in minor sections, knobs of other stages."""
    cfg = _good()  # stage 2
    cfg["flops_profiler"] = {"enable": True}
    cfg["aio"] = {"block_sz": 1048576, "queue_depth": -1}
    cfg["data_types"] = {"grad_acum_dtype": "fp32"}
    cfg["checkpoint"] = {"load_universl": True}
    cfg["zero_optimization"]["stage3_max_live_parameters"] = 10**9
    cfg["Bf16"] = {"enabled": True}
    cfg["bf16"]["enabled"] = "yes"
    cfg["steps_per_print"] = 0
    got = check(cfg, 2)
    for want in (
        "unknown key 'flops_profiler.enable' (did you mean 'enabled'?)",
        "unknown key 'aio.block_sz' (did you mean 'block_size'?)",
        "aio.queue_depth must be a positive integer, got -1",
        "unknown key 'data_types.grad_acum_dtype' (did you mean 'grad_accum_dtype'?)",
        "unknown key 'checkpoint.load_universl' (did you mean 'load_universal'?)",
        "zero_optimization.stage3_max_live_parameters applies only at stage 3",
        "unknown key 'Bf16' (did you mean 'bf16'?)",
        'bf16.enabled must be true or false, got "yes"',
        "steps_per_print must be a positive integer, got 0",
    ):
        assert any(line.startswith(want) for line in got), (want, got)
    cfg = build(options_from("zero3", world_size=2))
    cfg["zero_optimization"]["allgather_bucket_size"] = 5 * 10**8
    assert check(cfg, 2) == [
        "zero_optimization.allgather_bucket_size applies only at stage 1 or 2 "
        "(zero_optimization.stage is 3, which ignores it): remove it, or set "
        "zero_optimization.stage3_prefetch_bucket_size for stage 3's gathers"
    ]


def test_unknown_keys_get_suggestions():
    cfg = _good()
    cfg["gradient_clip"] = 1.0
    cfg["zero_optimization"]["overlap_com"] = True
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memroy": True}
    cfg["activation_checkpointing"] = {"partition_activation": True}
    cfg["optimizer"]["params"]["weight_decy"] = 0.1
    cfg["fluxzero"]["activation_checkpointing"]["every_k_block"] = 2
    cfg["fluxzero"]["activation_checkpoint"] = {}
    cfg["scheduler"]["params"]["warmup_steps"] = 10
    cfg["amp"] = {"enabled": True}
    assert check(cfg, 2) == [
        "unknown key 'gradient_clip' (did you mean 'gradient_clipping'?)",
        "key 'amp' is no longer supported by deepspeed 0.19.8 (it refuses the config): remove it",
        "unknown key 'zero_optimization.overlap_com' (did you mean 'overlap_comm'?)",
        "unknown key 'zero_optimization.offload_optimizer.pin_memroy' (did you mean 'pin_memory'?)",
        "unknown key 'optimizer.params.weight_decy' (did you mean 'weight_decay'?)",
        "unknown key 'scheduler.params.warmup_steps' (did you mean 'warmup_num_steps'?)",
        "unknown key 'activation_checkpointing.partition_activation' (did you mean 'partition_activations'?)",
        "unknown key 'fluxzero.activation_checkpoint' (did you mean 'activation_checkpointing'?)",
        "unknown key 'fluxzero.activation_checkpointing.every_k_block' (did you mean 'every_k_blocks'?)",
    ]


def test_optimizer_params_follow_the_adam_implementation():
    cfg = _good()
    cfg["optimizer"]["params"]["foreach"] = True  # a torch.optim.AdamW keyword
    assert check(cfg, 2) == []
    assert cfg["optimizer"]["params"]["fused"] is True  # gen-config's torch AdamW is torch's fused kernel
    cfg["optimizer"]["params"]["torch_adam"] = False  # now FusedAdam, which has neither `foreach` nor `fused`
    assert sorted(check(cfg, 2)) == ["unknown key 'optimizer.params.foreach'", "unknown key 'optimizer.params.fused'"]
    cfg["optimizer"]["params"].pop("fused")
    cfg["optimizer"]["params"].pop("foreach")
    cfg["optimizer"]["params"]["max_grad_norm"] = 1.0
    assert check(cfg, 2) == [
        "optimizer.params.max_grad_norm is refused by the DeepSpeed engine: use top-level gradient_clipping"
    ]
    cfg["scheduler"] = {"type": "WarmupCosine", "params": {}}
    assert check(cfg, 2)[-1] == (
        "scheduler.type \"WarmupCosine\" is not a DeepSpeed or torch LR scheduler (did you mean 'WarmupCosineLR'?)"
    )
    cfg["scheduler"] = {"type": "CosineAnnealingLR", "params": {"T_max": 10}}  # torch's, by name
    assert len(check(cfg, 2)) == 1
    cfg["optimizer"] = {"type": "AdamWW"}
    assert check(cfg, 2) == [
        "optimizer.type \"AdamWW\" is not an optimizer DeepSpeed can build (did you mean 'AdamW'?)"
    ]


def test_stage_offload_mismatch():
    cfg = _good()
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    assert check(cfg, 2) == [
        "zero_optimization.offload_param.device cpu needs zero_optimization.stage 3 "
        "(DeepSpeed offloads parameters only at stage 3; stage 2 ignores it)"
    ]
    cfg["zero_optimization"] = {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}
    assert check(cfg, 2) == [
        "zero_optimization.offload_optimizer.device nvme needs zero_optimization.stage 3 "
        "(stage 1 silently keeps the optimizer states in CPU memory): use "
        "zero_optimization.offload_optimizer.device cpu"
    ]
    cfg["zero_optimization"] = {"stage": 0, "offload_optimizer": {"device": "cpu"}}
    assert check(cfg, 2) == [
        "zero_optimization.offload_optimizer.device cpu needs zero_optimization.stage 1, 2 "
        "or 3 (stage 0 has no ZeRO optimizer to offload)"
    ]


@pytest.mark.parametrize(
    "options,key",
    [
        (dict(zero_stage=2, offload_param="cpu"), "offload_param"),
        (dict(zero_stage=0, offload_optimizer="cpu", adam_impl="cpu"), "offload_optimizer"),
        (dict(zero_stage=1, offload_optimizer="nvme", nvme_path="/n", adam_impl="cpu"), "offload_optimizer"),
        (dict(zero_stage=2, stage3_max_live_parameters=5), "stage3_max_live_parameters"),
        (dict(zero_stage=3, allgather_bucket_size=5), "allgather_bucket_size"),
    ],
)
def test_options_and_configs_share_one_combination_rule_set(options, key):
    """gen-config's option check and check() on a dict say the same sentence, each in its own names: the
    rule is written once (ds_check.combination_problems)."""
    o = options_from(None, model="flux-tiny", world_size=2, **options)
    said = [x for x in ds_config.check_options(o) if x.startswith(ds_config.option_name(key))]
    assert len(said) == 1, ds_config.check_options(o)
    # the dict gen-config would write for these options, without its option check
    cfg = build(options_from(None, model="flux-tiny", world_size=2))
    z = cfg["zero_optimization"] = {"stage": o.zero_stage}
    for f in ("offload_optimizer", "offload_param"):
        if getattr(o, f) != "none":
            z[f] = {"device": getattr(o, f), **({"nvme_path": "/n"} if getattr(o, f) == "nvme" else {})}
    if key.startswith("stage3_") or key == "allgather_bucket_size":
        z[key] = getattr(o, key)
    found = [x for x in check(cfg, 2) if x.startswith(ds_check.config_name(key))]
    assert len(found) == 1, check(cfg, 2)
    as_options = said[0]
    for what in ("stage", key, "stage3_prefetch_bucket_size"):
        as_options = as_options.replace(ds_config.option_name(what), ds_check.config_name(what))
    assert found[0] == as_options


def test_nvme_param_buffer_must_hold_the_largest_partition():
    """flux-dev's largest tensor is a single block's linear1: 3072 x (3 x 3072 + 12288) = 66,060,288 elements."""
    kw = dict(zero_stage=3, offload_param="nvme", nvme_path="/nvme")
    (msg,) = ds_config.check_options(options_from(None, nvme_param_buffer_size=10**6, **kw))
    assert "66060288 elements whole" in msg and "pass at least 66060288" in msg
    (msg,) = ds_config.check_options(options_from(None, nvme_param_buffer_size=10**6, world_size=8, **kw))
    assert "8257536 elements at world size 8" in msg
    assert ds_config.check_options(options_from(None, nvme_param_buffer_size=8257536, world_size=8, **kw)) == []
    assert ds_config.check_options(options_from(None, **kw)) == []  # the default 1e8 holds it


def test_nvme_without_path():
    cfg = _good()
    cfg["zero_optimization"] = {
        "stage": 3,
        "offload_param": {"device": "nvme"},
        "offload_optimizer": {"device": "nvme", "nvme_path": ""},
    }
    assert check(cfg, 2) == [
        "zero_optimization.offload_optimizer.device is nvme but offload_optimizer.nvme_path is not set: set it to "
        "a directory on a local NVMe drive",
        "zero_optimization.offload_param.device is nvme but offload_param.nvme_path is not set: set it to a "
        "directory on a local NVMe drive",
    ]


# what to change, named for a config of 2 ranks checked for 4
WRITTEN_FOR_2 = (
    ": the batch sizes are written for 2 ranks; launch 2 ranks (torchrun --nproc_per_node 2, or deepspeed "
    "--num_gpus 2), or set gradient_accumulation_steps to 1 for the same global batch on 4 ranks, or remove "
    "train_batch_size (it is derived from the other two)"
)


def test_batch_arithmetic_mismatch():
    cfg = _good()  # 8 = 4 x 2 x 1... written for world size 2: 16
    assert cfg["train_batch_size"] == 16
    assert check(cfg, 2) == [] and check(cfg, None) == []
    assert check(cfg, 4) == [
        "train_batch_size 16 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps "
        "2 x world size 4 (= 32)" + WRITTEN_FOR_2
    ]
    cfg["train_batch_size"] = 12
    assert check(cfg, None) == [
        "train_batch_size 12 is not train_micro_batch_size_per_gpu 4 x "
        "gradient_accumulation_steps 2 x any whole world size"
    ]
    del cfg["gradient_accumulation_steps"]
    assert "DeepSpeed would round gradient_accumulation_steps down" in check(cfg, 2)[0]
    assert ds_check.implied_world_size(_good()) == 2


def test_auto_batch_sizes_are_left_to_the_trainer():
    cfg = _good()
    cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] = cfg["gradient_accumulation_steps"] = "auto"
    assert check(cfg, 8) == []
    assert ds_check.without_auto(cfg)["train_micro_batch_size_per_gpu"] == 1
    cfg["gradient_accumulation_steps"] = 0
    assert check(cfg, 8) == ["gradient_accumulation_steps must be a positive integer, got 0"]


def test_fp16_and_bf16_both_on():
    cfg = _good()
    cfg["fp16"] = {"enabled": True}
    assert check(cfg, 2) == ["fp16.enabled and bf16.enabled are both true: enable one of them"]


def test_negative_and_zero_sizes():
    cfg = _good()
    cfg["train_micro_batch_size_per_gpu"] = 0
    cfg["gradient_accumulation_steps"] = -1
    cfg["gradient_clipping"] = -0.5
    cfg["zero_optimization"]["reduce_bucket_size"] = 0
    cfg["zero_optimization"]["allgather_bucket_size"] = -1
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "buffer_count": 0}
    cfg["optimizer"]["params"]["lr"] = 0
    cfg["scheduler"]["params"]["warmup_num_steps"] = 0
    assert check(cfg, 2) == [
        "train_micro_batch_size_per_gpu must be a positive integer, got 0",
        "gradient_accumulation_steps must be a positive integer, got -1",
        "gradient_clipping must be a number >= 0, got -0.5",
        "zero_optimization.reduce_bucket_size must be a positive integer, got 0",
        "zero_optimization.allgather_bucket_size must be a positive integer, got -1",
        "zero_optimization.offload_optimizer.buffer_count must be a positive integer, got 0",
        "optimizer.params.lr must be a number > 0, got 0",
        "scheduler.params.warmup_num_steps must be a positive integer, got 0",
    ]
    cfg = _good()
    cfg["zero_optimization"]["reduce_bucket_size"] = 5e8  # DeepSpeed's own examples write sizes like this
    assert check(cfg, 2) == []


def test_missing_gradient_clipping_and_bad_fluxzero_section():
    cfg = _good()
    del cfg["gradient_clipping"]
    cfg["fluxzero"]["activation_checkpointing"] = {"every_k_blocks": -1, "implementation": "jax"}
    assert check(cfg, 2) == [
        "gradient_clipping is not set (deepspeed 0.19.8 then clips at 1.0 silently): set it, 0.0 to disable",
        "fluxzero.activation_checkpointing.every_k_blocks must be an integer >= 0 (0 = off), got -1",
        'fluxzero.activation_checkpointing.implementation must be torch or deepspeed, got "jax"',
    ]
    assert check([1, 2]) == ["the config must be a JSON object, got list"]


# ---------------------------------------------------------------------------------------------------------
# check-config command


def test_check_config_command(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(ds_config.to_json(_good()))
    r = run("check-config", str(good), "--world-size", "2", "--no-deepspeed")
    assert r.exit_code == 0 and r.output.startswith(f"{good}: OK")
    hosts = tmp_path / "hosts"
    hosts.write_text("a slots=2\nb slots=2\n")
    r = run("check-config", str(good), "--hostfile", str(hosts), "--no-deepspeed")
    assert r.exit_code == 2
    assert r.output.splitlines() == [
        f"{good}: train_batch_size 16 != train_micro_batch_size_per_gpu 4 x "
        "gradient_accumulation_steps 2 x world size 4 (= 32)" + WRITTEN_FOR_2
    ]
    bad = tmp_path / "bad.json"
    cfg = _good()
    cfg["bf16"]["enabeld"] = True
    cfg["zero_optimization"]["stage"] = 1
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme"}
    bad.write_text(json.dumps(cfg))
    r = run("check-config", str(bad), "--no-deepspeed")
    assert r.exit_code == 2
    lines = r.output.splitlines()
    assert len(lines) == 3 and all(line.startswith(f"{bad}: ") for line in lines), lines
    bad.write_text('{"train_micro_batch_size_per_gpu": 1, "train_micro_batch_size_per_gpu": 2,')
    r = run("check-config", str(bad), "--no-deepspeed")
    assert r.exit_code == 2 and r.output.startswith(f"{bad}: not valid JSON")
    bad.write_text(
        '{"train_micro_batch_size_per_gpu": 1, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0}'
    )
    r = run("check-config", str(bad), "--no-deepspeed")
    assert r.exit_code == 2 and "duplicate key 'train_micro_batch_size_per_gpu'" in r.output
    r = run("check-config", str(good), "--world-size", "2", "--hostfile", str(hosts))
    assert r.exit_code == 2 and "one way only" in r.output


# ---------------------------------------------------------------------------------------------------------
# gen-config must not import torch or deepspeed


def test_blocker_blocks():
    r = run_without_torch("import torch")
    assert r.returncode != 0 and "blocked by the test" in r.stderr


def test_gen_config_and_pure_checks_run_without_torch(tmp_path):
    out = tmp_path / "ds.json"
    code = """
        import sys
        from fluxzero.cli import main
        try:
            main(sys.argv[1:])
        except SystemExit as e:
            assert "torch" not in sys.modules and "deepspeed" not in sys.modules
            sys.exit(e.code)
    """
    r = run_without_torch(code, "gen-config", "--preset", "zero3-offload", "--world-size", "4", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["train_batch_size"] == 4
    r = run_without_torch(code, "check-config", str(out), "--world-size", "4", "--no-deepspeed")
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr
    # the parser needs deepspeed: without it, one sentence saying what to install or pass
    r = run_without_torch(code, "check-config", str(out), "--world-size", "4")
    assert r.returncode == 2 and "--no-deepspeed" in r.stderr and "Traceback" not in r.stderr, r.stderr
