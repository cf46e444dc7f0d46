"""Pure: the checker of any DeepSpeed config dict (ours or hand-written), behind `fluxzero check-config`.

`check(cfg, world_size)` returns one sentence per problem, field named first: the keys deepspeed 0.19.8 reads
(unknown ones get a did-you-mean), value types and ranges, batch arithmetic for a world size, and the ZeRO /
offload / optimizer / optimizer-mode combination rules (`combination_problems`, shared with gen-config's
option checks in fluxzero.config.deepspeed.build). Each rule was read from the deepspeed 0.19.8 source; where
DeepSpeed accepts a setting silently and then ignores or misuses it, it is refused here. No torch or
deepspeed import: check-config --no-deepspeed stays instant.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math

from fluxzero.config import optim_modes
from fluxzero.config.deepspeed import adam_impl
from fluxzero.config.deepspeed import view as ds_view
from fluxzero.config.deepspeed.view import BATCH_KEYS, FLUXZERO_SECTION, DSView, view

# Values the builder writes and the checker accepts
PRECISIONS = ("bf16", "fp16", "fp32")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
CHECKPOINT_IMPLS = ("torch", "deepspeed")
# What a checkpointed block keeps for backward: only its inputs ("full": everything else is recomputed), or also
# its matmul and attention outputs ("selective": torch.utils.checkpoint with a policy, only the cheap pointwise
# ops are recomputed; fluxzero.train.recompute.selective_policy)
CHECKPOINT_POLICIES = ("full", "selective")
# torch.compile modes without CUDA graphs ("reduce-overhead" and "max-autotune" capture them): a captured graph
# replays fixed memory addresses, while ZeRO-3 gathers parameters into fresh buffers every step and
# DeepSpeed's hooks and checkpointing run eagerly between the blocks' graphs; not supported, not measured.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
# torchao float8 training recipes for the blocks' linear layers (fluxzero.fp8.recipe): one scale per tensor,
# or per row (finer, slower); torchao's names
FP8_RECIPES = ("tensorwise", "rowwise")
SCHEDULERS = ("none", "WarmupLR", "WarmupCosineLR", "WarmupDecayLR")
WARMUP_TYPES = ("linear", "log")


# ---------------------------------------------------------------------------------------------------------
# ZeRO / offload / optimizer combinations: ONE rule set over a DSView, for gen-config's options (named by their
# flags) and for any config dict (named by their keys). Each rule was read from deepspeed 0.19.8's source.

# ZeRO knobs only one group of stages reads (the rest ignore them silently).
ZERO_STAGE3_ONLY_KNOBS = (
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
)
# What deepspeed 0.19.8's ZeRO accepts without "zero_allow_untested_optimizer" (zero/utils.py
# ZERO_SUPPORTED_OPTIMIZERS), by the optimizer type names that build those classes.
ZERO_TESTED_OPTIMIZERS = ("adam", "adamw", "adagrad", "lion", "muon")


def config_name(what: str) -> str:
    """The JSON path of a view field or ZeRO key (combination_problems' names for config dicts)."""
    return {
        "stage": "zero_optimization.stage",
        "optimizer": "optimizer.type",
        "offload_optimizer": "zero_optimization.offload_optimizer.device",
        "offload_param": "zero_optimization.offload_param.device",
        "optimizer_mode": "fluxzero.optimizer_mode",
        "fp8": "fluxzero.fp8",
        "precision": "bf16.enabled",
        "bf16_master_weights_and_grads": "bf16.bf16_master_weights_and_grads",
        "bf16_optimizer_states": "bf16.bf16_optimizer_states",
        "allow_untested_optimizer": "zero_allow_untested_optimizer",
        "force_ds_cpu_optimizer": "zero_force_ds_cpu_optimizer",
        "grad_accum": "gradient_accumulation_steps",
        "gradient_clipping": "gradient_clipping",
        "load_universal": "checkpoint.load_universal",
        "offload_blocks": f"{FLUXZERO_SECTION}.offload_blocks",
    }.get(what) or f"zero_optimization.{what}"


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
            hint = (
                f", or set {name('stage3_prefetch_bucket_size')} for stage 3's gathers"
                if key == "allgather_bucket_size" and stage == 3
                else ""
            )
            p.append(f"{name(key)} applies only at stage 1 or 2 ({S} is {stage}, which ignores it): remove it{hint}")
    # deepspeed 0.19.8: offload_param is only read by ZeRO-3 (stage 1/2 ignore it silently).
    if v.offload_param != "none" and stage != 3:
        p.append(
            f"{name('offload_param')} {v.offload_param} needs {S} 3 (DeepSpeed offloads parameters only at "
            f"stage 3; stage {stage} ignores it)"
        )
    # Stage 0 has no ZeRO optimizer to do the offloading, yet the engine would still pick DeepSpeedCPUAdam.
    if v.offload_optimizer != "none" and stage == 0:
        p.append(
            f"{name('offload_optimizer')} {v.offload_optimizer} needs {S} 1, 2 or 3 (stage 0 has no ZeRO "
            f"optimizer to offload)"
        )
    # Stage 1/2 treat any offload device other than none as CPU (stage_1_and_2.py): NVMe needs stage 3.
    if v.offload_optimizer == "nvme" and stage in (1, 2):
        p.append(
            f"{name('offload_optimizer')} nvme needs {S} 3 (stage {stage} silently keeps the optimizer states "
            f"in CPU memory): use {name('offload_optimizer')} cpu"
        )
    if (
        stage >= 1
        and v.optimizer is not None
        and v.optimizer.lower() not in ZERO_TESTED_OPTIMIZERS
        and not v.allow_untested_optimizer
    ):
        p.append(
            f"{name('optimizer')} {v.optimizer} is not one ZeRO is tested with (DeepSpeed stops at engine "
            f"start): use AdamW, or set zero_allow_untested_optimizer: true"
        )
    # torchao's Float8Linear is not tested with ZeRO-3's partitioned parameters (fluxzero.train.fp8.apply_fp8)
    if v.fp8 and stage == 3:
        p.append(
            f"{name('fp8')} with ZeRO-3 is not supported (not tested with partitioned parameters): set {S} 2 "
            f"(or 0/1), or remove {name('fp8')}"
        )
    if v.optimizer_mode is not None:
        p += _mode_problems(v, name)
    if isinstance(v.offload_blocks, int) and v.offload_blocks > 0 and not v.fused_step and stage == 3:
        p.append(
            f"{name('offload_blocks')} {v.offload_blocks} streams a LoRA's frozen base blocks from host memory "
            f"below ZeRO-3 only (ZeRO-3 partitions those weights itself): set {S} 0, 1 or 2, or set "
            f"{name('offload_blocks')} to 0"
        )
    return p


def streaming_problems(v: DSView, lora, name=config_name) -> list[str]:
    """What the run file's `lora:` section (a LoraConfig, None for a full fine-tune) and fluxzero.offload_blocks
    cannot do together, one sentence each (the trainer checks it before building the model; gen-config too).
    Streamed blocks serve a fused mode's full fine-tune (its weights written back as they are stepped) or a plain
    LoRA's frozen base (fetched, never written back) at ZeRO 0-2."""
    k = v.offload_blocks
    if not isinstance(k, int) or k <= 0 or v.fused_step:
        return []
    K = f"{name('offload_blocks')} {k}"
    if lora is None:
        fused = [n for n, m in optim_modes.MODES.items() if m.fused]
        return [
            f"{K} streams blocks from host memory, which a full fine-tune does only with a fused optimizer mode (a "
            f"LoRA's frozen base with any): set {name('optimizer_mode')} to {' or '.join(fused)}, or set "
            f"{name('offload_blocks')} to 0"
        ]
    if lora.type != "lora":
        return [
            f"{K} streams the base under a plain LoRA only (lora.type is {lora.type}): set lora.type: lora, or "
            f"set {name('offload_blocks')} to 0"
        ]
    if lora.base_quant != "none":
        return [
            f"{K} streams the bf16 base, and lora.base_quant {lora.base_quant} quantizes it instead: set "
            f"lora.base_quant: none, or set {name('offload_blocks')} to 0"
        ]
    return []


def _mode_problems(v: DSView, name) -> list[str]:  # noqa: C901
    """The optimizer mode's own rules (deepspeed 0.19.8: runtime/config.py, base_optimizer._configure_master_weights,
    engine._configure_optimizer / _do_optimizer_sanity_check), one sentence each."""
    M, stage, S = name("optimizer_mode"), v.stage, name("stage")
    mode = optim_modes.MODES.get(v.optimizer_mode) if isinstance(v.optimizer_mode, str) else None
    if mode is None:
        return [
            f"{M} {json.dumps(v.optimizer_mode)} is not an optimizer mode: choose one of "
            f"{', '.join(optim_modes.trainable_modes())}"
        ]
    if not mode.trainable:
        return [
            f"{M} {mode.name} is for comparison only ({mode.caveat}): choose one of {', '.join(optim_modes.trainable_modes())}"
        ]
    p: list[str] = []
    if stage not in mode.zero_stages:
        p.append(
            f"{M} {mode.name} does not run at ZeRO stage {stage}: set {S} to {' or '.join(map(str, mode.zero_stages))}"
        )
    bf16_master = mode.master_dtype == "bf16"
    wrong_precision = bf16_master and v.precision != "bf16" and not (stage == 0 and v.precision == "fp32")
    if wrong_precision:
        fix = (
            f"{name('precision')} bf16"
            if name("precision").startswith("--")
            else (
                "fp16.enabled false (at ZeRO stage 0 the trainer casts the model to bf16)"
                if stage == 0
                else "bf16.enabled true"
            )
        )
        p.append(f"{M} {mode.name} trains in bf16, not {v.precision}: set {fix}")
    if mode.fused:
        p += _fused_problems(v, name, mode.name)
    if v.load_universal and not mode.universal_checkpoint:
        p.append(
            f"{M} {mode.name} keeps optimizer states that DeepSpeed's universal checkpoint cannot split "
            f"per parameter: remove {name('load_universal')} and resume at the world size the checkpoint was "
            f"saved with, or train with another optimizer mode"
        )
    host = [n for n, m in optim_modes.MODES.items() if m.needs_offload]
    if bf16_master and v.offload_optimizer != "none" and not mode.needs_offload:
        # _configure_master_weights: bf16 masters with offload assert type(optimizer) == DeepSpeedCPUAdam; only the
        # host modes' optimizer is let through (fluxzero.train.ds_patches.accept_host_optimizer)
        p.append(
            f"{M} {mode.name} keeps bf16 master weights, which deepspeed 0.19.8 offloads only for its own "
            f"DeepSpeedCPUAdam (it stops at engine start): drop {name('offload_optimizer')} "
            f"{v.offload_optimizer}, or use {M} {', '.join(host)} (AdamW on the host) or fp32"
        )
    if mode.needs_offload and v.offload_optimizer != "cpu":
        # NVMe: DeepSpeed's optimizer swapper with bf16 masters and a client optimizer is untried
        p.append(f"{M} {mode.name} steps the optimizer in host memory: set {name('offload_optimizer')} cpu")
    want = mode.ds_bf16_section(stage) if stage in mode.zero_stages else {"enabled": True}
    if v.trainer_casts_to_bf16:
        if v.precision == "bf16" or v.bf16_master_weights_and_grads or v.bf16_optimizer_states:
            p.append(
                f"{M} {mode.name} at ZeRO stage 0 needs bf16 off in the DeepSpeed config (the trainer casts "
                f"the model to bf16; DeepSpeed's bf16 wrapper would step fp32 masters and stage 0 refuses "
                f"bf16 master weights): remove the bf16 section"
            )
    elif bf16_master and not wrong_precision:
        missing = [
            k for k in ("bf16_master_weights_and_grads", "bf16_optimizer_states") if want.get(k) and not getattr(v, k)
        ]
        if missing:
            keys = " and ".join(name(k) for k in missing)
            p.append(
                f"{M} {mode.name} at ZeRO stage {stage} needs {keys} true (without them DeepSpeed keeps fp32 "
                f"masters and the mode saves nothing)"
            )
    elif v.bf16_master_weights_and_grads or v.bf16_optimizer_states:
        p.append(
            f"{M} {mode.name} steps fp32 master weights: set {name('bf16_master_weights_and_grads')} and "
            f"{name('bf16_optimizer_states')} false (or choose a bf16 mode)"
        )
    if stage >= 1 and not mode.zero_tested and not v.allow_untested_optimizer:
        p.append(
            f"{M} {mode.name} hands ZeRO a client optimizer it has not tested (DeepSpeed stops at engine "
            f"start): set {name('allow_untested_optimizer')} true"
        )
    if v.offload_optimizer != "none" and mode.offload_ok and v.force_ds_cpu_optimizer:
        p.append(
            f"{M} {mode.name} with {name('offload_optimizer')} {v.offload_optimizer} runs a client optimizer "
            f"on the CPU, which DeepSpeed refuses unless {name('force_ds_cpu_optimizer')} is false: set it false"
        )
    return p


def _fused_problems(v: DSView, name, mode: str) -> list[str]:
    """A fused mode applies each parameter's update during backward (fluxzero.train.optim.fused_step), before the
    engine's step: what needs the whole step's gradients first cannot run with it."""
    M, p = name("optimizer_mode"), []
    if v.grad_accum is not None and v.grad_accum > 1:
        p.append(
            f"{M} {mode} applies each update during backward, so it cannot accumulate gradients over micro "
            f"batches: set {name('grad_accum')} to 1 (raise the micro batch instead)"
        )
    if v.gradient_clipping is None or (isinstance(v.gradient_clipping, (int, float)) and v.gradient_clipping > 0):
        p.append(
            f"{M} {mode} applies each update before a global gradient norm exists, so it cannot clip by it: "
            f"set {name('gradient_clipping')} to 0 (Adafactor clips each update's RMS itself)"
        )
    return p


# ---------------------------------------------------------------------------------------------------------
# checks for any DeepSpeed config (ours or hand-written): `fluxzero check-config`

# Top-level keys deepspeed 0.19.8's DeepSpeedConfig reads (tests/config/test_ds_config_deepspeed.py records the keys
# the parser looks up and requires them all here).
TOP_LEVEL_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "managed_gradient_accumulation",
        "gradient_clipping",
        "steps_per_print",
        "wall_clock_breakdown",
        "memory_breakdown",
        "dump_state",
        "disable_python_gc",
        "disable_allgather",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "prescale_gradients",
        "gradient_predivide_factor",
        "gradient_allreduce_op",
        "zero_optimization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "activation_checkpointing",
        "comms_logger",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "fp16",
        "bf16",
        "bfloat16",
        "torch_autocast",
        "optimizer",
        "scheduler",
        "flops_profiler",
        "autotuning",
        "use_data_before_expert_parallelism",
        "hybrid_engine",
        "pipeline",
        "data_efficiency",
        "checkpoint",
        "data_types",
        "aio",
        "dataloader_drop_last",
        "log_level",
        "datastates_ckpt",
        "weight_quantization",
        "compile",
        "timers",
        "tensor_parallel",
        "expert_parallel",
        "vocabulary_size",
        "sequence_parallel_size",
        FLUXZERO_SECTION,
    }
)
# Keys deepspeed 0.19.8 refuses outright (runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS).
REMOVED_TOP_LEVEL_KEYS = frozenset(
    {
        "nebula",
        "compression_training",
        "amp",
        "quantize_training",
        "sparse_gradients",
        "eigenvalue",
        "sparse_attention",
        "elasticity",
        "graph_harvesting",
        "curriculum_learning",
        "progressive_layer_drop",
    }
)
# Field names and aliases of deepspeed 0.19.8's pydantic models (the test compares with model_fields).
ZERO_KEYS = frozenset(
    {
        "stage",
        "contiguous_gradients",
        "reduce_scatter",
        "reduce_bucket_size",
        "use_multi_rank_bucket_allreduce",
        "allgather_partitions",
        "allgather_bucket_size",
        "overlap_comm",
        "compute_grad_norm",
        "load_from_fp32_weights",
        "elastic_checkpoint",
        "offload_param",
        "offload_optimizer",
        "zenflow",
        "sub_group_size",
        "cpu_offload_param",
        "cpu_offload_use_pin_memory",
        "cpu_offload",
        "prefetch_bucket_size",
        "stage3_prefetch_bucket_size",
        "param_persistence_threshold",
        "stage3_param_persistence_threshold",
        "model_persistence_threshold",
        "stage3_model_persistence_threshold",
        "max_live_parameters",
        "stage3_max_live_parameters",
        "max_reuse_distance",
        "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save",
        "stage3_gather_16bit_weights_on_model_save",
        "module_granularity_threshold",
        "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params",
        "stage3_use_all_reduce_for_fetch_params",
        "allgather_sequential",
        "stage3_allgather_sequential",
        "stage3_gather_fp16_weights_on_model_save",
        "ignore_unused_parameters",
        "legacy_stage1",
        "round_robin_gradients",
        "parameter_alignment",
        "zero_hpz_partition_size",
        "zero_quantized_weights",
        "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients",
        "memory_efficient_linear",
        "pipeline_loading_checkpoint",
        "override_module_apply",
        "log_trace_cache_warnings",
        "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory",
        "leaf_module",
    }
)
OFFLOAD_PARAM_KEYS = frozenset({"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"})
OFFLOAD_OPTIMIZER_KEYS = frozenset(
    {
        "device",
        "nvme_path",
        "buffer_count",
        "pin_memory",
        "pipeline_read",
        "pipeline_write",
        "fast_init",
        "ratio",
        "super_offload",
        "cpuadam_cores_perc",
    }
)
BF16_KEYS = frozenset(
    {
        "enabled",
        "immediate_grad_update",
        "check_grad_overflow",
        "bf16_master_weights_and_grads",
        "bf16_optimizer_states",
    }
)
FP16_KEYS = frozenset(
    {
        "enabled",
        "auto_cast",
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "consecutive_hysteresis",
        "min_loss_scale",
        "fp16_master_weights_and_grads",
    }
)
TENSORBOARD_KEYS = frozenset({"enabled", "output_path", "job_name"})
ACTIVATION_CHECKPOINTING_KEYS = frozenset(
    {
        "partition_activations",
        "number_checkpoints",
        "contiguous_memory_optimization",
        "cpu_checkpointing",
        "profile",
        "synchronize_checkpoint_boundary",
    }
)
# Keys deepspeed 0.19.8 reads from these sections (runtime/constants.py, profiling/constants.py,
# swap_tensor/aio_config.py, model_checkpointing/constants.py); a misspelled one is ignored silently.
FLOPS_PROFILER_KEYS = frozenset(
    {"enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules", "detailed", "output_file"}
)
AIO_KEYS = frozenset(
    {"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events", "use_gds"}
)
DATA_TYPES_KEYS = frozenset({"grad_accum_dtype"})
CHECKPOINT_KEYS = frozenset(
    {
        "tag_validation",
        "load_universal",
        "use_node_local_storage",
        "parallel_write",
        "checkpoint_serialization",
        "writer",
    }
)
# ZeRO knobs only one group of stages reads (the rest ignore them silently); gen-config refuses them as well.
ZERO_STAGE3_ONLY = frozenset(k for k in ZERO_KEYS if k.startswith("stage3_")) | frozenset(
    {
        "prefetch_bucket_size",
        "param_persistence_threshold",
        "model_persistence_threshold",
        "max_live_parameters",
        "max_reuse_distance",
        "gather_16bit_weights_on_model_save",
        "module_granularity_threshold",
        "use_all_reduce_for_fetch_params",
        "allgather_sequential",
    }
)
ZERO_STAGE12_ONLY = frozenset({"allgather_bucket_size", "allgather_partitions", "round_robin_gradients"})
FLUXZERO_KEYS = frozenset({"activation_checkpointing", "compile", "optimizer_mode", "fp8", "offload_blocks"})
FLUXZERO_FP8_KEYS = frozenset({"recipe"})
FLUXZERO_CHECKPOINTING_KEYS = frozenset({"every_k_blocks", "implementation", "policy"})
FLUXZERO_COMPILE_KEYS = frozenset({"blocks", "mode", "backend", "dynamic"})
# Constructor keywords of what deepspeed 0.19.8 builds for type Adam/AdamW, plus the keys the engine pops.
_ADAM_ENGINE_KEYS = {"torch_adam", "adam_w_mode", "fp32_optimizer_states"}
ADAM_PARAM_KEYS = {
    "torch": frozenset(
        {
            "lr",
            "betas",
            "eps",
            "weight_decay",
            "amsgrad",
            "foreach",
            "maximize",
            "capturable",
            "differentiable",
            "fused",
        }
        | _ADAM_ENGINE_KEYS
    ),
    "fused": frozenset(
        {"lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad", "set_grad_none"} | _ADAM_ENGINE_KEYS
    ),
    "cpu": frozenset({"lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad"} | _ADAM_ENGINE_KEYS),
}
DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
TORCH_OPTIMIZERS = (
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "ASGD",
    "LBFGS",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "SparseAdam",
    "Adafactor",
)
SCHEDULER_PARAM_KEYS = {
    "WarmupLR": frozenset(
        {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"}
    ),
    "WarmupDecayLR": frozenset(
        {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"}
    ),
    "WarmupCosineLR": frozenset(
        {
            "total_num_steps",
            "warmup_min_ratio",
            "warmup_num_steps",
            "cos_min_ratio",
            "warmup_type",
            "last_batch_iteration",
        }
    ),
    "OneCycle": None,  # many keys; left to DeepSpeed
    "LRRangeTest": None,
}


TORCH_SCHEDULERS = (
    "LambdaLR",
    "MultiplicativeLR",
    "StepLR",
    "MultiStepLR",
    "ConstantLR",
    "LinearLR",
    "ExponentialLR",
    "SequentialLR",
    "CosineAnnealingLR",
    "ChainedScheduler",
    "ReduceLROnPlateau",
    "CyclicLR",
    "CosineAnnealingWarmRestarts",
    "OneCycleLR",
    "PolynomialLR",
)


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
    _check_fp8(cfg, p)
    fz = cfg.get(FLUXZERO_SECTION)
    _positive_ints(FLUXZERO_SECTION, fz if isinstance(fz, dict) else {}, ("offload_blocks",), p, minimum=0)
    tb = _section(cfg, "tensorboard", p)
    _unknown("tensorboard", tb, TENSORBOARD_KEYS, p)
    for key, known in (
        ("flops_profiler", FLOPS_PROFILER_KEYS),
        ("aio", AIO_KEYS),
        ("data_types", DATA_TYPES_KEYS),
        ("checkpoint", CHECKPOINT_KEYS),
    ):
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
    vals = (v.global_batch, v.micro_batch, v.grad_accum)
    if all(_is_int(x) and x > 0 for x in vals) and vals[0] % (vals[1] * vals[2]) == 0:
        return vals[0] // (vals[1] * vals[2])
    return None


def without_auto(cfg: dict) -> dict:
    """A copy DeepSpeed's parser accepts: batch keys set to "auto" dropped (micro batch 1 if none is left).

    "auto" is not a DeepSpeed value: the view reads it as not set and derives what the other batch keys give.
    """
    out = {k: v for k, v in cfg.items() if not (k in BATCH_KEYS and v == "auto")}
    if "train_batch_size" not in out and "train_micro_batch_size_per_gpu" not in out:
        out["train_micro_batch_size_per_gpu"] = 1
    return out


def _batch_fix(train: int, micro: int, accum: int, world: int) -> str:
    """What to change when the batch sizes were written for another world size: the ranks they imply (the
    launcher's flag), or the keys that keep the global batch on `world` ranks."""
    fits = train // (micro * accum) if train % (micro * accum) == 0 else None
    ways = [f"launch {fits} ranks (torchrun --nproc_per_node {fits}, or deepspeed --num_gpus {fits})"] if fits else []
    if train % (micro * world) == 0:
        ways.append(
            f"set gradient_accumulation_steps to {train // (micro * world)} for the same global batch on "
            f"{world} rank{'s' if world > 1 else ''}"
        )
    ways.append("remove train_batch_size (it is derived from the other two)")
    return (f": the batch sizes are written for {fits} ranks" if fits else "") + "; " + ", or ".join(ways)


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
            p.append(
                f"train_batch_size {train} != train_micro_batch_size_per_gpu {micro} x "
                f"gradient_accumulation_steps {accum} x world size {world} (= {micro * accum * world})"
                f"{_batch_fix(train, micro, accum, world)}"
            )
        elif world is None and train % (micro * accum):
            p.append(
                f"train_batch_size {train} is not train_micro_batch_size_per_gpu {micro} x "
                f"gradient_accumulation_steps {accum} x any whole world size"
            )
        return
    w = world if world is not None else 1
    if train is not None and micro is not None and train % (micro * w):
        p.append(
            f"train_batch_size {train} is not a multiple of train_micro_batch_size_per_gpu {micro} x "
            f"world size {w}: DeepSpeed would round gradient_accumulation_steps down"
        )
    if train is not None and accum is not None and train % (accum * w):
        p.append(
            f"train_batch_size {train} is not a multiple of gradient_accumulation_steps {accum} x "
            f"world size {w}: DeepSpeed would round train_micro_batch_size_per_gpu down"
        )
    if train is not None and micro is None and accum is None and train % w:
        p.append(f"train_batch_size {train} is not a multiple of world size {w}")


def _check_zero(cfg: dict, p: list[str]) -> tuple[int, dict]:
    z = _section(cfg, "zero_optimization", p)
    _unknown("zero_optimization", z, ZERO_KEYS, p)
    stage = z.get("stage", 0)
    if not (_is_int(stage) and 0 <= stage <= 3):
        p.append(f"zero_optimization.stage must be 0, 1, 2 or 3, got {json.dumps(stage)}")
        stage = 0
    _positive_ints(
        "zero_optimization",
        z,
        (
            "reduce_bucket_size",
            "allgather_bucket_size",
            "sub_group_size",
            "stage3_max_live_parameters",
            "max_live_parameters",
        ),
        p,
    )
    _positive_ints(
        "zero_optimization",
        z,
        (
            "stage3_prefetch_bucket_size",
            "prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "param_persistence_threshold",
            "stage3_max_reuse_distance",
            "max_reuse_distance",
            "stage3_model_persistence_threshold",
            "model_persistence_threshold",
        ),
        p,
        minimum=0,
    )
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
            p.append(
                f"zero_optimization.{key}.device is nvme but {key}.nvme_path is not set: set it to a "
                f"directory on a local NVMe drive"
            )
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
    v = dataclasses.replace(
        v,
        stage=stage,
        offload_optimizer=devices["offload_optimizer"],
        offload_param=devices["offload_param"],
        optimizer=typ if known else None,
    )  # as spelt
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
        p.append(f"optimizer.type {json.dumps(typ)} is not an optimizer DeepSpeed can build{_closest(str(typ), known)}")
        return
    params = _section(opt, "params", p, where="optimizer.params")
    if "max_grad_norm" in params:
        p.append("optimizer.params.max_grad_norm is refused by the DeepSpeed engine: use top-level gradient_clipping")
    if typ.lower() in ("adam", "adamw"):
        impl = adam_impl.impl_of_params(params, offload)
        _unknown(
            "optimizer.params", {k: v for k, v in params.items() if k != "max_grad_norm"}, ADAM_PARAM_KEYS[impl], p
        )
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
            p.append(
                f"scheduler.type {json.dumps(typ)} is not a DeepSpeed or torch LR scheduler{_closest(str(typ), known)}"
            )
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
        p.append(
            f"scheduler.params.warmup_type must be linear or log, got {json.dumps(params['warmup_type'])} "
            f"(DeepSpeed would fall back to log silently)"
        )


def _check_checkpointing(cfg: dict, p: list[str]) -> None:
    ac = _section(cfg, "activation_checkpointing", p)
    _unknown("activation_checkpointing", ac, ACTIVATION_CHECKPOINTING_KEYS, p)
    if ac.get("number_checkpoints") is not None:
        _positive_ints("activation_checkpointing", ac, ("number_checkpoints",), p)
    if ac.get("contiguous_memory_optimization") is True:
        if ac.get("partition_activations") is not True:
            p.append(
                "activation_checkpointing.contiguous_memory_optimization needs "
                "activation_checkpointing.partition_activations true"
            )
        n = ac.get("number_checkpoints")
        if not (_is_int(n) and n >= 1):
            p.append(
                f"activation_checkpointing.contiguous_memory_optimization needs "
                f"activation_checkpointing.number_checkpoints (a positive integer), got {json.dumps(n)}"
            )
    fz = _section(cfg, FLUXZERO_SECTION, p)
    _unknown(FLUXZERO_SECTION, fz, FLUXZERO_KEYS, p)
    fac = _section(fz, "activation_checkpointing", p, where="fluxzero.activation_checkpointing")
    _unknown("fluxzero.activation_checkpointing", fac, FLUXZERO_CHECKPOINTING_KEYS, p)
    k = fac.get("every_k_blocks", 0)
    if not (_is_int(k) and k >= 0):
        p.append(
            f"fluxzero.activation_checkpointing.every_k_blocks must be an integer >= 0 (0 = off), got {json.dumps(k)}"
        )
    impl = fac.get("implementation", "torch")
    if impl not in CHECKPOINT_IMPLS:
        p.append(f"fluxzero.activation_checkpointing.implementation must be torch or deepspeed, got {json.dumps(impl)}")
    policy = fac.get("policy", "full")
    if policy not in CHECKPOINT_POLICIES:
        p.append(f"fluxzero.activation_checkpointing.policy must be full or selective, got {json.dumps(policy)}")
    elif policy == "selective" and impl == "deepspeed":  # deepspeed.checkpointing has no per-op policy
        p.append(
            "fluxzero.activation_checkpointing.policy selective needs implementation torch "
            "(deepspeed.checkpointing recomputes whole blocks): set implementation torch or policy full"
        )
    elif policy == "selective" and k == 0:
        p.append(
            "fluxzero.activation_checkpointing.policy selective takes effect only with every_k_blocks >= 1: "
            "set every_k_blocks or remove the policy"
        )
    ds_options_on = [
        key
        for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
        if ac.get(key) is True
    ]
    if ds_options_on and (impl != "deepspeed" or k == 0):
        p.append(
            f"activation_checkpointing.{ds_options_on[0]} takes effect only with "
            f"fluxzero.activation_checkpointing.implementation deepspeed and every_k_blocks >= 1"
        )


def _check_fp8(cfg: dict, p: list[str]) -> None:
    fz = cfg.get(FLUXZERO_SECTION)
    fp8 = _section(fz if isinstance(fz, dict) else {}, "fp8", p, where="fluxzero.fp8")
    _unknown("fluxzero.fp8", fp8, FLUXZERO_FP8_KEYS, p)
    if fp8 and fp8.get("recipe") not in FP8_RECIPES:
        p.append(f"fluxzero.fp8.recipe must be one of {', '.join(FP8_RECIPES)}, got {json.dumps(fp8.get('recipe'))}")


def _check_compile(cfg: dict, p: list[str]) -> None:
    fz = cfg.get(FLUXZERO_SECTION)  # a non-object "fluxzero" is reported by _check_checkpointing
    comp = _section(fz if isinstance(fz, dict) else {}, "compile", p, where="fluxzero.compile")
    _unknown("fluxzero.compile", comp, FLUXZERO_COMPILE_KEYS, p)
    if "blocks" in comp and not isinstance(comp["blocks"], bool):
        p.append(f"fluxzero.compile.blocks must be true or false, got {json.dumps(comp['blocks'])}")
    if "dynamic" in comp and not isinstance(comp["dynamic"], bool):
        p.append(f"fluxzero.compile.dynamic must be true or false, got {json.dumps(comp['dynamic'])}")
    mode = comp.get("mode", "default")
    if mode not in COMPILE_MODES:
        why = (
            " (it captures CUDA graphs, which fluxzero does not support)"
            if mode in ("reduce-overhead", "max-autotune")
            else ""
        )
        p.append(f"fluxzero.compile.mode must be one of {', '.join(COMPILE_MODES)}, got {json.dumps(mode)}{why}")
    backend = comp.get("backend", "inductor")
    if backend not in COMPILE_BACKENDS:
        p.append(f"fluxzero.compile.backend must be one of {', '.join(COMPILE_BACKENDS)}, got {json.dumps(backend)}")
    # DeepSpeed's own "compile" section (DeepCompile) is read only by engine.compile(), which fluxzero never
    # calls: accepted by DeepSpeed's parser, then silently without effect.
    ds_compile = _section(cfg, "compile", p)
    if ds_compile.get("deepcompile") is True:
        p.append(
            "compile.deepcompile takes effect only through DeepSpeed's engine.compile(), which the fluxzero "
            "trainer does not call: remove it, and set fluxzero.compile.blocks true to compile the blocks"
        )
