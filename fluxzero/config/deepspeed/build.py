"""Pure: the gen-config builder, fluxzero options (DSOptions, presets) -> DeepSpeed config dict (build, to_json),
and the checks of those options (check_options).

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

torch.compile of the transformer blocks (`gen-config --compile` / `--no-compile` write it; absent means the
trainer decides: compiled on a GPU below ZeRO-3, eager on the CPU, DSView.compiles_blocks):

    "fluxzero": {"compile": {"blocks": true, "mode": "default"|"max-autotune-no-cudagraphs",
                             "backend": "inductor"|"aot_eager"|"eager", "dynamic": true|false}}

"mode" and "backend" are optional (defaults "default" and "inductor"; aot_eager and eager exist for tests
and debugging); so is "dynamic" (true: the image token axis compiled as a symbolic size, false: a graph per token
count; absent: symbolic when the data holds several token counts, DSView.dynamic_tokens).

A memory-saving optimizer mode (`gen-config --optimizer-mode NAME`; absent means DeepSpeed's own AdamW on its
fp32 masters):

    "fluxzero": {"optimizer_mode": "bf16-sr"}

A fused mode (fused-adafactor-sr: each tensor stepped in backward) also takes the number of transformer blocks
whose weights live in host memory (`gen-config --offload-blocks K`, the LAST K blocks, double then single; written
for every fused mode, 0 included):

    "fluxzero": {"optimizer_mode": "fused-adafactor-sr", "offload_blocks": K}

The trainer then builds that mode's client optimizer (fluxzero.train.optim.optimizers.build_optimizer) with the
"optimizer" section's lr, betas, eps and weight decay; the modes, their bytes per parameter and the DeepSpeed
"bf16" keys each needs are in fluxzero.config.optim_modes. gen-config writes those keys, and
zero_allow_untested_optimizer / zero_force_ds_cpu_optimizer where DeepSpeed needs them for a client optimizer.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from fluxzero.config import optim_modes
from fluxzero.config.deepspeed import adam_impl
from fluxzero.config.deepspeed import view as ds_view
from fluxzero.config.deepspeed.check import (
    CHECKPOINT_IMPLS,
    CHECKPOINT_POLICIES,
    OFFLOAD_DEVICES,
    PRECISIONS,
    SCHEDULERS,
    WARMUP_TYPES,
    ZERO_STAGE3_ONLY_KNOBS,
    combination_problems,
)
from fluxzero.config.deepspeed.view import FLUXZERO_SECTION, DSView, checkpointed_blocks

# Stage 1/2 buckets (elements). DeepSpeed's 5e8 default costs ~1 GB per bf16 bucket and, with overlap_comm,
# about 4.5 buckets live at once; 2e8 keeps that under 2 GB while staying far above the per-message latency
# regime on NVLink/InfiniBand.
STAGE12_BUCKET = 200_000_000


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
    checkpoint_policy: str = "full"  # ds_check.CHECKPOINT_POLICIES; written only when "selective"
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    # torch.compile of the transformer blocks (fluxzero.compile); None writes nothing: the trainer decides
    compile: bool | None = None
    # FP8 matmuls in the blocks (torchao float8 training; fluxzero.fp8): None or a recipe of FP8_RECIPES
    fp8: str | None = None
    # optimizer (AdamW) and gradient clipping
    adam_impl: str = "torch"
    optimizer_mode: str | None = None  # a fluxzero.config.optim_modes name; None: DeepSpeed's AdamW, fp32 masters
    offload_blocks: int = 0  # fluxzero.offload_blocks: the last K blocks streamed from host memory (fused mode, LoRA)
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

    def replace(self, **changes) -> DSOptions:
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


# A LoRA's defaults (gen-config --lora-rank), under any preset and explicit option. The adapters start at the
# base model (B = 0) and hold a few million parameters: common FLUX.1 LoRA practice trains them at 1e-4 with
# little or no warm-up (kohya sd-scripts' docs/flux_train_network.md example: --learning_rate 1e-4; diffusers'
# examples/dreambooth/README_flux.md LoRA command: --learning_rate=1e-4, --lr_warmup_steps=0). 10 warm-up steps
# keep the first Adam steps, whose second moments are still estimates of a few gradients, small. The full
# fine-tune defaults above (1e-5, 100 steps) move all 12B weights and stay as they are.
LORA_DEFAULTS = {"lr": 1e-4, "warmup_steps": 10}


def options_from(preset: str | None = None, lora: bool = False, **overrides) -> DSOptions:
    """DSOptions from a preset name plus explicit overrides (None values in `overrides` are ignored); `lora`:
    LORA_DEFAULTS under the preset and the overrides; a full fine-tune's optimizer mode brings its own defaults
    (OptimMode.defaults), under the overrides."""
    base = dict(LORA_DEFAULTS) if lora else {}
    if preset is not None:
        if preset not in PRESETS:
            raise ds_view.DSConfigError([f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}"])
        base.update(PRESETS[preset])
    given = {k: v for k, v in overrides.items() if v is not None}
    mode = optim_modes.MODES.get(given.get("optimizer_mode", base.get("optimizer_mode")))
    if mode is not None and not lora:  # e.g. Adafactor's relative lr (optim_modes._ADAFACTOR_DEFAULTS)
        base.update(mode.defaults)
    if mode is not None and mode.fused and "gradient_clipping" not in given:
        base["gradient_clipping"] = 0.0  # a fused mode steps before any global norm exists (ds_check says so)
    if mode is not None and len(mode.zero_stages) == 1 and "zero_stage" not in given and "zero_stage" not in base:
        base["zero_stage"] = mode.zero_stages[0]  # the one stage the mode runs at (a fused mode: 0)
    base.update(given)
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


def option_name(what: str) -> str:
    """The command-line spelling of a view field or ZeRO key (combination_problems' names for options)."""
    return {"stage": "--zero-stage", "optimizer": "the optimizer", "precision": "--precision"}.get(what) or flag(what)


def options_view(o: DSOptions) -> DSView:
    """The DSView of the config build(o) writes, as far as the combination rules read it (no build needed)."""
    impl = adam_impl.optimizer_impl(o.adam_impl)
    mode_keys = _mode_keys(o)
    bf16 = mode_keys.get("bf16", {"enabled": o.precision == "bf16"})
    precision = "fp32" if "bf16" in mode_keys and not bf16.get("enabled") else o.precision  # bf16 modes, ZeRO 0
    return DSView(
        stage=o.zero_stage,
        precision=precision,
        offload_optimizer=o.offload_optimizer,
        offload_param=o.offload_param,
        checkpoint_every=o.checkpoint_every,
        checkpoint_impl=o.checkpoint_impl,
        checkpoint_policy=o.checkpoint_policy,
        compile=o.compile,
        fp8=o.fp8,
        optimizer="adamw",
        optimizer_impl=impl,
        lr=o.lr,
        scheduler=None if o.scheduler == "none" else o.scheduler,
        gradient_clipping=o.gradient_clipping,
        optimizer_mode=o.optimizer_mode,
        grad_accum=_accum_or_none(o),
        offload_blocks=o.offload_blocks,
        bf16_master_weights_and_grads=bf16.get("bf16_master_weights_and_grads") is True,
        bf16_optimizer_states=bf16.get("bf16_optimizer_states") is True,
        allow_untested_optimizer=mode_keys.get("zero_allow_untested_optimizer") is True,
        force_ds_cpu_optimizer=mode_keys.get("zero_force_ds_cpu_optimizer", True) is not False,
    )


def _accum_or_none(o: DSOptions) -> int | None:
    """The accumulation steps the options give, None where they do not say (yet) without the world size."""
    if o.grad_accum is not None or o.global_batch is None:
        return o.grad_accum if o.grad_accum is not None else 1
    if o.world_size is None or not o.micro_batch:
        return None
    return o.global_batch // (o.micro_batch * o.world_size)


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
    if o.zero_stage >= 1 and not mode.zero_tested:
        out["zero_allow_untested_optimizer"] = True
    if o.offload_optimizer != "none" and mode.offload_ok:
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

        p.append(
            f"{flag('model')} must be one of {', '.join(MODEL_PRESETS)} or another model spec "
            f"(PRESET:field=value,... or a diffusers config.json), got {o.model!r}"
        )
    choice("precision", PRECISIONS)
    choice("offload_optimizer", OFFLOAD_DEVICES)
    choice("offload_param", OFFLOAD_DEVICES)
    choice("adam_impl", adam_impl.ADAM_IMPLS)
    choice("checkpoint_impl", CHECKPOINT_IMPLS)
    choice("checkpoint_policy", CHECKPOINT_POLICIES)
    choice("scheduler", SCHEDULERS)
    choice("warmup_type", WARMUP_TYPES)
    if o.zero_stage not in (0, 1, 2, 3):
        p.append(f"{flag('zero_stage')} must be 0, 1, 2 or 3, got {o.zero_stage!r}")
    for f in (
        "micro_batch",
        "nvme_param_buffer_count",
        "nvme_param_buffer_size",
        "nvme_param_max_in_cpu",
        "nvme_optimizer_buffer_count",
        "warmup_steps",
        "steps_per_print",
        "fp16_loss_scale_window",
        "fp16_hysteresis",
        "fp16_min_loss_scale",
    ):
        at_least(f, 1)
    for f in (
        "grad_accum",
        "global_batch",
        "world_size",
        "total_steps",
        "reduce_bucket_size",
        "allgather_bucket_size",
        "stage3_max_live_parameters",
    ):
        at_least(f, 1, optional=True)
    for f in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_reuse_distance"):
        at_least(f, 0, optional=True)
    at_least("checkpoint_every", 0)
    at_least("offload_blocks", 0)
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
        p.append(
            f"{flag('global_batch')} needs the world size: pass --world-size, --hostfile or --nodes/--gpus-per-node"
        )
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
        p.append(
            f"{flag('nvme_path')} is only used with {flag('offload_optimizer')} nvme or {flag('offload_param')} nvme"
        )
    if stage == 0:  # allgather_bucket_size at stage 0 is one of combination_problems' stage-only keys
        for f in ("overlap_comm", "contiguous_gradients", "reduce_bucket_size"):
            if getattr(o, f) is not None:
                p.append(f"{flag(f)} applies only at {flag('zero_stage')} 1, 2 or 3 (got stage 0)")
    if stage == 3 and o.offload_param == "nvme" and _model(o.model) is not None:
        # DeepSpeed swaps each rank's partition of a parameter through one buffer (partitioned_param_swapper
        # get_buffer asserts "More elements ... than buffer size" at the first swap otherwise).
        from fluxzero.config.architecture import linear_shapes  # FLUX.1's largest tensor is a linear's weight

        largest = max(i * n for i, n in linear_shapes(_model(o.model)).values())
        need = -(-largest // (o.world_size or 1))
        if o.nvme_param_buffer_size < need:
            at = f"at world size {o.world_size}" if o.world_size else "whole, with no world size given"
            p.append(
                f"{flag('nvme_param_buffer_size')} {o.nvme_param_buffer_size} cannot hold {o.model}'s largest "
                f"parameter partition ({need} elements {at}); pass at least {need}"
            )


def _check_precision_options(o: DSOptions, p: list[str]) -> None:
    if o.precision == "fp16":
        return
    defaults = DSOptions()
    for f in (
        "fp16_loss_scale",
        "fp16_initial_scale_power",
        "fp16_loss_scale_window",
        "fp16_hysteresis",
        "fp16_consecutive_hysteresis",
        "fp16_min_loss_scale",
    ):
        if getattr(o, f) != getattr(defaults, f):
            p.append(f"{flag(f)} applies only with {flag('precision')} fp16 (got {o.precision})")


def _check_checkpoint_options(o: DSOptions, p: list[str]) -> None:
    ds_flags = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
    on = [f for f in ds_flags if getattr(o, f)]
    if on and (o.checkpoint_impl != "deepspeed" or o.checkpoint_every == 0):
        verb = "takes" if len(on) == 1 else "take"
        p.append(
            f"{', '.join(map(flag, on))} {verb} effect only with {flag('checkpoint_impl')} deepspeed and "
            f"{flag('checkpoint_every')} >= 1"
        )
    if o.checkpoint_policy == "selective" and o.checkpoint_impl == "deepspeed":
        p.append(
            f"{flag('checkpoint_policy')} selective needs {flag('checkpoint_impl')} torch (deepspeed.checkpointing "
            f"recomputes whole blocks)"
        )
    elif o.checkpoint_policy == "selective" and o.checkpoint_every == 0:
        p.append(f"{flag('checkpoint_policy')} selective takes effect only with {flag('checkpoint_every')} >= 1")
    # deepspeed.checkpointing asserts this at configure time
    if o.contiguous_memory_optimization and not o.partition_activations:
        p.append(f"{flag('contiguous_memory_optimization')} needs {flag('partition_activations')}")
    model = _model(o.model)
    if model is not None and o.offload_blocks > num_blocks(o.model):
        p.append(f"{flag('offload_blocks')} {o.offload_blocks} exceeds the {num_blocks(o.model)} blocks of {o.model}")
    if model is not None and o.checkpoint_every > num_blocks(o.model):
        p.append(
            f"{flag('checkpoint_every')} {o.checkpoint_every} exceeds the {num_blocks(o.model)} blocks of {o.model}"
        )


def _check_optimizer_options(o: DSOptions, p: list[str]) -> None:
    # What DeepSpeed builds (fluxzero.config.deepspeed.adam_impl): "fused" with offload would silently become
    # DeepSpeedCPUAdam, and "cpu" without offload would silently become FusedAdam.
    if o.adam_impl == "fused" and o.offload_optimizer != "none":
        p.append(
            f"{flag('adam_impl')} fused cannot run with {flag('offload_optimizer')} {o.offload_optimizer} "
            f"(DeepSpeed then builds DeepSpeedCPUAdam): use {flag('adam_impl')} cpu or torch"
        )
    if o.adam_impl == "cpu" and o.offload_optimizer == "none":
        p.append(
            f"{flag('adam_impl')} cpu (DeepSpeedCPUAdam) needs {flag('offload_optimizer')} cpu or nvme; "
            f"without offload use {flag('adam_impl')} fused or torch"
        )
    if o.scheduler != "none" and o.warmup_steps != 1 and o.warmup_steps - WARMUP_OFFSET[o.warmup_type] < 2:
        # DeepSpeed gives optimizer steps 1 and 2 the same lr and clamps warmup_num_steps to >= 2
        low = 4 if o.warmup_type == "linear" else 3
        p.append(
            f"{flag('warmup_steps')} {o.warmup_steps} is too short for DeepSpeed's {o.warmup_type} warm-up "
            f"(its first two steps share one lr): use 1 (no warm-up) or at least {low}"
        )
    if o.scheduler in ("WarmupCosineLR", "WarmupDecayLR"):
        if o.total_steps is None:
            p.append(f"{flag('scheduler')} {o.scheduler} needs {flag('total_steps')}")
        elif o.total_steps < o.warmup_steps:
            p.append(f"{flag('total_steps')} {o.total_steps} is smaller than {flag('warmup_steps')} {o.warmup_steps}")
    elif o.total_steps is not None:
        p.append(f"{flag('total_steps')} is used only by {flag('scheduler')} WarmupCosineLR or WarmupDecayLR")
    if o.optimizer_mode is not None and o.adam_impl != "torch":
        p.append(
            f"{flag('adam_impl')} {o.adam_impl} chooses DeepSpeed's own AdamW, which {flag('optimizer_mode')} "
            f"replaces with the mode's optimizer: leave {flag('adam_impl')} out"
        )
    if o.min_lr >= o.lr and o.scheduler != "none":
        p.append(f"{flag('min_lr')} {o.min_lr} must be below {flag('lr')} {o.lr}")


def build(o: DSOptions) -> dict:  # noqa: C901
    """The DeepSpeed config for `o` (raises DSConfigError naming every bad option)."""
    problems = check_options(o)
    if problems:
        raise ds_view.DSConfigError(problems)
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
            **adam_impl.adam_params(o.adam_impl),  # torch: fused=True, what every GPU benchmark row ran
        },
    }
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
    if o.checkpoint_policy != "full":
        cfg[FLUXZERO_SECTION]["activation_checkpointing"]["policy"] = o.checkpoint_policy
    if o.compile is not None:
        cfg[FLUXZERO_SECTION]["compile"] = {"blocks": True, "mode": "default"} if o.compile else {"blocks": False}
    if o.optimizer_mode is not None:
        cfg[FLUXZERO_SECTION]["optimizer_mode"] = o.optimizer_mode
    if options_view(o).fused_step or o.offload_blocks:  # a fused mode's 0 too: the key says what is resident
        cfg[FLUXZERO_SECTION]["offload_blocks"] = o.offload_blocks
    if o.fp8 is not None:
        cfg[FLUXZERO_SECTION]["fp8"] = {"recipe": o.fp8}
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
            off.update(
                nvme_path=o.nvme_path,
                buffer_count=o.nvme_optimizer_buffer_count,
                pipeline_read=o.nvme_optimizer_pipeline,
                pipeline_write=o.nvme_optimizer_pipeline,
            )
        z["offload_optimizer"] = off
    if o.offload_param != "none":
        off = {"device": o.offload_param, "pin_memory": o.offload_pin_memory}
        if o.offload_param == "nvme":
            off.update(
                nvme_path=o.nvme_path,
                buffer_count=o.nvme_param_buffer_count,
                buffer_size=o.nvme_param_buffer_size,
                max_in_cpu=o.nvme_param_max_in_cpu,
            )
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
# tests/config/test_ds_config_deepspeed.py reads engine.get_lr() before each step of real engines to hold this.
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
