"""Pure: fluxzero options -> DeepSpeed config dict, and consistency checks for any DeepSpeed config.

This is the one place where our option names become DeepSpeed's keys. No torch or deepspeed import here:
`fluxzero gen-config` must stay instant. The rules below were read from the deepspeed 0.19.8 source
(runtime/config.py, runtime/engine.py, runtime/zero/{config,offload_config,stage_1_and_2,stage3}.py,
runtime/precision_config.py); where DeepSpeed accepts a setting silently and then ignores or misuses it,
we refuse it here with a message that names the field and the fix.

Settings DeepSpeed does not know go into a top-level `"fluxzero"` section of the same JSON, which the
trainer reads (DeepSpeed ignores unknown top-level keys):

    "fluxzero": {"activation_checkpointing": {"every_k_blocks": K, "implementation": "torch"|"deepspeed"}}

K = 0 means no activation checkpointing, K = 1 every block, K = k every k-th block (block i is checkpointed
when i % k == 0, with one index over all blocks: the double-stream blocks first, the single-stream ones after).

Opt-in torch.compile of the transformer blocks (`gen-config --compile` writes it; absent means off):

    "fluxzero": {"compile": {"blocks": true, "mode": "default"|"max-autotune-no-cudagraphs",
                             "backend": "inductor"|"aot_eager"|"eager"}}

"mode" and "backend" are optional (defaults "default" and "inductor"; aot_eager and eager exist for tests
and debugging).

A memory-saving optimizer mode (`gen-config --optimizer-mode NAME`; absent means DeepSpeed's own AdamW on its
fp32 masters):

    "fluxzero": {"optimizer_mode": "bf16-sr"}

The trainer then builds that mode's client optimizer (fluxzero.train.optim.build_optimizer) with the
"optimizer" section's lr, betas, eps and weight decay; the modes, their bytes per parameter and the DeepSpeed
"bf16" keys each needs are in fluxzero.config.optim_modes. gen-config writes those keys, and
zero_allow_untested_optimizer / zero_force_ds_cpu_optimizer where DeepSpeed needs them for a client optimizer.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass

from fluxzero.config import ds_view, optim_modes
from fluxzero.config.ds_view import DSView, checkpointed_blocks, view

FLUXZERO_SECTION = "fluxzero"
PRECISIONS = ("bf16", "fp16", "fp32")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
ADAM_IMPLS = ("torch", "fused", "cpu")
CHECKPOINT_IMPLS = ("torch", "deepspeed")
# torch.compile modes without CUDA graphs ("reduce-overhead" and "max-autotune" capture them): a captured graph
# replays fixed memory addresses, while ZeRO-3 gathers parameters into fresh buffers every step and
# DeepSpeed's hooks and checkpointing run eagerly between the blocks' graphs; not supported, not measured.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
SCHEDULERS = ("none", "WarmupLR", "WarmupCosineLR", "WarmupDecayLR")
WARMUP_TYPES = ("linear", "log")

# Stage 1/2 buckets (elements). DeepSpeed's 5e8 default costs ~1 GB per bf16 bucket and, with overlap_comm,
# about 4.5 buckets live at once; 2e8 keeps that under 2 GB while staying far above the per-message latency
# regime on NVLink/InfiniBand.
STAGE12_BUCKET = 200_000_000


class DSConfigError(ds_view.DSConfigError):
    """Options that cannot make a valid DeepSpeed config. `problems` holds one sentence per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        ValueError.__init__(self, "\n".join(self.problems))


def flag(field: str) -> str:
    """Our option name for a DSOptions field, as the command line spells it."""
    return "--" + field.replace("_", "-")


@dataclass
class DSOptions:
    """Everything `fluxzero gen-config` can set. Field `x_y` is the command-line option `--x-y`."""

    # which FLUX.1 preset the config is for (stage-3 bucket sizes and number_checkpoints derive from it)
    model: str = "flux-dev"
    # batch arithmetic: train_batch_size = micro_batch x grad_accum x world_size
    micro_batch: int = 1
    grad_accum: int | None = None  # None: 1, or derived from global_batch
    global_batch: int | None = None
    world_size: int | None = None  # None: not known here; DeepSpeed derives train_batch_size at launch
    # ZeRO
    zero_stage: int = 2
    offload_optimizer: str = "none"
    offload_param: str = "none"
    nvme_path: str | None = None
    offload_pin_memory: bool = True
    nvme_param_buffer_count: int = 5
    nvme_param_buffer_size: int = 100_000_000
    nvme_param_max_in_cpu: int = 1_000_000_000
    nvme_optimizer_buffer_count: int = 4
    nvme_optimizer_pipeline: bool = False
    # communication; None = the per-stage default (see _zero_section)
    overlap_comm: bool | None = None
    contiguous_gradients: bool | None = None
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    stage3_prefetch_bucket_size: int | None = None
    stage3_param_persistence_threshold: int | None = None
    stage3_max_live_parameters: int | None = None
    stage3_max_reuse_distance: int | None = None
    stage3_gather_16bit_weights_on_model_save: bool | None = None
    # precision; the fp16 values are our FLUX dynamic-loss-scaling choice (ds_configs/README.md says why)
    precision: str = "bf16"
    fp16_loss_scale: float = 0.0  # 0 = dynamic
    fp16_initial_scale_power: int = 12
    fp16_loss_scale_window: int = 500
    fp16_hysteresis: int = 2
    fp16_consecutive_hysteresis: bool = True
    fp16_min_loss_scale: int = 1
    # activation checkpointing
    checkpoint_every: int = 1
    checkpoint_impl: str = "torch"
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    # torch.compile of the transformer blocks (fluxzero.compile; off writes nothing)
    compile: bool = False
    # optimizer (AdamW) and gradient clipping
    adam_impl: str = "torch"
    optimizer_mode: str | None = None  # a fluxzero.config.optim_modes name; None: DeepSpeed's AdamW, fp32 masters
    lr: float = 1e-5
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    gradient_clipping: float = 1.0
    # LR schedule
    scheduler: str = "WarmupLR"
    warmup_steps: int = 100
    total_steps: int | None = None
    warmup_type: str = "linear"
    min_lr: float = 0.0
    cos_min_ratio: float = 0.0001
    # logging
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    tensorboard_dir: str | None = None
    job_name: str | None = None

    def replace(self, **changes) -> "DSOptions":
        return dataclasses.replace(self, **changes)


# Named starting points: field overrides applied to the DSOptions defaults; explicit options override these.
PRESETS: dict[str, dict] = {
    "zero0": {"zero_stage": 0},
    "zero1": {"zero_stage": 1},
    "zero2": {"zero_stage": 2},
    "zero2-offload": {"zero_stage": 2, "offload_optimizer": "cpu"},
    "zero3": {"zero_stage": 3},
    "zero3-offload": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    # ZeRO-Infinity: needs --nvme-path; DeepSpeedCPUAdam, because the NVMe swapper is built around it and
    # the async_io build is needed on such a machine anyway
    "zero3-nvme": {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme", "adam_impl": "cpu"},
    # for GPUs without bf16 (V100, T4): FusedAdam, since fp16 training needs a GPU in any case
    "fp16": {"zero_stage": 2, "precision": "fp16", "adam_impl": "fused"},
}


def options_from(preset: str | None = None, **overrides) -> DSOptions:
    """DSOptions from a preset name plus explicit overrides (None values in `overrides` are ignored)."""
    base = {}
    if preset is not None:
        if preset not in PRESETS:
            raise DSConfigError([f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}"])
        base.update(PRESETS[preset])
    base.update({k: v for k, v in overrides.items() if v is not None})
    return DSOptions(**base)


# ---------------------------------------------------------------------------------------------------------
# options -> config


def _model(name: str):
    from fluxzero.config.models import resolve_model  # pure, import-light

    try:
        return resolve_model(name)  # a preset name or any other model spec
    except ValueError:
        return None


def num_blocks(model: str) -> int:
    cfg = _model(model)
    return cfg.depth + cfg.depth_single_blocks


def batch_numbers(o: DSOptions) -> tuple[int, int, int | None]:
    """(micro, accumulation, train_batch_size or None when the world size is unknown). Options must be valid."""
    micro, world = o.micro_batch, o.world_size
    if o.global_batch is not None:
        accum = o.grad_accum if o.grad_accum is not None else o.global_batch // (micro * world)
    else:
        accum = o.grad_accum if o.grad_accum is not None else 1
    return micro, accum, (micro * accum * world if world is not None else None)


# ---------------------------------------------------------------------------------------------------------
# ZeRO / offload / optimizer combinations: ONE rule set over a DSView, for gen-config's options (named by their
# flags) and for any config dict (named by their keys). Each rule was read from deepspeed 0.19.8's source.

# ZeRO knobs only one group of stages reads (the rest ignore them silently).
ZERO_STAGE3_ONLY_KNOBS = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                          "stage3_max_live_parameters", "stage3_max_reuse_distance",
                          "stage3_gather_16bit_weights_on_model_save")
# What deepspeed 0.19.8's ZeRO accepts without "zero_allow_untested_optimizer" (zero/utils.py
# ZERO_SUPPORTED_OPTIMIZERS), by the optimizer type names that build those classes.
ZERO_TESTED_OPTIMIZERS = ("adam", "adamw", "adagrad", "lion", "muon")


def option_name(what: str) -> str:
    """The command-line spelling of a view field or ZeRO key (combination_problems' names for options)."""
    return {"stage": "--zero-stage", "optimizer": "the optimizer", "precision": "--precision"}.get(what) or flag(what)


def config_name(what: str) -> str:
    """The JSON path of a view field or ZeRO key (combination_problems' names for config dicts)."""
    return {"stage": "zero_optimization.stage", "optimizer": "optimizer.type",
            "offload_optimizer": "zero_optimization.offload_optimizer.device",
            "offload_param": "zero_optimization.offload_param.device", "optimizer_mode": "fluxzero.optimizer_mode",
            "precision": "bf16.enabled", "bf16_master_weights_and_grads": "bf16.bf16_master_weights_and_grads",
            "bf16_optimizer_states": "bf16.bf16_optimizer_states",
            "allow_untested_optimizer": "zero_allow_untested_optimizer",
            "force_ds_cpu_optimizer": "zero_force_ds_cpu_optimizer"}.get(what) or f"zero_optimization.{what}"


def combination_problems(v: DSView, name=config_name, zero_keys=()) -> list[str]:
    """Problems with the ZeRO stage, offload devices and optimizer of `v` taken together, one sentence each.

    `zero_keys` are the zero_optimization keys that are set; `name` spells a view field or key for the reader
    (config_name for JSON, option_name for gen-config's flags). Values must already be well-typed.
    """
    p: list[str] = []
    stage, S = v.stage, name("stage")
    for key in sorted(zero_keys):
        if key in ZERO_STAGE3_ONLY and stage != 3:
            p.append(f"{name(key)} applies only at stage 3 ({S} is {stage}, which ignores it): remove it")
        elif key in ZERO_STAGE12_ONLY and stage in (0, 3):
            hint = f", or set {name('stage3_prefetch_bucket_size')} for stage 3's gathers" \
                if key == "allgather_bucket_size" and stage == 3 else ""
            p.append(f"{name(key)} applies only at stage 1 or 2 ({S} is {stage}, which ignores it): remove it{hint}")
    # deepspeed 0.19.8: offload_param is only read by ZeRO-3 (stage 1/2 ignore it silently).
    if v.offload_param != "none" and stage != 3:
        p.append(f"{name('offload_param')} {v.offload_param} needs {S} 3 (DeepSpeed offloads parameters only at "
                 f"stage 3; stage {stage} ignores it)")
    # Stage 0 has no ZeRO optimizer to do the offloading, yet the engine would still pick DeepSpeedCPUAdam.
    if v.offload_optimizer != "none" and stage == 0:
        p.append(f"{name('offload_optimizer')} {v.offload_optimizer} needs {S} 1, 2 or 3 (stage 0 has no ZeRO "
                 f"optimizer to offload)")
    # Stage 1/2 treat any offload device other than none as CPU (stage_1_and_2.py): NVMe needs stage 3.
    if v.offload_optimizer == "nvme" and stage in (1, 2):
        p.append(f"{name('offload_optimizer')} nvme needs {S} 3 (stage {stage} silently keeps the optimizer states "
                 f"in CPU memory): use {name('offload_optimizer')} cpu")
    if stage >= 1 and v.optimizer is not None and v.optimizer.lower() not in ZERO_TESTED_OPTIMIZERS \
            and not v.allow_untested_optimizer:
        p.append(f"{name('optimizer')} {v.optimizer} is not one ZeRO is tested with (DeepSpeed stops at engine "
                 f"start): use AdamW, or set zero_allow_untested_optimizer: true")
    if v.optimizer_mode is not None:
        p += _mode_problems(v, name)
    return p


# Modes whose client optimizer is torch.optim.AdamW (fluxzero.train.optim.build_optimizer), a class in deepspeed
# 0.19.8's ZERO_SUPPORTED_OPTIMIZERS; the others' classes (torchao's, ours) need zero_allow_untested_optimizer.
ZERO_TESTED_MODES = ("fp32", "bf16-rtn")


def trainable_modes() -> tuple[str, ...]:
    return tuple(n for n, m in optim_modes.MODES.items() if m.trainable)


def _mode_problems(v: DSView, name) -> list[str]:
    """The optimizer mode's own rules (deepspeed 0.19.8: runtime/config.py, base_optimizer._configure_master_weights,
    engine._configure_optimizer / _do_optimizer_sanity_check), one sentence each."""
    M, stage, S = name("optimizer_mode"), v.stage, name("stage")
    mode = optim_modes.MODES.get(v.optimizer_mode) if isinstance(v.optimizer_mode, str) else None
    if mode is None:
        return [f"{M} {json.dumps(v.optimizer_mode)} is not an optimizer mode: choose one of "
                f"{', '.join(trainable_modes())}"]
    if not mode.trainable:
        return [f"{M} {mode.name} is for comparison only ({mode.caveat}): choose one of {', '.join(trainable_modes())}"]
    p: list[str] = []
    if stage not in mode.zero_stages:
        p.append(f"{M} {mode.name} does not run at ZeRO stage {stage}: set {S} to "
                 f"{' or '.join(map(str, mode.zero_stages))}")
    bf16_master = mode.master_dtype == "bf16"
    wrong_precision = bf16_master and v.precision != "bf16" and not (stage == 0 and v.precision == "fp32")
    if wrong_precision:
        fix = f"{name('precision')} bf16" if name("precision").startswith("--") else "bf16.enabled true"
        p.append(f"{M} {mode.name} trains in bf16, not {v.precision}: set {fix}")
    if bf16_master and v.offload_optimizer != "none":
        # _configure_master_weights: bf16 masters with offload assert type(optimizer) == DeepSpeedCPUAdam
        p.append(f"{M} {mode.name} keeps bf16 master weights, which deepspeed 0.19.8 offloads only for its own "
                 f"DeepSpeedCPUAdam (it stops at engine start): drop {name('offload_optimizer')} "
                 f"{v.offload_optimizer}, or use {M} fp32")
    want = mode.ds_bf16_section(stage) if stage in mode.zero_stages else {"enabled": True}
    if bf16_master and stage == 0:
        if v.precision == "bf16" or v.bf16_master_weights_and_grads or v.bf16_optimizer_states:
            p.append(f"{M} {mode.name} at ZeRO stage 0 needs bf16 off in the DeepSpeed config (the trainer casts "
                     f"the model to bf16; DeepSpeed's bf16 wrapper would step fp32 masters and stage 0 refuses "
                     f"bf16 master weights): remove the bf16 section")
    elif bf16_master and not wrong_precision:
        missing = [k for k in ("bf16_master_weights_and_grads", "bf16_optimizer_states")
                   if want.get(k) and not getattr(v, k)]
        if missing:
            keys = " and ".join(name(k) for k in missing)
            p.append(f"{M} {mode.name} at ZeRO stage {stage} needs {keys} true (without them DeepSpeed keeps fp32 "
                     f"masters and the mode saves nothing)")
    elif v.bf16_master_weights_and_grads or v.bf16_optimizer_states:
        p.append(f"{M} {mode.name} steps fp32 master weights: set {name('bf16_master_weights_and_grads')} and "
                 f"{name('bf16_optimizer_states')} false (or choose a bf16 mode)")
    if stage >= 1 and mode.name not in ZERO_TESTED_MODES and not v.allow_untested_optimizer:
        p.append(f"{M} {mode.name} hands ZeRO a client optimizer it has not tested (DeepSpeed stops at engine "
                 f"start): set {name('allow_untested_optimizer')} true")
    if v.offload_optimizer != "none" and not bf16_master and v.force_ds_cpu_optimizer:
        p.append(f"{M} {mode.name} with {name('offload_optimizer')} {v.offload_optimizer} runs a client optimizer "
                 f"on the CPU, which DeepSpeed refuses unless {name('force_ds_cpu_optimizer')} is false: set it false")
    return p


def options_view(o: DSOptions) -> DSView:
    """The DSView of the config build(o) writes, as far as the combination rules read it (no build needed)."""
    impl = {"torch": "torch-fused", "fused": "fused", "cpu": "fused"}.get(o.adam_impl, "fused")
    mode_keys = _mode_keys(o)
    bf16 = mode_keys.get("bf16", {"enabled": o.precision == "bf16"})
    precision = "fp32" if "bf16" in mode_keys and not bf16.get("enabled") else o.precision  # bf16 modes, ZeRO 0
    return DSView(stage=o.zero_stage, precision=precision,
                  offload_optimizer=o.offload_optimizer,
                  offload_param=o.offload_param, checkpoint_every=o.checkpoint_every,
                  checkpoint_impl=o.checkpoint_impl, compile=o.compile, optimizer="adamw", optimizer_impl=impl,
                  lr=o.lr, scheduler=None if o.scheduler == "none" else o.scheduler,
                  gradient_clipping=o.gradient_clipping, optimizer_mode=o.optimizer_mode,
                  bf16_master_weights_and_grads=bf16.get("bf16_master_weights_and_grads") is True,
                  bf16_optimizer_states=bf16.get("bf16_optimizer_states") is True,
                  allow_untested_optimizer=mode_keys.get("zero_allow_untested_optimizer") is True,
                  force_ds_cpu_optimizer=mode_keys.get("zero_force_ds_cpu_optimizer", True) is not False)


def _mode_keys(o: DSOptions) -> dict:
    """The top-level keys an optimizer mode makes gen-config write: "bf16" (absent: bf16 off, the model cast by
    the trainer), zero_allow_untested_optimizer, zero_force_ds_cpu_optimizer. {} without a mode, or for a mode
    the rules refuse (combination_problems says why)."""
    mode = optim_modes.MODES.get(o.optimizer_mode) if isinstance(o.optimizer_mode, str) else None
    if mode is None or not mode.trainable or o.zero_stage not in mode.zero_stages:
        return {}
    out: dict = {}
    if o.precision == "bf16":  # any other precision with a mode is one of combination_problems' sentences
        section = mode.ds_bf16_section(o.zero_stage)
        out["bf16"] = section if section else {"enabled": False}
    if o.zero_stage >= 1 and mode.name not in ZERO_TESTED_MODES:
        out["zero_allow_untested_optimizer"] = True
    if o.offload_optimizer != "none" and mode.master_dtype == "fp32":
        out["zero_force_ds_cpu_optimizer"] = False
    return out


def check_options(o: DSOptions) -> list[str]:
    """Every problem with a set of options, one sentence each (empty when build() will succeed)."""
    p: list[str] = []

    def choice(field, allowed):
        if getattr(o, field) not in allowed:
            p.append(f"{flag(field)} must be one of {', '.join(map(str, allowed))}, got {getattr(o, field)!r}")

    def at_least(field, lo, optional=False):
        v = getattr(o, field)
        if v is None and optional:
            return
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            what = "a positive integer" if lo == 1 else f"an integer >= {lo}"
            p.append(f"{flag(field)} must be {what}, got {v!r}")

    def number(field, lo=None, hi=None, lo_open=False):
        v = getattr(o, field)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or v < hi)
        if not ok:
            rng = [f"{'>' if lo_open else '>='} {lo}" if lo is not None else "", f"< {hi}" if hi is not None else ""]
            p.append(f"{flag(field)} must be a number {' and '.join(r for r in rng if r)}, got {v!r}")

    if _model(o.model) is None:
        from fluxzero.config.models import MODEL_PRESETS

        p.append(f"{flag('model')} must be one of {', '.join(MODEL_PRESETS)} or another model spec "
                 f"(PRESET:field=value,... or a diffusers config.json), got {o.model!r}")
    choice("precision", PRECISIONS)
    choice("offload_optimizer", OFFLOAD_DEVICES)
    choice("offload_param", OFFLOAD_DEVICES)
    choice("adam_impl", ADAM_IMPLS)
    choice("checkpoint_impl", CHECKPOINT_IMPLS)
    choice("scheduler", SCHEDULERS)
    choice("warmup_type", WARMUP_TYPES)
    if o.zero_stage not in (0, 1, 2, 3):
        p.append(f"{flag('zero_stage')} must be 0, 1, 2 or 3, got {o.zero_stage!r}")
    for f in ("micro_batch", "nvme_param_buffer_count", "nvme_param_buffer_size", "nvme_param_max_in_cpu",
              "nvme_optimizer_buffer_count", "warmup_steps", "steps_per_print", "fp16_loss_scale_window",
              "fp16_hysteresis", "fp16_min_loss_scale"):
        at_least(f, 1)
    for f in ("grad_accum", "global_batch", "world_size", "total_steps", "reduce_bucket_size",
              "allgather_bucket_size", "stage3_max_live_parameters"):
        at_least(f, 1, optional=True)
    for f in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_reuse_distance"):
        at_least(f, 0, optional=True)
    at_least("checkpoint_every", 0)
    at_least("fp16_initial_scale_power", 0)
    number("fp16_loss_scale", lo=0)
    number("lr", lo=0, lo_open=True)
    number("beta1", lo=0, hi=1)
    number("beta2", lo=0, hi=1)
    number("eps", lo=0, lo_open=True)
    number("weight_decay", lo=0)
    number("gradient_clipping", lo=0)
    number("min_lr", lo=0)
    number("cos_min_ratio", lo=0)
    if p:  # the rules below assume well-typed values
        return p

    _check_batch_options(o, p)
    _check_zero_options(o, p)
    _check_precision_options(o, p)
    _check_checkpoint_options(o, p)
    _check_optimizer_options(o, p)
    if o.job_name is not None and o.tensorboard_dir is None:
        p.append(f"{flag('job_name')} names the TensorBoard run: also pass {flag('tensorboard_dir')}")
    return p


def _check_batch_options(o: DSOptions, p: list[str]) -> None:
    micro, world = o.micro_batch, o.world_size
    if o.global_batch is None:
        return
    if world is None:
        p.append(f"{flag('global_batch')} needs the world size: pass --world-size, --hostfile or --nodes/--gpus-per-node")
        return
    if o.grad_accum is not None:
        if o.global_batch != micro * o.grad_accum * world:
            p.append(
                f"{flag('global_batch')} {o.global_batch} != micro batch {micro} x accumulation steps "
                f"{o.grad_accum} x world size {world} (= {micro * o.grad_accum * world}): change one of them, "
                f"or drop {flag('grad_accum')} to derive it"
            )
    elif o.global_batch % (micro * world):
        p.append(
            f"{flag('global_batch')} {o.global_batch} is not a multiple of micro batch {micro} x world size "
            f"{world} (= {micro * world}): no whole number of accumulation steps gives it"
        )


def _check_zero_options(o: DSOptions, p: list[str]) -> None:
    stage = o.zero_stage
    knobs = [f for f in ZERO_STAGE3_ONLY_KNOBS + ("allgather_bucket_size",) if getattr(o, f) is not None]
    p += combination_problems(options_view(o), option_name, knobs)
    nvme = o.offload_optimizer == "nvme" or o.offload_param == "nvme"
    if nvme and not o.nvme_path:
        p.append(f"NVMe offload needs {flag('nvme_path')} (a directory on a local NVMe drive)")
    if o.nvme_path and not nvme:
        p.append(f"{flag('nvme_path')} is only used with {flag('offload_optimizer')} nvme or "
                 f"{flag('offload_param')} nvme")
    if stage == 0:  # allgather_bucket_size at stage 0 is one of combination_problems' stage-only keys
        for f in ("overlap_comm", "contiguous_gradients", "reduce_bucket_size"):
            if getattr(o, f) is not None:
                p.append(f"{flag(f)} applies only at {flag('zero_stage')} 1, 2 or 3 (got stage 0)")
    if stage == 3 and o.offload_param == "nvme" and _model(o.model) is not None:
        # DeepSpeed swaps each rank's partition of a parameter through one buffer (partitioned_param_swapper
        # get_buffer asserts "More elements ... than buffer size" at the first swap otherwise).
        from fluxzero.config.memory import param_inventory  # pure

        largest = max(param_inventory(_model(o.model)).tensor_sizes)
        need = -(-largest // (o.world_size or 1))
        if o.nvme_param_buffer_size < need:
            at = f"at world size {o.world_size}" if o.world_size else "whole, with no world size given"
            p.append(f"{flag('nvme_param_buffer_size')} {o.nvme_param_buffer_size} cannot hold {o.model}'s largest "
                     f"parameter partition ({need} elements {at}); pass at least {need}")


def _check_precision_options(o: DSOptions, p: list[str]) -> None:
    if o.precision == "fp16":
        return
    defaults = DSOptions()
    for f in ("fp16_loss_scale", "fp16_initial_scale_power", "fp16_loss_scale_window", "fp16_hysteresis",
              "fp16_consecutive_hysteresis", "fp16_min_loss_scale"):
        if getattr(o, f) != getattr(defaults, f):
            p.append(f"{flag(f)} applies only with {flag('precision')} fp16 (got {o.precision})")


def _check_checkpoint_options(o: DSOptions, p: list[str]) -> None:
    ds_flags = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
    on = [f for f in ds_flags if getattr(o, f)]
    if on and (o.checkpoint_impl != "deepspeed" or o.checkpoint_every == 0):
        verb = "takes" if len(on) == 1 else "take"
        p.append(f"{', '.join(map(flag, on))} {verb} effect only with {flag('checkpoint_impl')} deepspeed and "
                 f"{flag('checkpoint_every')} >= 1")
    # deepspeed.checkpointing asserts this at configure time
    if o.contiguous_memory_optimization and not o.partition_activations:
        p.append(f"{flag('contiguous_memory_optimization')} needs {flag('partition_activations')}")
    model = _model(o.model)
    if model is not None and o.checkpoint_every > num_blocks(o.model):
        p.append(f"{flag('checkpoint_every')} {o.checkpoint_every} exceeds the {num_blocks(o.model)} blocks of "
                 f"{o.model}")


def _check_optimizer_options(o: DSOptions, p: list[str]) -> None:
    # What deepspeed 0.19.8 builds for {"type": "AdamW"} (engine.get_optimizer_configuration):
    # torch_adam true -> torch.optim.AdamW, whatever the offload; else offload cpu/nvme -> DeepSpeedCPUAdam;
    # else FusedAdam. So "fused" with offload would silently become DeepSpeedCPUAdam, and "cpu" without
    # offload would silently become FusedAdam.
    if o.adam_impl == "fused" and o.offload_optimizer != "none":
        p.append(f"{flag('adam_impl')} fused cannot run with {flag('offload_optimizer')} {o.offload_optimizer} "
                 f"(DeepSpeed then builds DeepSpeedCPUAdam): use {flag('adam_impl')} cpu or torch")
    if o.adam_impl == "cpu" and o.offload_optimizer == "none":
        p.append(f"{flag('adam_impl')} cpu (DeepSpeedCPUAdam) needs {flag('offload_optimizer')} cpu or nvme; "
                 f"without offload use {flag('adam_impl')} fused or torch")
    if o.scheduler != "none" and o.warmup_steps != 1 and o.warmup_steps - WARMUP_OFFSET[o.warmup_type] < 2:
        # DeepSpeed gives optimizer steps 1 and 2 the same lr and clamps warmup_num_steps to >= 2
        low = 4 if o.warmup_type == "linear" else 3
        p.append(f"{flag('warmup_steps')} {o.warmup_steps} is too short for DeepSpeed's {o.warmup_type} warm-up "
                 f"(its first two steps share one lr): use 1 (no warm-up) or at least {low}")
    if o.scheduler in ("WarmupCosineLR", "WarmupDecayLR"):
        if o.total_steps is None:
            p.append(f"{flag('scheduler')} {o.scheduler} needs {flag('total_steps')}")
        elif o.total_steps < o.warmup_steps:
            p.append(f"{flag('total_steps')} {o.total_steps} is smaller than {flag('warmup_steps')} "
                     f"{o.warmup_steps}")
    elif o.total_steps is not None:
        p.append(f"{flag('total_steps')} is used only by {flag('scheduler')} WarmupCosineLR or WarmupDecayLR")
    if o.optimizer_mode is not None and o.adam_impl != "torch":
        p.append(f"{flag('adam_impl')} {o.adam_impl} chooses DeepSpeed's own AdamW, which {flag('optimizer_mode')} "
                 f"replaces with the mode's optimizer: leave {flag('adam_impl')} out")
    if o.min_lr >= o.lr and o.scheduler != "none":
        p.append(f"{flag('min_lr')} {o.min_lr} must be below {flag('lr')} {o.lr}")


def build(o: DSOptions) -> dict:
    """The DeepSpeed config for `o` (raises DSConfigError naming every bad option)."""
    problems = check_options(o)
    if problems:
        raise DSConfigError(problems)
    micro, accum, train = batch_numbers(o)
    cfg: dict = {}
    if train is not None:
        cfg["train_batch_size"] = train
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["gradient_accumulation_steps"] = accum
    # deepspeed 0.19.8 clips at 1.0 when the key is absent: always write it
    cfg["gradient_clipping"] = float(o.gradient_clipping)
    cfg["steps_per_print"] = o.steps_per_print
    cfg["wall_clock_breakdown"] = o.wall_clock_breakdown
    mode_keys = _mode_keys(o)
    if "bf16" in mode_keys:  # an optimizer mode decides the bf16 section (off at ZeRO 0 for the bf16-master modes)
        if mode_keys["bf16"].get("enabled"):
            cfg["bf16"] = mode_keys["bf16"]
        for key in ("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"):
            if key in mode_keys:
                cfg[key] = mode_keys[key]
    elif o.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif o.precision == "fp16":
        cfg["fp16"] = {
            "enabled": True,
            "loss_scale": float(o.fp16_loss_scale),
            "initial_scale_power": o.fp16_initial_scale_power,
            "loss_scale_window": o.fp16_loss_scale_window,
            "hysteresis": o.fp16_hysteresis,
            "consecutive_hysteresis": o.fp16_consecutive_hysteresis,
            "min_loss_scale": o.fp16_min_loss_scale,
        }
    cfg["zero_optimization"] = _zero_section(o)
    cfg["optimizer"] = {
        "type": "AdamW",
        "params": {
            "lr": o.lr,
            "betas": [o.beta1, o.beta2],
            "eps": o.eps,
            "weight_decay": o.weight_decay,
            "torch_adam": o.adam_impl == "torch",
        },
    }
    if o.adam_impl == "torch":
        # DeepSpeed hands the remaining params to torch.optim.AdamW: fused=True picks torch's single fused
        # kernel (CPU and CUDA, torch >= 2.4) instead of the foreach path and its fp32 temporary per step;
        # it is what every GPU benchmark row ran (benchmarks/RESULTS.md).
        cfg["optimizer"]["params"]["fused"] = True
    if o.scheduler != "none":
        cfg["scheduler"] = {"type": o.scheduler, "params": _scheduler_params(o)}
    if o.checkpoint_impl == "deepspeed" and o.checkpoint_every > 0:
        ac = {
            "partition_activations": o.partition_activations,
            "cpu_checkpointing": o.cpu_checkpointing,
            "contiguous_memory_optimization": o.contiguous_memory_optimization,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
        if o.contiguous_memory_optimization:
            ac["number_checkpoints"] = checkpointed_blocks(num_blocks(o.model), o.checkpoint_every)
        cfg["activation_checkpointing"] = ac
    if o.tensorboard_dir is not None:
        cfg["tensorboard"] = {"enabled": True, "output_path": o.tensorboard_dir, "job_name": o.job_name or "fluxzero"}
    cfg[FLUXZERO_SECTION] = {
        "activation_checkpointing": {"every_k_blocks": o.checkpoint_every, "implementation": o.checkpoint_impl},
    }
    if o.compile:
        cfg[FLUXZERO_SECTION]["compile"] = {"blocks": True, "mode": "default"}
    if o.optimizer_mode is not None:
        cfg[FLUXZERO_SECTION]["optimizer_mode"] = o.optimizer_mode
    return cfg


def _zero_section(o: DSOptions) -> dict:
    stage = o.zero_stage
    z: dict = {"stage": stage}
    if stage == 0:
        return z

    def pick(value, default):
        return default if value is None else value

    z["overlap_comm"] = pick(o.overlap_comm, True)
    z["contiguous_gradients"] = pick(o.contiguous_gradients, True)
    if stage in (1, 2):
        z["reduce_scatter"] = True
        z["reduce_bucket_size"] = pick(o.reduce_bucket_size, STAGE12_BUCKET)
        z["allgather_bucket_size"] = pick(o.allgather_bucket_size, STAGE12_BUCKET)
    else:
        # Sizes scale with hidden^2 (one attention projection): buckets big enough to keep the links busy,
        # small enough that a FLUX block's parameters are fetched in a few messages; biases, norms and
        # modulation vectors below 10 x hidden stay resident instead of being gathered every layer.
        h = _model(o.model).hidden_size
        z["reduce_bucket_size"] = pick(o.reduce_bucket_size, h * h)
        z["stage3_prefetch_bucket_size"] = pick(o.stage3_prefetch_bucket_size, int(0.9 * h * h))
        z["stage3_param_persistence_threshold"] = pick(o.stage3_param_persistence_threshold, 10 * h)
        z["stage3_max_live_parameters"] = pick(o.stage3_max_live_parameters, 1_000_000_000)
        z["stage3_max_reuse_distance"] = pick(o.stage3_max_reuse_distance, 1_000_000_000)
        # so engine.save_16bit_model() writes whole weights for export instead of empty partitions
        z["stage3_gather_16bit_weights_on_model_save"] = pick(o.stage3_gather_16bit_weights_on_model_save, True)
    if o.offload_optimizer != "none":
        off = {"device": o.offload_optimizer, "pin_memory": o.offload_pin_memory}
        if o.offload_optimizer == "nvme":
            off.update(nvme_path=o.nvme_path, buffer_count=o.nvme_optimizer_buffer_count,
                       pipeline_read=o.nvme_optimizer_pipeline, pipeline_write=o.nvme_optimizer_pipeline)
        z["offload_optimizer"] = off
    if o.offload_param != "none":
        off = {"device": o.offload_param, "pin_memory": o.offload_pin_memory}
        if o.offload_param == "nvme":
            off.update(nvme_path=o.nvme_path, buffer_count=o.nvme_param_buffer_count,
                       buffer_size=o.nvme_param_buffer_size, max_in_cpu=o.nvme_param_max_in_cpu)
        z["offload_param"] = off
    return z


# DeepSpeed 0.19.8's warm-up schedulers (runtime/lr_schedules.py) against optimizer steps. Built with
# last_batch_iteration -1, they set the lr for iteration "-1" (warmup_min_lr; WarmupCosineLR: ratio 0 whatever
# warmup_min_ratio says) and the engine calls scheduler.step() after each optimizer step, so step k runs at
# iteration k - 2 (steps 1 and 2 both at warmup_min_lr). Linear warm-up reaches the peak at iteration
# warmup_num_steps (clamped to >= 2), log warm-up at warmup_num_steps - 1. Written as DeepSpeed's defaults,
# "--warmup-steps 20" ran steps 1 and 2 at lr 0 and reached the peak at step 22. So gen-config writes
#   warmup_min_lr    = min_lr + (lr - min_lr) / N  (the lr of step 1 of an N-step ramp from min_lr: step 1 trains)
#   warmup_num_steps = N - 2 (linear), N - 1 (log)  (the peak is reached at step N)
#   total_num_steps  = total - 1                      (decay and cosine: the last step still runs at lr > 0 /
#                                                      reaches cos_min_ratio exactly at step `total`)
# tests/test_ds_config_deepspeed.py reads engine.get_lr() before each step of real engines to hold this.
WARMUP_OFFSET = {"linear": 2, "log": 1}


def warmup_num_steps(o: DSOptions) -> int:
    """DeepSpeed's warmup_num_steps that reaches the peak lr at optimizer step o.warmup_steps (see above)."""
    if o.warmup_steps == 1:
        return 2  # no warm-up: warmup_min_lr is then the peak itself, any value works
    return o.warmup_steps - WARMUP_OFFSET[o.warmup_type]


def _scheduler_params(o: DSOptions) -> dict:
    first = o.min_lr + (o.lr - o.min_lr) / o.warmup_steps  # lr of optimizer step 1 (and 2)
    if o.scheduler == "WarmupCosineLR":  # ratios of the optimizer's lr; step 1 runs at ratio 0 regardless
        return {
            "total_num_steps": max(1, o.total_steps - 1),
            "warmup_min_ratio": first / o.lr,
            "warmup_num_steps": warmup_num_steps(o),
            "cos_min_ratio": o.cos_min_ratio,
            "warmup_type": o.warmup_type,
        }
    params = {
        "warmup_min_lr": first,
        "warmup_max_lr": o.lr,
        "warmup_num_steps": warmup_num_steps(o),
        "warmup_type": o.warmup_type,
    }
    if o.scheduler == "WarmupDecayLR":
        params["total_num_steps"] = max(1, o.total_steps - 1)
    return params


def to_json(cfg: dict) -> str:
    """The exact text gen-config writes (committed presets are compared byte for byte)."""
    return json.dumps(cfg, indent=2) + "\n"


# ---------------------------------------------------------------------------------------------------------
# checks for any DeepSpeed config (ours or hand-written): `fluxzero check-config`

# Top-level keys deepspeed 0.19.8's DeepSpeedConfig reads (tests/test_ds_config_deepspeed.py records the keys
# the parser looks up and requires them all here).
TOP_LEVEL_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "managed_gradient_accumulation", "gradient_clipping", "steps_per_print", "wall_clock_breakdown",
    "memory_breakdown", "dump_state", "disable_python_gc", "disable_allgather", "communication_data_type",
    "seq_parallel_communication_data_type", "prescale_gradients", "gradient_predivide_factor",
    "gradient_allreduce_op", "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "activation_checkpointing", "comms_logger", "tensorboard", "wandb", "csv_monitor", "comet", "fp16", "bf16",
    "bfloat16", "torch_autocast", "optimizer", "scheduler", "flops_profiler", "autotuning",
    "use_data_before_expert_parallelism", "hybrid_engine", "pipeline", "data_efficiency", "checkpoint",
    "data_types", "aio", "dataloader_drop_last", "log_level", "datastates_ckpt", "weight_quantization", "compile",
    "timers", "tensor_parallel", "expert_parallel", "vocabulary_size", "sequence_parallel_size",
    FLUXZERO_SECTION,
})
# Keys deepspeed 0.19.8 refuses outright (runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS).
REMOVED_TOP_LEVEL_KEYS = frozenset({
    "nebula", "compression_training", "amp", "quantize_training", "sparse_gradients", "eigenvalue",
    "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning", "progressive_layer_drop",
})
# Field names and aliases of deepspeed 0.19.8's pydantic models (the test compares with model_fields).
ZERO_KEYS = frozenset({
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "compute_grad_norm", "load_from_fp32_weights",
    "elastic_checkpoint", "offload_param", "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "cpu_offload", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
    "param_persistence_threshold", "stage3_param_persistence_threshold", "model_persistence_threshold",
    "stage3_model_persistence_threshold", "max_live_parameters", "stage3_max_live_parameters",
    "max_reuse_distance", "stage3_max_reuse_distance", "gather_16bit_weights_on_model_save",
    "stage3_gather_16bit_weights_on_model_save", "module_granularity_threshold",
    "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params", "allgather_sequential", "stage3_allgather_sequential",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
    "round_robin_gradients", "parameter_alignment", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "memory_efficient_linear",
    "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory", "leaf_module",
})
OFFLOAD_PARAM_KEYS = frozenset({"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"})
OFFLOAD_OPTIMIZER_KEYS = frozenset({
    "device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write", "fast_init", "ratio",
    "super_offload", "cpuadam_cores_perc",
})
BF16_KEYS = frozenset({
    "enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
})
FP16_KEYS = frozenset({
    "enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
    "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads",
})
TENSORBOARD_KEYS = frozenset({"enabled", "output_path", "job_name"})
ACTIVATION_CHECKPOINTING_KEYS = frozenset({
    "partition_activations", "number_checkpoints", "contiguous_memory_optimization", "cpu_checkpointing",
    "profile", "synchronize_checkpoint_boundary",
})
# Keys deepspeed 0.19.8 reads from these sections (runtime/constants.py, profiling/constants.py,
# swap_tensor/aio_config.py, model_checkpointing/constants.py); a misspelled one is ignored silently.
FLOPS_PROFILER_KEYS = frozenset({"enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules",
                                 "detailed", "output_file"})
AIO_KEYS = frozenset({"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events",
                      "use_gds"})
DATA_TYPES_KEYS = frozenset({"grad_accum_dtype"})
CHECKPOINT_KEYS = frozenset({"tag_validation", "load_universal", "use_node_local_storage", "parallel_write",
                             "checkpoint_serialization", "writer"})
# ZeRO knobs only one group of stages reads (the rest ignore them silently); gen-config refuses them as well.
ZERO_STAGE3_ONLY = frozenset(k for k in ZERO_KEYS if k.startswith("stage3_")) | frozenset({
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
    "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "allgather_sequential",
})
ZERO_STAGE12_ONLY = frozenset({"allgather_bucket_size", "allgather_partitions", "round_robin_gradients"})
FLUXZERO_KEYS = frozenset({"activation_checkpointing", "compile", "optimizer_mode"})
FLUXZERO_CHECKPOINTING_KEYS = frozenset({"every_k_blocks", "implementation"})
FLUXZERO_COMPILE_KEYS = frozenset({"blocks", "mode", "backend"})
# Constructor keywords of what deepspeed 0.19.8 builds for type Adam/AdamW, plus the keys the engine pops.
_ADAM_ENGINE_KEYS = {"torch_adam", "adam_w_mode", "fp32_optimizer_states"}
ADAM_PARAM_KEYS = {
    "torch": frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable",
                        "differentiable", "fused"} | _ADAM_ENGINE_KEYS),
    "fused": frozenset({"lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad", "set_grad_none"}
                       | _ADAM_ENGINE_KEYS),
    "cpu": frozenset({"lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad"} | _ADAM_ENGINE_KEYS),
}
DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
TORCH_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "LBFGS", "NAdam", "RAdam",
                    "RMSprop", "Rprop", "SparseAdam", "Adafactor")
SCHEDULER_PARAM_KEYS = {
    "WarmupLR": frozenset({"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                           "last_batch_iteration"}),
    "WarmupDecayLR": frozenset({"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                "warmup_type", "last_batch_iteration"}),
    "WarmupCosineLR": frozenset({"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
                                 "warmup_type", "last_batch_iteration"}),
    "OneCycle": None,  # many keys; left to DeepSpeed
    "LRRangeTest": None,
}


TORCH_SCHEDULERS = ("LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR",
                    "ExponentialLR", "SequentialLR", "CosineAnnealingLR", "ChainedScheduler", "ReduceLROnPlateau",
                    "CyclicLR", "CosineAnnealingWarmRestarts", "OneCycleLR", "PolynomialLR")


def _closest(key: str, known) -> str:
    match = [k for k in sorted(known) if k.lower() == key.lower()]  # "Bf16" for "bf16": case alone
    match = match or difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    if not match:
        by_lower = {k.lower(): k for k in sorted(known)}
        match = [by_lower[m] for m in difflib.get_close_matches(key.lower(), sorted(by_lower), n=1, cutoff=0.6)]
    return f" (did you mean {match[0]!r}?)" if match else ""


def _unknown(section: str, d: dict, known, p: list[str]) -> None:
    for key in d:
        if key not in known:
            where = f"{section}.{key}" if section else key
            p.append(f"unknown key {where!r}{_closest(key, known)}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _section(cfg: dict, key: str, p: list[str], where: str | None = None) -> dict:
    v = cfg.get(key, {})
    if v is None:
        return {}
    if not isinstance(v, dict):
        p.append(f"{where or key} must be a JSON object, got {json.dumps(v)}")
        return {}
    return v


def _positive_ints(section: str, d: dict, keys, p: list[str], minimum: int = 1) -> None:
    for key in keys:
        if key in d and not (_is_int(d[key]) and d[key] >= minimum) and not _pretty_int(d[key], minimum):
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            where = f"{section}.{key}" if section else key
            p.append(f"{where} must be {what}, got {json.dumps(d[key])}")


def _pretty_int(v, minimum) -> bool:
    # DeepSpeed accepts sizes written as 5e8 (floats with an integral value)
    return isinstance(v, float) and math.isfinite(v) and v.is_integer() and v >= minimum


def check(cfg, world_size: int | None = None) -> list[str]:
    """Problems with a DeepSpeed config dict, one sentence each, field named first. world_size None: unknown."""
    if not isinstance(cfg, dict):
        return [f"the config must be a JSON object, got {type(cfg).__name__}"]
    p: list[str] = []
    for key in cfg:
        if key in REMOVED_TOP_LEVEL_KEYS:
            p.append(f"key {key!r} is no longer supported by deepspeed 0.19.8 (it refuses the config): remove it")
        elif key not in TOP_LEVEL_KEYS:
            p.append(f"unknown key {key!r}{_closest(key, TOP_LEVEL_KEYS)}")
    _check_batch(cfg, world_size, p)
    if "gradient_clipping" not in cfg:
        p.append("gradient_clipping is not set (deepspeed 0.19.8 then clips at 1.0 silently): set it, 0.0 to disable")
    elif not (_is_num(cfg["gradient_clipping"]) and cfg["gradient_clipping"] >= 0):
        p.append(f"gradient_clipping must be a number >= 0, got {json.dumps(cfg['gradient_clipping'])}")
    _positive_ints("", cfg, ("steps_per_print",), p)
    stage, devices = _check_zero(cfg, p)
    _check_precision(cfg, p)
    _check_optimizer(cfg, devices["offload_optimizer"], p)
    p += _combinations(cfg, stage, devices)
    _check_scheduler(cfg, p)
    _check_checkpointing(cfg, p)
    _check_compile(cfg, p)
    tb = _section(cfg, "tensorboard", p)
    _unknown("tensorboard", tb, TENSORBOARD_KEYS, p)
    for key, known in (("flops_profiler", FLOPS_PROFILER_KEYS), ("aio", AIO_KEYS), ("data_types", DATA_TYPES_KEYS),
                       ("checkpoint", CHECKPOINT_KEYS)):
        _unknown(key, _section(cfg, key, p), known, p)
    _positive_ints("aio", _section(cfg, "aio", []), ("block_size", "queue_depth", "intra_op_parallelism"), p)
    for key in ("bf16", "bfloat16", "fp16", "tensorboard", "flops_profiler"):
        enabled = _section(cfg, key, []).get("enabled", False)
        if not isinstance(enabled, bool):
            p.append(f"{key}.enabled must be true or false, got {json.dumps(enabled)}")
    return p


def implied_world_size(cfg: dict) -> int | None:
    """train_batch_size / (micro x accumulation) when all three are set and divide evenly, else None."""
    try:
        v = view(cfg)
    except ds_view.DSConfigError:
        return None
    vals = (v.train_batch, v.micro_batch, v.grad_accum)
    if all(_is_int(x) and x > 0 for x in vals) and vals[0] % (vals[1] * vals[2]) == 0:
        return vals[0] // (vals[1] * vals[2])
    return None


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def without_auto(cfg: dict) -> dict:
    """A copy DeepSpeed's parser accepts: batch keys set to "auto" dropped (micro batch 1 if none is left).

    "auto" is not a DeepSpeed value: ds_view reads it as not set and derives what the other batch keys give.
    """
    out = {k: v for k, v in cfg.items() if not (k in BATCH_KEYS and v == "auto")}
    if "train_batch_size" not in out and "train_micro_batch_size_per_gpu" not in out:
        out["train_micro_batch_size_per_gpu"] = 1
    return out


def _check_batch(cfg: dict, world: int | None, p: list[str]) -> None:
    names = BATCH_KEYS
    if any(cfg.get(n) == "auto" for n in names):
        cfg = without_auto(cfg)
    vals = {}
    for n in names:
        if n in cfg:
            if _is_int(cfg[n]) and cfg[n] >= 1:
                vals[n] = cfg[n]
            else:
                p.append(f"{n} must be a positive integer, got {json.dumps(cfg[n])}")
    if any(n in cfg and n not in vals for n in names):
        return
    train, micro, accum = (vals.get(n) for n in names)
    if train is None and micro is None:
        p.append("train_micro_batch_size_per_gpu is not set: set it (and gradient_accumulation_steps)")
        return
    if world is not None and world < 1:
        p.append(f"world size must be a positive integer, got {world}")
        return
    if train is not None and micro is not None and accum is not None:
        if world is not None and train != micro * accum * world:
            p.append(f"train_batch_size {train} != train_micro_batch_size_per_gpu {micro} x "
                     f"gradient_accumulation_steps {accum} x world size {world} (= {micro * accum * world})")
        elif world is None and train % (micro * accum):
            p.append(f"train_batch_size {train} is not train_micro_batch_size_per_gpu {micro} x "
                     f"gradient_accumulation_steps {accum} x any whole world size")
        return
    w = world if world is not None else 1
    if train is not None and micro is not None and train % (micro * w):
        p.append(f"train_batch_size {train} is not a multiple of train_micro_batch_size_per_gpu {micro} x "
                 f"world size {w}: DeepSpeed would round gradient_accumulation_steps down")
    if train is not None and accum is not None and train % (accum * w):
        p.append(f"train_batch_size {train} is not a multiple of gradient_accumulation_steps {accum} x "
                 f"world size {w}: DeepSpeed would round train_micro_batch_size_per_gpu down")
    if train is not None and micro is None and accum is None and train % w:
        p.append(f"train_batch_size {train} is not a multiple of world size {w}")


def _check_zero(cfg: dict, p: list[str]) -> tuple[int, dict]:
    z = _section(cfg, "zero_optimization", p)
    _unknown("zero_optimization", z, ZERO_KEYS, p)
    stage = z.get("stage", 0)
    if not (_is_int(stage) and 0 <= stage <= 3):
        p.append(f"zero_optimization.stage must be 0, 1, 2 or 3, got {json.dumps(stage)}")
        stage = 0
    _positive_ints("zero_optimization", z, ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size",
                                            "stage3_max_live_parameters", "max_live_parameters"), p)
    _positive_ints("zero_optimization", z, ("stage3_prefetch_bucket_size", "prefetch_bucket_size",
                                            "stage3_param_persistence_threshold", "param_persistence_threshold",
                                            "stage3_max_reuse_distance", "max_reuse_distance",
                                            "stage3_model_persistence_threshold", "model_persistence_threshold"),
                   p, minimum=0)
    devices = {}
    for key, known in (("offload_optimizer", OFFLOAD_OPTIMIZER_KEYS), ("offload_param", OFFLOAD_PARAM_KEYS)):
        off = _section(z, key, p, where=f"zero_optimization.{key}")
        _unknown(f"zero_optimization.{key}", off, known, p)
        device = off.get("device", "none")
        if device not in OFFLOAD_DEVICES:
            p.append(f"zero_optimization.{key}.device must be one of none, cpu, nvme, got {json.dumps(device)}")
            device = "none"
        devices[key] = device
        if device == "nvme" and not off.get("nvme_path"):
            p.append(f"zero_optimization.{key}.device is nvme but {key}.nvme_path is not set: set it to a "
                     f"directory on a local NVMe drive")
        _positive_ints(f"zero_optimization.{key}", off, ("buffer_count", "buffer_size", "max_in_cpu"), p)
    return stage, devices


def _check_precision(cfg: dict, p: list[str]) -> None:
    bf16 = _section(cfg, "bf16", p) or _section(cfg, "bfloat16", p)
    fp16 = _section(cfg, "fp16", p)
    _unknown("bf16", bf16, BF16_KEYS, p)
    _unknown("fp16", fp16, FP16_KEYS, p)
    if bf16.get("enabled") is True and fp16.get("enabled") is True:
        p.append("fp16.enabled and bf16.enabled are both true: enable one of them")
    if fp16.get("enabled") is True:
        ls = fp16.get("loss_scale", 0)
        if not (_is_num(ls) and ls >= 0):
            p.append(f"fp16.loss_scale must be a number >= 0 (0 = dynamic), got {json.dumps(ls)}")
        elif ls == 0:
            _positive_ints("fp16", fp16, ("loss_scale_window", "min_loss_scale", "hysteresis"), p)
            _positive_ints("fp16", fp16, ("initial_scale_power",), p, minimum=0)


def _combinations(cfg: dict, stage: int, devices: dict) -> list[str]:
    """combination_problems for a config dict, on the values _check_zero has already made well-typed."""
    try:
        v = view(cfg)
    except ds_view.DSConfigError:  # a section of the wrong type: reported by the section checks
        v = DSView()
    opt = cfg.get("optimizer")
    typ = opt.get("type") if isinstance(opt, dict) else None
    known = isinstance(typ, str) and (typ.lower() in DEEPSPEED_OPTIMIZERS or typ in TORCH_OPTIMIZERS)
    v = dataclasses.replace(v, stage=stage, offload_optimizer=devices["offload_optimizer"],
                            offload_param=devices["offload_param"], optimizer=typ if known else None)  # as spelt
    z = cfg.get("zero_optimization")
    return combination_problems(v, config_name, z if isinstance(z, dict) else ())


def _check_optimizer(cfg: dict, offload: str, p: list[str]) -> None:
    opt = _section(cfg, "optimizer", p)
    if not opt:
        return
    _unknown("optimizer", opt, {"type", "params", "legacy_fusion"}, p)
    typ = opt.get("type")
    if not isinstance(typ, str) or (typ.lower() not in DEEPSPEED_OPTIMIZERS and typ not in TORCH_OPTIMIZERS):
        known = DEEPSPEED_OPTIMIZERS + TORCH_OPTIMIZERS
        p.append(f"optimizer.type {json.dumps(typ)} is not an optimizer DeepSpeed can build"
                 f"{_closest(str(typ), known)}")
        return
    params = _section(opt, "params", p, where="optimizer.params")
    if "max_grad_norm" in params:
        p.append("optimizer.params.max_grad_norm is refused by the DeepSpeed engine: use top-level gradient_clipping")
    if typ.lower() in ("adam", "adamw"):
        impl = "torch" if params.get("torch_adam") is True else ("cpu" if offload != "none" else "fused")
        _unknown("optimizer.params", {k: v for k, v in params.items() if k != "max_grad_norm"},
                 ADAM_PARAM_KEYS[impl], p)
        if "lr" in params and not (_is_num(params["lr"]) and params["lr"] > 0):
            p.append(f"optimizer.params.lr must be a number > 0, got {json.dumps(params['lr'])}")
        if "eps" in params and not (_is_num(params["eps"]) and params["eps"] > 0):
            p.append(f"optimizer.params.eps must be a number > 0, got {json.dumps(params['eps'])}")
        if "weight_decay" in params and not (_is_num(params["weight_decay"]) and params["weight_decay"] >= 0):
            p.append(f"optimizer.params.weight_decay must be a number >= 0, got {json.dumps(params['weight_decay'])}")
        betas = params.get("betas", [0.9, 0.999])
        if not (isinstance(betas, list) and len(betas) == 2 and all(_is_num(b) and 0 <= b < 1 for b in betas)):
            p.append(f"optimizer.params.betas must be two numbers in [0, 1), got {json.dumps(betas)}")


def _check_scheduler(cfg: dict, p: list[str]) -> None:
    sch = _section(cfg, "scheduler", p)
    if not sch:
        return
    _unknown("scheduler", sch, {"type", "params"}, p)
    typ = sch.get("type")
    params = _section(sch, "params", p, where="scheduler.params")
    if typ not in SCHEDULER_PARAM_KEYS:
        # DeepSpeed falls back to torch.optim.lr_scheduler by name (and fails at initialize if there is none)
        if typ not in TORCH_SCHEDULERS:
            known = tuple(SCHEDULER_PARAM_KEYS) + TORCH_SCHEDULERS
            p.append(f"scheduler.type {json.dumps(typ)} is not a DeepSpeed or torch LR scheduler"
                     f"{_closest(str(typ), known)}")
        return
    if SCHEDULER_PARAM_KEYS[typ] is not None:
        _unknown("scheduler.params", params, SCHEDULER_PARAM_KEYS[typ], p)
    if "warmup_num_steps" in params:
        _positive_ints("scheduler.params", params, ("warmup_num_steps",), p)
    if typ in ("WarmupDecayLR", "WarmupCosineLR"):
        total = params.get("total_num_steps")
        if total is None:
            p.append(f"scheduler.params.total_num_steps is required by {typ}")
        else:
            _positive_ints("scheduler.params", params, ("total_num_steps",), p)
    if params.get("warmup_type", "log") not in WARMUP_TYPES:
        p.append(f"scheduler.params.warmup_type must be linear or log, got {json.dumps(params['warmup_type'])} "
                 f"(DeepSpeed would fall back to log silently)")


def _check_checkpointing(cfg: dict, p: list[str]) -> None:
    ac = _section(cfg, "activation_checkpointing", p)
    _unknown("activation_checkpointing", ac, ACTIVATION_CHECKPOINTING_KEYS, p)
    if ac.get("number_checkpoints") is not None:
        _positive_ints("activation_checkpointing", ac, ("number_checkpoints",), p)
    if ac.get("contiguous_memory_optimization") is True:
        if ac.get("partition_activations") is not True:
            p.append("activation_checkpointing.contiguous_memory_optimization needs "
                     "activation_checkpointing.partition_activations true")
        n = ac.get("number_checkpoints")
        if not (_is_int(n) and n >= 1):
            p.append(f"activation_checkpointing.contiguous_memory_optimization needs "
                     f"activation_checkpointing.number_checkpoints (a positive integer), got {json.dumps(n)}")
    fz = _section(cfg, FLUXZERO_SECTION, p)
    _unknown(FLUXZERO_SECTION, fz, FLUXZERO_KEYS, p)
    fac = _section(fz, "activation_checkpointing", p, where="fluxzero.activation_checkpointing")
    _unknown("fluxzero.activation_checkpointing", fac, FLUXZERO_CHECKPOINTING_KEYS, p)
    k = fac.get("every_k_blocks", 0)
    if not (_is_int(k) and k >= 0):
        p.append(f"fluxzero.activation_checkpointing.every_k_blocks must be an integer >= 0 (0 = off), "
                 f"got {json.dumps(k)}")
    impl = fac.get("implementation", "torch")
    if impl not in CHECKPOINT_IMPLS:
        p.append(f"fluxzero.activation_checkpointing.implementation must be torch or deepspeed, got {json.dumps(impl)}")
    ds_options_on = [key for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
                     if ac.get(key) is True]
    if ds_options_on and (impl != "deepspeed" or k == 0):
        p.append(f"activation_checkpointing.{ds_options_on[0]} takes effect only with "
                 f"fluxzero.activation_checkpointing.implementation deepspeed and every_k_blocks >= 1")


def _check_compile(cfg: dict, p: list[str]) -> None:
    fz = cfg.get(FLUXZERO_SECTION)  # a non-object "fluxzero" is reported by _check_checkpointing
    comp = _section(fz if isinstance(fz, dict) else {}, "compile", p, where="fluxzero.compile")
    _unknown("fluxzero.compile", comp, FLUXZERO_COMPILE_KEYS, p)
    if "blocks" in comp and not isinstance(comp["blocks"], bool):
        p.append(f"fluxzero.compile.blocks must be true or false, got {json.dumps(comp['blocks'])}")
    mode = comp.get("mode", "default")
    if mode not in COMPILE_MODES:
        why = " (it captures CUDA graphs, which fluxzero does not support)" \
            if mode in ("reduce-overhead", "max-autotune") else ""
        p.append(f"fluxzero.compile.mode must be one of {', '.join(COMPILE_MODES)}, got {json.dumps(mode)}{why}")
    backend = comp.get("backend", "inductor")
    if backend not in COMPILE_BACKENDS:
        p.append(f"fluxzero.compile.backend must be one of {', '.join(COMPILE_BACKENDS)}, got {json.dumps(backend)}")
    # DeepSpeed's own "compile" section (DeepCompile) is read only by engine.compile(), which fluxzero never
    # calls: accepted by DeepSpeed's parser, then silently without effect.
    ds_compile = _section(cfg, "compile", p)
    if ds_compile.get("deepcompile") is True:
        p.append("compile.deepcompile takes effect only through DeepSpeed's engine.compile(), which the fluxzero "
                 "trainer does not call: remove it, and set fluxzero.compile.blocks true to compile the blocks")
