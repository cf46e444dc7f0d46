"""Optimizer modes in the DeepSpeed config (gen-config writes, check-config refuses, DSView reads), the warm-up
arithmetic gen-config writes, and check-config's world-size sentence. Pure: no torch, no deepspeed."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fluxzero.cli import main
from fluxzero.config import optim_modes
from fluxzero.config.deepspeed.build import build, options_from
from fluxzero.config.deepspeed.check import check
from fluxzero.config.deepspeed.view import view


def gen(*args) -> dict:
    r = CliRunner().invoke(main, ["gen-config", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


@pytest.mark.parametrize(
    "mode,stage", [(m, st) for m in optim_modes.trainable_modes() for st in optim_modes.get_mode(m).zero_stages]
)
def test_every_mode_writes_what_it_needs_and_checks_clean(mode, stage):
    m = optim_modes.get_mode(mode)
    offload = ["--offload-optimizer", "cpu"] if m.needs_offload else []  # the host modes step offloaded partitions
    cfg = gen("--optimizer-mode", mode, "--zero-stage", str(stage), *offload)
    assert cfg.get("zero_force_ds_cpu_optimizer") is (False if offload else None)
    assert cfg["fluxzero"]["optimizer_mode"] == mode
    want = m.ds_bf16_section(stage)  # from the registry, not copied here
    assert cfg.get("bf16", {}) == want
    tested = optim_modes.get_mode(mode).zero_tested  # build_optimizer returns torch.optim.AdamW for these
    assert cfg.get("zero_allow_untested_optimizer") is (True if stage >= 1 and not tested else None)
    assert check(cfg, 1) == []
    v = view(cfg)
    assert v.optimizer_mode == mode
    assert v.bf16_master_weights_and_grads is bool(want.get("bf16_master_weights_and_grads"))


def test_fp32_mode_with_offload_writes_force_ds_cpu_optimizer_false():
    cfg = gen("--optimizer-mode", "fp32", "--zero-stage", "3", "--offload-optimizer", "cpu")
    assert cfg["zero_force_ds_cpu_optimizer"] is False and check(cfg, 1) == []
    del cfg["zero_force_ds_cpu_optimizer"]
    assert check(cfg, 1) == [
        "fluxzero.optimizer_mode fp32 with zero_optimization.offload_optimizer.device cpu "
        "runs a client optimizer on the CPU, which DeepSpeed refuses unless "
        "zero_force_ds_cpu_optimizer is false: set it false"
    ]


def test_no_mode_writes_what_it_always_did():
    cfg = gen()
    assert "optimizer_mode" not in cfg["fluxzero"] and "zero_allow_untested_optimizer" not in cfg
    assert view(cfg).optimizer_mode is None


def _cfg(mode: str, stage: int = 2, **top) -> dict:
    offload = "cpu" if optim_modes.get_mode(mode).needs_offload else "none"
    cfg = build(options_from(None, optimizer_mode=mode, zero_stage=stage, offload_optimizer=offload))
    cfg.update(top)
    return cfg


@pytest.mark.parametrize(
    "edit,sentence",
    [
        (
            lambda c: c["fluxzero"].update(optimizer_mode="bf16-fast"),
            'fluxzero.optimizer_mode "bf16-fast" is not an optimizer mode: choose one of fp32, bf16-sr, bf16-kahan, '
            "adamw8bit-sr, adafactor-sr, fused-adafactor-sr, cpu-bf16-sr, cpu-adamw8bit-sr",
        ),
        (
            lambda c: c["fluxzero"].update(optimizer_mode="bf16-rtn"),
            "fluxzero.optimizer_mode bf16-rtn is for comparison only",
        ),
        (
            lambda c: c["bf16"].pop("bf16_optimizer_states"),
            "fluxzero.optimizer_mode bf16-sr at ZeRO stage 2 needs bf16.bf16_optimizer_states true (without them DeepSpeed "
            "keeps fp32 masters and the mode saves nothing)",
        ),
        (
            lambda c: c.update(bf16={"enabled": True}),
            "needs bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer_states true",
        ),
        (
            lambda c: c.pop("zero_allow_untested_optimizer"),
            "fluxzero.optimizer_mode bf16-sr hands ZeRO a client optimizer it has not tested (DeepSpeed stops at engine "
            "start): set zero_allow_untested_optimizer true",
        ),
        (
            lambda c: c["zero_optimization"].update(offload_optimizer={"device": "cpu"}),
            "fluxzero.optimizer_mode bf16-sr keeps bf16 master weights, which deepspeed 0.19.8 offloads only for its own "
            "DeepSpeedCPUAdam (it stops at engine start): drop zero_optimization.offload_optimizer.device cpu, or use "
            "fluxzero.optimizer_mode cpu-bf16-sr, cpu-adamw8bit-sr (AdamW on the host) or fp32",
        ),
        (
            lambda c: (c.pop("bf16"), c.update(fp16={"enabled": True})),
            "fluxzero.optimizer_mode bf16-sr trains in bf16, not fp16: set bf16.enabled true",
        ),
    ],
)
def test_check_config_refuses_a_mode_it_cannot_run(edit, sentence):
    cfg = _cfg("bf16-sr")
    edit(cfg)
    problems = check(cfg, 1)
    assert any(sentence in p for p in problems), problems


def test_stage0_bf16_mode_needs_bf16_off_and_fp32_mode_refuses_bf16_masters():
    cfg = _cfg("bf16-kahan", stage=0, bf16={"enabled": True})
    assert check(cfg, 1) == [
        "fluxzero.optimizer_mode bf16-kahan at ZeRO stage 0 needs bf16 off in the DeepSpeed "
        "config (the trainer casts the model to bf16; DeepSpeed's bf16 wrapper would step fp32 "
        "masters and stage 0 refuses bf16 master weights): remove the bf16 section"
    ]
    cfg = _cfg("fp32", bf16={"enabled": True, "bf16_master_weights_and_grads": True})
    assert any("fp32 steps fp32 master weights" in p for p in check(cfg, 1))


def test_check_config_cli_says_the_mode(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_cfg("adamw8bit-sr")))
    r = CliRunner().invoke(main, ["check-config", "--no-deepspeed", str(path)])
    assert r.exit_code == 0 and "optimizer mode adamw8bit-sr" in r.output


# ---------------------------------------------------------------------------------------------------------
# Warm-up: DeepSpeed's step k runs at scheduler iteration k - 2 (what gen-config writes compensates)
# ---------------------------------------------------------------------------------------------------------
def warmup_lr(params: dict, step: int) -> float:
    """deepspeed 0.19.8 WarmupLR's lr at optimizer step `step` (runtime/lr_schedules.py, re-derived: the
    constructor sets iteration -1's lr = warmup_min_lr; the engine steps the scheduler after each step)."""
    import math

    it = step - 2
    lo, hi, n = params["warmup_min_lr"], params["warmup_max_lr"], max(2, params["warmup_num_steps"])
    if it < 0:
        return lo
    if it >= n:
        return hi
    gamma = it / n if params["warmup_type"] == "linear" else math.log(it + 1) / math.log(n)
    return lo + (hi - lo) * gamma


@pytest.mark.parametrize("n,kind", [(20, "linear"), (4, "linear"), (100, "linear"), (20, "log"), (3, "log")])
def test_warmup_reaches_the_lr_at_warmup_steps_and_step_one_trains(n, kind):
    p = gen("--lr", "1e-4", "--warmup-steps", str(n), "--warmup-type", kind)["scheduler"]["params"]
    lrs = [warmup_lr(p, k) for k in range(1, n + 3)]
    assert lrs[0] == pytest.approx(1e-4 / n)  # step 1 of an n-step ramp from 0
    assert lrs[n - 1] == pytest.approx(1e-4) and lrs[n - 2] < 1e-4  # reached at step n, not before
    assert all(a <= b for a, b in zip(lrs, lrs[1:]))


def test_check_config_names_the_world_size_the_batch_implies(tmp_path):
    cfg = build(options_from(None, micro_batch=1, grad_accum=4))
    cfg["train_batch_size"] = 64
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    r = CliRunner().invoke(main, ["check-config", "--no-deepspeed", str(path)])
    assert r.exit_code == 0, r.output
    assert "world size 16 only: train_batch_size 64 = micro batch 1 x accumulation 4 x 16 ranks" in r.output
    assert "any world size" not in r.output and "(global batch 64)" in r.output
    assert CliRunner().invoke(main, ["check-config", "--no-deepspeed", "--world-size", "8", str(path)]).exit_code == 2


def test_view_says_when_the_trainer_casts_the_model():
    assert view(gen("--optimizer-mode", "bf16-sr", "--zero-stage", "0")).trainer_casts_to_bf16
    assert not view(gen("--optimizer-mode", "bf16-sr", "--zero-stage", "2")).trainer_casts_to_bf16
    assert not view(gen("--optimizer-mode", "fp32", "--zero-stage", "0")).trainer_casts_to_bf16
    assert not view(gen("--zero-stage", "0")).trainer_casts_to_bf16


def test_fit_keeps_a_pinned_mode():
    r = CliRunner().invoke(
        main,
        [
            "gen-config",
            "--fit",
            "--world-size",
            "1",
            "--gpu",
            "h200",
            "--host-memory",
            "128",
            "--optimizer-mode",
            "bf16-sr",
        ],
    )
    assert r.exit_code == 0, r.output
    cfg = json.loads(r.stdout)
    assert cfg["fluxzero"]["optimizer_mode"] == "bf16-sr" and cfg["zero_optimization"]["stage"] == 0
    assert "optimizer mode bf16-kahan" not in r.stderr  # only the pinned mode was tried
    assert optim_modes.get_mode("bf16-sr").caveat in r.stderr
    r = CliRunner().invoke(
        main,
        [
            "gen-config",
            "--fit",
            "--world-size",
            "1",
            "--gpu",
            "h200",
            "--optimizer-mode",
            "bf16-sr",
            "--offload-optimizer",
            "cpu",
        ],
    )
    assert r.exit_code == 2 and "contradict" in r.output


def test_host_modes_need_cpu_optimizer_offload():
    for args in (["--zero-stage", "2"], ["--zero-stage", "3", "--offload-optimizer", "nvme", "--nvme-path", "/nvme"]):
        r = CliRunner().invoke(main, ["gen-config", "--optimizer-mode", "cpu-bf16-sr", *args])
        assert (
            r.exit_code == 2
            and "--optimizer-mode cpu-bf16-sr steps the optimizer in host memory: set --offload-optimizer cpu"
            in r.output
        ), r.output
    cfg = gen("--optimizer-mode", "cpu-adamw8bit-sr", "--zero-stage", "3", "--offload-optimizer", "cpu")
    del cfg["zero_force_ds_cpu_optimizer"], cfg["zero_optimization"]["offload_optimizer"]
    assert check(cfg, 1) == [
        "fluxzero.optimizer_mode cpu-adamw8bit-sr steps the optimizer in host memory: set "
        "zero_optimization.offload_optimizer.device cpu"
    ]
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert check(cfg, 1) == [
        "fluxzero.optimizer_mode cpu-adamw8bit-sr with zero_optimization.offload_optimizer.device "
        "cpu runs a client optimizer on the CPU, which DeepSpeed refuses unless "
        "zero_force_ds_cpu_optimizer is false: set it false"
    ]


# ---------------------------------------------------------------------------------------------------------
# the fused mode: each update applied in backward (fluxzero.train.optim.fused_step), blocks streamed from the host
FUSED = ["--optimizer-mode", "fused-adafactor-sr", "--zero-stage", "0"]


def test_fused_mode_writes_offload_blocks_and_no_clipping():
    cfg = gen(*FUSED, "--offload-blocks", "40")
    assert cfg["fluxzero"]["offload_blocks"] == 40 and cfg["gradient_clipping"] == 0.0
    assert cfg["gradient_accumulation_steps"] == 1 and "bf16" not in cfg and check(cfg, 1) == []
    assert view(cfg).offload_blocks == 40 and view(cfg).fused_step
    assert gen(*FUSED)["fluxzero"]["offload_blocks"] == 0  # written even when nothing is streamed
    assert view(gen("--offload-blocks", "0")).offload_blocks == 0


@pytest.mark.parametrize(
    "flags, sentence",
    [
        (
            ["--grad-accum", "2"],
            "--optimizer-mode fused-adafactor-sr applies each update during backward, so it cannot "
            "accumulate gradients over micro batches: set --grad-accum to 1 (raise the micro batch "
            "instead)",
        ),
        (
            ["--gradient-clipping", "1"],
            "--optimizer-mode fused-adafactor-sr applies each update before a global gradient "
            "norm exists, so it cannot clip by it: set --gradient-clipping to 0",
        ),
        (
            ["--zero-stage", "2"],
            "--optimizer-mode fused-adafactor-sr does not run at ZeRO stage 2: set --zero-stage to 0",
        ),
        (["--precision", "fp16"], "--optimizer-mode fused-adafactor-sr trains in bf16, not fp16: set --precision bf16"),
        (["--offload-blocks", "58"], "--offload-blocks 58 exceeds the 57 blocks of flux-dev"),
    ],
)
def test_gen_config_refuses_what_the_fused_mode_cannot_run(flags, sentence):
    r = CliRunner().invoke(main, ["gen-config", *FUSED, *flags])
    assert r.exit_code == 2 and sentence in r.output, r.output


def test_adafactor_modes_default_to_their_relative_lr_and_no_weight_decay():
    """Adafactor's lr is relative (a step of at most lr x RMS(weight): tests/train/test_optim_quality.py), so AdamW's
    1e-5 would barely move FLUX.1's weights; an explicit --lr / --weight-decay and a LoRA's defaults still win."""
    for mode, stage in (("fused-adafactor-sr", "0"), ("adafactor-sr", "2")):
        params = gen("--optimizer-mode", mode, "--zero-stage", stage)["optimizer"]["params"]
        assert (params["lr"], params["weight_decay"]) == (1e-3, 0.0), mode
    assert gen(*FUSED, "--lr", "4e-4", "--weight-decay", "0.1")["optimizer"]["params"]["lr"] == 4e-4
    assert gen(*FUSED, "--weight-decay", "0.1")["optimizer"]["params"]["weight_decay"] == 0.1
    assert options_from(lora=True, optimizer_mode="adafactor-sr", zero_stage=0).lr == 1e-4
    assert gen("--optimizer-mode", "bf16-kahan")["optimizer"]["params"]["lr"] == 1e-5  # AdamW's


def test_offload_blocks_needs_a_fused_mode():
    r = CliRunner().invoke(
        main, ["gen-config", "--optimizer-mode", "adafactor-sr", "--zero-stage", "0", "--offload-blocks", "4"]
    )
    assert (
        r.exit_code == 2
        and "--offload-blocks 4 streams blocks from host memory, which a full fine-tune does only with a fused "
        "optimizer mode (a LoRA's frozen base with any): set --optimizer-mode to fused-adafactor-sr"
        in r.output
    )
    # a LoRA streams its frozen base with DeepSpeed's AdamW (docs/lora.md)
    r = CliRunner().invoke(main, ["gen-config", "--zero-stage", "2", "--offload-blocks", "4", "--lora-rank", "16"])
    lora, _ = json.JSONDecoder().raw_decode(r.output)  # the run file's lora line follows the JSON
    assert r.exit_code == 0 and lora["fluxzero"]["offload_blocks"] == 4 and check(lora, 1) == [], r.output
    r = CliRunner().invoke(main, ["gen-config", "--offload-blocks", "4", "--lora-rank", "16", "--base-quant", "int8"])
    assert r.exit_code == 2 and "--offload-blocks 4 streams the bf16 base, and lora.base_quant int8" in r.output


@pytest.mark.parametrize(
    "edit, sentence",
    [
        (
            lambda c: c.update(gradient_accumulation_steps=4),
            "set gradient_accumulation_steps to 1 (raise the micro batch instead)",
        ),
        (lambda c: c.update(gradient_clipping=1.0), "so it cannot clip by it: set gradient_clipping to 0"),
        (lambda c: c.pop("gradient_clipping"), "so it cannot clip by it: set gradient_clipping to 0"),
        (
            lambda c: c["zero_optimization"].update(stage=1),
            "does not run at ZeRO stage 1: set zero_optimization.stage to 0",
        ),
        (
            lambda c: c.update(fp16={"enabled": True}),
            "trains in bf16, not fp16: set fp16.enabled false (at ZeRO stage 0 the trainer casts the model to bf16)",
        ),
        (lambda c: c.update(bf16={"enabled": True}), "at ZeRO stage 0 needs bf16 off in the DeepSpeed config"),
        (
            lambda c: c["zero_optimization"].update(offload_optimizer={"device": "cpu"}),
            "offload_optimizer.device cpu needs",
        ),
        (lambda c: c["fluxzero"].update(offload_blocks=-1), "fluxzero.offload_blocks must be an integer >= 0"),
        (
            lambda c: (c["fluxzero"].pop("optimizer_mode"), c["zero_optimization"].update(stage=3)),
            "fluxzero.offload_blocks 2 streams a LoRA's frozen base blocks from host memory below ZeRO-3 only",
        ),
    ],
)
def test_check_config_and_the_trainer_refuse_what_the_fused_mode_cannot_run(tmp_path, edit, sentence):
    from fluxzero.config.deepspeed.file import load_for_training
    from fluxzero.config.deepspeed.view import DSConfigError

    cfg = gen(*FUSED, "--offload-blocks", "2")
    edit(cfg)
    assert any(sentence in p for p in check(cfg, 1)), check(cfg, 1)
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    with pytest.raises(DSConfigError) as e:  # the trainer's first read of the file: one sentence, before any engine
        load_for_training(tmp_path / "ds.json", 1)
    assert "DeepSpeed config" in str(e.value)


@pytest.mark.parametrize("mode", ["adamw8bit-sr", "cpu-adamw8bit-sr", "cpu-bf16-sr"])
def test_modes_a_universal_checkpoint_cannot_resume_are_refused_up_front(tmp_path, mode):
    """ZeRO's per-parameter views cannot slice adamw8bit-sr's 8-bit blocks; DeepSpeed's ds_to_universal stops with
    KeyError 'exp_avg' on a cpu-adamw8bit-sr checkpoint (codes and scales); a cpu-bf16-sr checkpoint converts, but
    the loaded HostAdamW's first step stops with KeyError 'sr_stream' (DeepSpeed restores only Adam's keys)."""
    from fluxzero.config.deepspeed.file import load_for_training
    from fluxzero.config.deepspeed.view import DSConfigError

    sentence = (
        f"fluxzero.optimizer_mode {mode} keeps optimizer states that DeepSpeed's universal checkpoint "
        "cannot split per parameter: remove checkpoint.load_universal and resume at the world size the "
        "checkpoint was saved with, or train with another optimizer mode"
    )
    for stage in optim_modes.get_mode(mode).zero_stages:
        cfg = _cfg(mode, stage, checkpoint={"load_universal": True})
        assert check(cfg, 1) == [sentence]
        assert check(_cfg("bf16-sr", stage, checkpoint={"load_universal": True}), 1) == []  # the mode's own rule
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    with pytest.raises(DSConfigError, match="universal checkpoint cannot split"):  # the trainer's first read
        load_for_training(tmp_path / "ds.json", 1)
