"""`fluxzero gen-config` and `fluxzero check-config`: write and validate DeepSpeed JSON configs.

Only pure modules are imported at the top; deepspeed is imported by check-config's parser step alone.
"""

from __future__ import annotations

import contextlib
import json
import sys

import click
from click.core import ParameterSource

from fluxzero import plan as memory
from fluxzero.commands import options
from fluxzero.commands.model_spec import MODEL_SPEC
from fluxzero.commands.options import (
    ADAPTER_KEYS,
    ADAPTER_OPTIONS,
    gpu_memory_from,
    parse_lora_targets,
    topology_from,
)
from fluxzero.commands.options import NONNEG as _NONNEG
from fluxzero.commands.options import POS as _POS
from fluxzero.config import optim_modes
from fluxzero.config.deepspeed import build as ds_config
from fluxzero.config.deepspeed import check as ds_check
from fluxzero.config.deepspeed import view as ds_view
from fluxzero.config.deepspeed.adam_impl import ADAM_IMPLS
from fluxzero.config.deepspeed.build import DSOptions
from fluxzero.config.deepspeed.check import FP8_RECIPES
from fluxzero.config.deepspeed.view import DSConfigError
from fluxzero.fsutil import atomic_write

_D = DSOptions()


def _opt(field: str, type_=None, help_: str = "", flag_pair: bool = False):
    """A gen-config option for DSOptions.<field>, showing the DSOptions default.

    Only options given on the command line override the preset (gen_config asks Click for each value's source).
    """
    name = "--" + field.replace("_", "-")
    decls = [f"{name}/--no-{field.replace('_', '-')}"] if flag_pair else [name]
    default = getattr(_D, field)
    return click.option(*decls, field, type=type_, default=default, help=help_, show_default=default is not None)


_OPTIONS = [
    # preset, model, output
    click.option(
        "--preset",
        type=click.Choice(list(ds_config.PRESETS)),
        default=None,
        help="Named starting point (ds_configs/README.md); every other option overrides it.",
    ),
    _opt(
        "model",
        MODEL_SPEC,
        "Model the config is for (sizes stage-3 buckets and number_checkpoints): a preset, "
        "PRESET:field=value,... or a diffusers config.json.",
    ),
    click.option(
        "-o",
        "--output",
        type=click.Path(dir_okay=False),
        default=None,
        help="Write the JSON here (atomically) instead of stdout.",
    ),
    # batch arithmetic
    _opt("micro_batch", _POS, "Samples per GPU per forward/backward (train_micro_batch_size_per_gpu)."),
    _opt("grad_accum", _POS, "Gradient accumulation steps."),
    _opt(
        "global_batch", _POS, "Target train_batch_size; accumulation steps are derived from it (needs the world size)."
    ),
    options.topology,
    click.option("--world-size", type=_POS, default=None, help="Total number of GPUs (ranks)."),
    # ZeRO and offload
    _opt(
        "zero_stage",
        click.IntRange(0, 3),
        "ZeRO stage: 0 data parallel, 1 optimizer states, 2 + gradients, 3 + parameters.",
    ),
    _opt(
        "offload_optimizer",
        click.Choice(ds_check.OFFLOAD_DEVICES),
        "Offload optimizer states (and the optimizer step) to CPU (stage 1-3) or NVMe (stage 3).",
    ),
    _opt("offload_param", click.Choice(ds_check.OFFLOAD_DEVICES), "Offload parameters to CPU or NVMe (stage 3 only)."),
    _opt("nvme_path", click.Path(file_okay=False), "Directory on a local NVMe drive for NVMe offload."),
    _opt("offload_pin_memory", None, "Offload to page-locked CPU memory (faster transfers).", flag_pair=True),
    _opt("nvme_param_buffer_count", _POS, "NVMe parameter offload: number of buffers."),
    _opt("nvme_param_buffer_size", _POS, "NVMe parameter offload: elements per buffer (>= largest parameter)."),
    _opt("nvme_param_max_in_cpu", _POS, "NVMe parameter offload: parameter elements kept in CPU memory."),
    _opt("nvme_optimizer_buffer_count", _POS, "NVMe optimizer offload: number of buffers."),
    _opt("nvme_optimizer_pipeline", None, "NVMe optimizer offload: overlap swap-in/out with the step.", flag_pair=True),
    # communication
    _opt("overlap_comm", None, "Overlap gradient reduction with backward [default: on at stage 1-3].", flag_pair=True),
    _opt(
        "contiguous_gradients",
        None,
        "Copy gradients into one buffer as produced [default: on at stage 1-3].",
        flag_pair=True,
    ),
    _opt("reduce_bucket_size", _POS, "Elements reduced at a time [default: 2e8 at stage 1/2, hidden^2 at 3]."),
    _opt("allgather_bucket_size", _POS, "Elements all-gathered at a time, stage 1/2 [default: 2e8]."),
    _opt(
        "stage3_prefetch_bucket_size", _NONNEG, "Stage 3: parameter elements fetched ahead [default: 0.9 x hidden^2]."
    ),
    _opt(
        "stage3_param_persistence_threshold",
        _NONNEG,
        "Stage 3: parameters smaller than this stay unpartitioned [default: 10 x hidden].",
    ),
    _opt("stage3_max_live_parameters", _POS, "Stage 3: parameter elements resident per GPU [default: 1e9]."),
    _opt(
        "stage3_max_reuse_distance",
        _NONNEG,
        "Stage 3: keep a parameter if reused within this many elements [default: 1e9].",
    ),
    _opt(
        "stage3_gather_16bit_weights_on_model_save",
        None,
        "Stage 3: gather whole 16-bit weights when saving the model [default: on].",
        flag_pair=True,
    ),
    # precision
    _opt("precision", click.Choice(ds_check.PRECISIONS), "Training precision (fp16 needs a GPU)."),
    _opt("fp16_loss_scale", click.FloatRange(min=0), "fp16: static loss scale; 0 = dynamic loss scaling."),
    _opt("fp16_initial_scale_power", _NONNEG, "fp16: dynamic scaling starts at 2^this."),
    _opt("fp16_loss_scale_window", _POS, "fp16: clean steps before the scale doubles."),
    _opt("fp16_hysteresis", _POS, "fp16: overflows tolerated before the scale halves."),
    _opt("fp16_consecutive_hysteresis", None, "fp16: refill the hysteresis after every clean step.", flag_pair=True),
    _opt("fp16_min_loss_scale", _POS, "fp16: lowest dynamic loss scale."),
    # activation checkpointing
    _opt("checkpoint_every", _NONNEG, "Activation checkpointing: recompute every k-th block (0 off, 1 all)."),
    _opt(
        "checkpoint_impl",
        click.Choice(ds_check.CHECKPOINT_IMPLS),
        "Checkpointing implementation: torch.utils.checkpoint or deepspeed.checkpointing.",
    ),
    _opt(
        "checkpoint_policy",
        click.Choice(ds_check.CHECKPOINT_POLICIES),
        "What a checkpointed block keeps: its "
        "inputs (full) or also its matmul and attention outputs, recomputing only pointwise ops (selective; "
        "--checkpoint-impl torch).",
    ),
    _opt(
        "partition_activations",
        None,
        "deepspeed checkpointing: partition saved activations across model-parallel ranks.",
        flag_pair=True,
    ),
    _opt("cpu_checkpointing", None, "deepspeed checkpointing: keep saved activations in CPU memory.", flag_pair=True),
    _opt(
        "contiguous_memory_optimization",
        None,
        "deepspeed checkpointing: one contiguous buffer for saved activations (needs --partition-activations).",
        flag_pair=True,
    ),
    _opt(
        "compile",
        None,
        "torch.compile each transformer block (inductor; checkpointing wraps the compiled "
        "block). Neither flag: the trainer compiles on a GPU below ZeRO-3.",
        flag_pair=True,
    ),
    _opt(
        "fp8",
        click.Choice(FP8_RECIPES),
        "FP8 matmuls in the transformer blocks' linear layers (torchao float8 "
        "training, pip install -e '.[lowmem]'; GPU with FP8, e.g. H100/H200, "
        "4090): one scale per tensor or per row.",
    ),
    # optimizer
    _opt(
        "adam_impl",
        click.Choice(ADAM_IMPLS),
        "AdamW implementation: torch (torch.optim.AdamW(fused=True), no build), fused "
        "(DeepSpeed FusedAdam, GPU), cpu (DeepSpeedCPUAdam, with optimizer offload).",
    ),
    _opt(
        "optimizer_mode",
        click.Choice(optim_modes.trainable_modes()),
        "Memory-saving optimizer mode the "
        "trainer builds instead of DeepSpeed's AdamW on fp32 masters (docs/optimizer-modes.md); writes the bf16 "
        "and ZeRO keys it needs.",
    ),
    _opt(
        "offload_blocks",
        _NONNEG,
        "Fused optimizer modes, or a LoRA's frozen base (opt-in, with --lora-rank): the last K transformer "
        "blocks keep their bf16 weights in pinned host memory, streamed to the GPU one block ahead (0: all "
        "resident).",
    ),
    _opt(
        "lr",
        click.FloatRange(min=0, min_open=True),
        "Learning rate (peak, after warm-up). The Adafactor modes "
        "(adafactor-sr, fused-adafactor-sr) default to 1e-3 with no weight decay: their lr is relative, a step of "
        "at most lr x RMS(weight), ~2e-5 for FLUX.1's block weights (docs/optimizer-modes.md).",
    ),
    _opt("beta1", click.FloatRange(0, 1, max_open=True), "AdamW beta1."),
    _opt("beta2", click.FloatRange(0, 1, max_open=True), "AdamW beta2."),
    _opt("eps", click.FloatRange(min=0, min_open=True), "AdamW epsilon."),
    _opt("weight_decay", click.FloatRange(min=0), "Decoupled weight decay (0 by default in the Adafactor modes)."),
    _opt("gradient_clipping", click.FloatRange(min=0), "Clip the global gradient norm; 0 disables."),
    # scheduler
    _opt("scheduler", click.Choice(ds_check.SCHEDULERS), "DeepSpeed LR scheduler (none: constant lr)."),
    _opt(
        "warmup_steps",
        _POS,
        "Warm-up steps: the lr reaches --lr at this optimizer step (1 = no warm-up; step 1 already trains).",
    ),
    _opt("total_steps", _POS, "Total optimizer steps (WarmupCosineLR, WarmupDecayLR)."),
    _opt("warmup_type", click.Choice(ds_check.WARMUP_TYPES), "Warm-up curve."),
    _opt(
        "min_lr",
        click.FloatRange(min=0),
        "LR the warm-up ramps from (step 0); step 1 runs at min_lr + (lr - min_lr) / warmup steps.",
    ),
    _opt("cos_min_ratio", click.FloatRange(min=0), "WarmupCosineLR: final lr as a fraction of --lr."),
    # logging
    _opt("steps_per_print", _POS, "DeepSpeed progress print interval (steps)."),
    _opt("wall_clock_breakdown", None, "DeepSpeed forward/backward/step timers.", flag_pair=True),
    _opt("tensorboard_dir", click.Path(file_okay=False), "Enable DeepSpeed's TensorBoard monitor, writing here."),
    _opt("job_name", str, "TensorBoard job name [default: fluxzero]."),
]


def _with_options(fn):
    for decorator in reversed(_OPTIONS):
        fn = decorator(fn)
    return fn


# ---------------------------------------------------------------------------------------------------------
# `gen-config --fit` and the LoRA a config is for: options added to gen-config (the policy is memory.fit's)
# ---------------------------------------------------------------------------------------------------------
FIT_OPTIONS = [
    click.option(
        "--lora-rank",
        type=_NONNEG,
        default=0,
        show_default=True,
        help="The config is for a LoRA of this rank (0: full fine-tune): LoRA lr and warm-up defaults "
        "(1e-4, 10 steps) and, with --fit, the LoRA's memory. The run file's lora section says "
        "the same rank.",
    ),
    options.lora_targets("With --lora-rank: "),
    *ADAPTER_OPTIONS,
    click.option(
        "--base-quant",
        type=click.Choice(memory.BASE_QUANT_CHOICES),
        default="auto",
        show_default=True,
        help="With --lora-rank: the frozen base quantized (int8 or fp8, torchao weight-only; fp8-matmul, FP8 "
        "matmuls on an Ada or Hopper GPU; the run file's lora.base_quant, which the printed next step names); "
        "auto lets --fit choose int8 when the bf16 base does not fit, and fp8-matmul on a --gpu with FP8 tensor "
        "cores where the bf16 base would be streamed or offloaded (without --fit: none).",
    ),
    click.option(
        "--fit",
        is_flag=True,
        default=False,
        help="Choose ZeRO stage, offload, optimizer mode, micro batch, checkpointing, compiled blocks (and, "
        "for a LoRA, the base's quantization): the fastest that fits the hardware (needs "
        "--gpu/--gpu-memory; the world size is 1 unless given); prints why, the predicted peak and "
        "each choice's caveat.",
    ),
    options.gpu("--fit: "),
    options.gpu_memory("--fit: "),
    options.host_memory("--fit: "),
    options.resolution("--fit: "),
    options.txt_len("--fit: "),
    options.margin("--fit: "),
    click.option(
        "--max-micro-batch", type=_POS, default=16, show_default=True, help="--fit: largest micro batch to consider."
    ),
    options.ema("fit_ema", "--fit: "),
    options.ema_device("fit_ema_device", "--fit: "),
]
_FIT_KEYS = (
    "fit",
    "gpu",
    "gpu_memory",
    "host_memory",
    "resolution",
    "txt_len",
    "margin",
    "max_micro_batch",
    "lora_rank",
    "lora_targets",
    *ADAPTER_KEYS,
    "base_quant",
    "fit_ema",
    "fit_ema_device",
)


def fit_options(fn):
    """Add the --fit and LoRA options to a command; the callback receives them as one `fit` dict."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        kwargs["fit"] = {k: kwargs.pop(k) for k in _FIT_KEYS}
        return fn(*args, **kwargs)

    for decorator in reversed(FIT_OPTIONS):
        wrapper = decorator(wrapper)
    return options.renamed("--fit-margin", "--margin", "margin", options.FRACTION)(wrapper)


def apply_fit(
    request: dict, lora, preset, given: dict, hostfile, nodes, gpus_per_node, world_size
) -> memory.GenConfigFit:
    """Run memory.fit_gen_config for gen-config's flags (`lora`: the run file's lora section they describe); prints its lines on stderr. A UsageError when the
    request cannot be searched; when nothing fits, what would on stderr and one sentence (exit 2, nothing written)."""
    one_gpu = hostfile is None and gpus_per_node is None and world_size is None
    if hostfile is not None:
        nodes, gpus_per_node = topology_from(hostfile, None, None)
    elif gpus_per_node is not None:
        nodes = nodes or 1
    else:  # one GPU unless told otherwise, as `fluxzero estimate` assumes
        nodes, gpus_per_node = 1, world_size or 1
    capacity = gpu_memory_from(request["gpu"], request["gpu_memory"], request["base_quant"])
    if capacity is None:
        raise click.UsageError("--fit needs the GPU memory: give --gpu NAME or --gpu-memory GIB")
    try:
        opts = ds_config.options_from(preset, lora=request["lora_rank"] > 0, world_size=nodes * gpus_per_node, **given)
    except DSConfigError as e:
        raise click.UsageError("\n".join(e.problems)) from None
    h, w = request["resolution"]
    try:
        ema = options.ema_section(request["fit_ema"], request["fit_ema_device"])
        run = {"height": h, "width": w, "txt_len": request["txt_len"], **memory.section_fields(lora, ema)}
        req = memory.FitRequest(
            memory.Hardware(
                capacity,
                request["host_memory"],
                nodes,
                gpus_per_node,
                fp8_matmul=request["gpu"] in memory.GPU_FP8_MATMUL,
            ),
            run,
            margin=request["margin"],
            max_micro_batch=request["max_micro_batch"],
            base_quant=request["base_quant"],
        )
        plan = memory.fit_gen_config(opts, given, req)
    except ValueError as e:
        raise click.UsageError(f"--fit: {e}") from None
    if one_gpu:
        plan.lines.insert(0, "world size not given: 1 GPU (pass --world-size N for more)")
    if plan.result.spec is None:  # what would fit, then one sentence (no usage text: the flags were fine)
        # the sentence that says why: "nothing fits ..." or, for pins that contradict each other, the last line
        i = next((i for i, line in enumerate(plan.lines) if line.startswith("nothing fits")), len(plan.lines) - 1)
        click.echo("gen-config --fit:\n  " + "\n  ".join(plan.lines[:i] + plan.lines[i + 1 :]), err=True)
        above = " (what would fit is above)" if plan.lines[i].startswith("nothing fits") else ""
        error = click.ClickException(f"--fit: {plan.lines[i].rstrip('.')}; nothing was written{above}.")
        error.exit_code = 2
        raise error
    click.echo("gen-config --fit:\n  " + "\n  ".join(plan.lines), err=True)
    return plan


def next_command(output: str | None, world: int | None, hostfile, request: dict, base_quant: str | None) -> str:
    """The line after gen-config: the run-file keys this config is for and the command that trains with it."""
    ds = output or "ds.json"
    keys = [f"deepspeed: {ds}"]
    if request["lora_rank"]:
        targets = parse_lora_targets(request["lora_targets"])  # patterns as a YAML list of quoted names: `*` and `,`
        targets = targets if isinstance(targets, str) else json.dumps(list(targets))  # mean something in YAML
        lora = f"lora: {{rank: {request['lora_rank']}, targets: {targets}" + _adapter_keys(request)
        keys.append(lora + (f", base_quant: {base_quant}}}" if base_quant else "}"))
    if request.get("fit_ema", "none") != "none":
        keys.append(f"ema: {{dtype: {request['fit_ema']}, device: {request['fit_ema_device']}}}")
    launch = (
        f"fluxzero launch --hostfile {hostfile} -- --config run.yaml"
        if hostfile
        else f"deepspeed --num_gpus {world or 1} launch/train.py --config run.yaml"
    )
    return f"next: in run.yaml set {'; '.join(keys)}; then {launch}"


def _adapter_keys(request: dict) -> str:
    """The run file's lora keys for --lora-type and the LoKr options (empty for a plain LoRA)."""
    keys = "" if request["lora_type"] == "lora" else f", type: {request['lora_type']}"
    keys += "" if request["lora_factor"] == -1 else f", factor: {request['lora_factor']}"
    return keys + (", decompose_both: true" if request["lora_decompose_both"] else "")


def world_size_from(hostfile, nodes, gpus_per_node, world_size) -> int | None:
    """World size from exactly one of: a hostfile, nodes x GPUs per node, an explicit count (None if none)."""
    given = [name for name, v in (("--hostfile", hostfile), ("--world-size", world_size)) if v is not None]
    if nodes is not None or gpus_per_node is not None:
        given.append("--nodes/--gpus-per-node")
    if len(given) > 1:
        raise click.UsageError(f"give the world size one way only, not {' and '.join(given)}")
    if hostfile is not None:
        from fluxzero.cluster.hostfile import HostfileError, parse_hostfile
        from fluxzero.cluster.hostfile import world_size as hosts_world_size

        try:
            return hosts_world_size(parse_hostfile(hostfile))
        except HostfileError as e:
            raise click.BadParameter(str(e), param_hint="--hostfile") from None
    if nodes is not None or gpus_per_node is not None:
        if gpus_per_node is None:
            raise click.UsageError("--nodes needs --gpus-per-node too (world size = nodes x GPUs per node)")
        return (nodes or 1) * gpus_per_node
    return world_size


@click.command("gen-config", context_settings={"max_content_width": 110})
@_with_options
@fit_options
@click.pass_context
def gen_config(ctx, preset, output, hostfile, nodes, gpus_per_node, world_size, fit, **fields):
    """Write a DeepSpeed JSON config (ZeRO, offload, precision, batch, checkpointing, optimizer, schedule).

    Start from --preset NAME and override any option. Settings DeepSpeed does not know (activation
    checkpointing policy) go into the top-level "fluxzero" section, which the trainer reads.
    """
    world = world_size_from(hostfile, nodes, gpus_per_node, world_size)
    if fit["fit"] and world is None:
        world = 1  # what --fit plans for (apply_fit says so)
    given = {
        k: v
        for k, v in fields.items()
        if ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)
    }
    request, plan = fit, None
    try:  # the trainer's checks of the run file's lora section, so the printed `lora:` line trains
        lora = options.lora_section(request, request["base_quant"])
        if lora is not None:
            from fluxzero.config.models import resolve_model

            lora.check_model(resolve_model(fields["model"]))
    except ValueError as e:
        hints = {k: f"--lora-{k.replace('_', '-')}" for k in ("rank", "targets", "type", "factor", "decompose_both")}
        hint = next(
            (h for k, h in {**hints, "base_quant": "--base-quant"}.items() if str(e).startswith(f"lora.{k}")),
            "--lora-type",
        )
        raise click.BadParameter(str(e), param_hint=hint) from None
    mode = optim_modes.MODES.get(fields.get("optimizer_mode") or "")
    if lora is not None and mode is not None and mode.fused:  # the trainer's rule (train.engine.plan_streaming)
        raise click.UsageError(
            f"--optimizer-mode {mode.name} is for full fine-tunes; a LoRA trains few tensors "
            f"and needs no fused step: choose another --optimizer-mode or drop --lora-rank"
        )
    if request["fit"]:  # memory.fit picks stage, offload, micro batch, checkpointing; what was given stays pinned
        plan = apply_fit(request, lora, preset, given, hostfile, nodes, gpus_per_node, world_size)
        given.update(plan.overrides)
    try:
        ds_options = ds_config.options_from(preset, lora=request["lora_rank"] > 0, world_size=world, **given)
        if plan and ds_options.nvme_path and "nvme" not in (ds_options.offload_optimizer, ds_options.offload_param):
            click.echo(
                f"gen-config --fit: the choice needs no NVMe; --nvme-path {ds_options.nvme_path} is left out", err=True
            )
            ds_options = ds_options.replace(nvme_path=None)
        streaming = ds_check.streaming_problems(ds_config.options_view(ds_options), lora, name=ds_config.option_name)
        if streaming:  # the trainer's rule for the run file with this config (train.engine.plan_streaming)
            raise DSConfigError(streaming)
        # options that choose settings for the user (e.g. a memory fit) adjust `ds_options` here, before build
        cfg = ds_config.build(ds_options)
    except DSConfigError as e:
        raise click.UsageError("\n".join(e.problems)) from None
    text = ds_config.to_json(cfg)
    if output is None:
        click.echo(text, nl=False)
    else:
        try:
            atomic_write(output, text)
        except OSError as e:
            raise click.BadParameter(f"cannot write {output}: {e.strerror}", param_hint="--output") from None
        click.echo(f"wrote {output}", err=True)
    if plan is not None or request["lora_rank"]:
        quant = (
            plan.result.options.get("base_quant")
            if plan
            else (None if request["base_quant"] in ("auto", "none") else request["base_quant"])
        )
        click.echo(next_command(output, world, hostfile, request, quant), err=True)
    if plan is not None and plan.host_warning:
        click.echo(plan.host_warning, err=True)  # the last line: a host need beyond common machines


def _load_json(path: str) -> tuple[object, list[str]]:
    def no_duplicates(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                problems.append(f"duplicate key {key!r} (DeepSpeed refuses duplicates)")
            seen[key] = value
        return seen

    problems: list[str] = []
    from fluxzero.config.user_files import ParseError, parse_json

    try:
        with open(path, encoding="utf-8") as f:
            return parse_json(f.read(), object_pairs_hook=no_duplicates), problems
    except ParseError as e:
        return None, [f"not valid JSON: {e}"]
    except UnicodeDecodeError:
        return None, ["not a text file"]


@click.command("check-config")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--hostfile",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Check batch arithmetic for the world size of this DeepSpeed hostfile.",
)
@click.option("--world-size", type=_POS, default=None, help="Check batch arithmetic for this many ranks.")
@click.option(
    "--deepspeed/--no-deepspeed",
    "run_deepspeed",
    default=True,
    show_default=True,
    help="Also run DeepSpeed's own config parser (imports deepspeed, a few seconds) once fluxzero's checks pass.",
)
def check_config(file, hostfile, world_size, run_deepspeed):
    """Validate a DeepSpeed JSON config: unknown keys, ZeRO/offload rules, batch arithmetic, DeepSpeed's parser.

    Prints one line per problem and exits with status 2 if there is any.
    """
    world = world_size_from(hostfile, None, None, world_size)
    cfg, problems = _load_json(file)
    if cfg is not None:
        problems += ds_check.check(cfg, world)
    if not problems and run_deepspeed:
        # importing deepspeed logs its accelerator choice on stdout; keep stdout for the problem lines
        try:
            with contextlib.redirect_stdout(sys.__stderr__):
                import deepspeed  # noqa: F401
        except ImportError as e:
            raise click.UsageError(
                f"DeepSpeed's parser cannot run here ({e}); pip install -e '.[train]', or "
                "pass --no-deepspeed for fluxzero's checks alone."
            ) from None
        from fluxzero.config.deepspeed.validate import deepspeed_problems

        cfg = ds_check.without_auto(cfg)
        problems += deepspeed_problems(cfg, world or ds_check.implied_world_size(cfg) or 1)
    for line in problems:
        click.echo(f"{file}: {line}")
    if problems:
        sys.exit(2)
    implied = None if world else ds_check.implied_world_size(cfg)
    if world:
        where = f"world size {world}"
    elif implied:  # all three batch keys set: they divide for this one world size only
        v = ds_view.view(cfg)
        where = (
            f"world size {implied} only: train_batch_size {v.global_batch} = micro batch {v.micro_batch} x "
            f"accumulation {v.grad_accum} x {implied} ranks; launch {implied} ranks or regenerate the batch "
            f"sizes"
        )
    else:
        where = "any world size (pass --world-size or --hostfile to check batch)"
    checked = "fluxzero's checks and DeepSpeed's parser" if run_deepspeed else "fluxzero's checks"
    click.echo(f"{file}: OK ({checked}; {where}): {summary(ds_view.view(cfg), world or implied)}")


def summary(v: ds_view.DSView, world: int | None) -> str:
    """What a checked config trains with, in one line, as the trainer reads it (through the DSView)."""
    off = [
        f"{what} offload to {dev}"
        for what, dev in (("optimizer", v.offload_optimizer), ("parameter", v.offload_param))
        if dev != "none"
    ]
    mode = optim_modes.MODES.get(v.optimizer_mode) if isinstance(v.optimizer_mode, str) else None
    precision = v.precision
    if v.trainer_casts_to_bf16:
        precision = "bf16 (the trainer casts the model; bf16 off in DeepSpeed)"
    elif mode is not None and mode.master_dtype == "bf16":
        precision = "bf16 masters"
    parts = [f"ZeRO-{v.stage}" + (f" with {' and '.join(off)}" if off else ""), precision]
    try:
        micro, accum, train = v.batch_for(world or 1)
        batch = f"micro batch {micro} x accumulation {accum}"
        parts.append(batch + (f" (global batch {train})" if world else ""))
    except ds_view.DSConfigError:
        pass  # batch sizes that need a world size to divide: reported with --world-size
    if v.optimizer_mode is not None:
        parts.append(f"optimizer mode {v.optimizer_mode}" + (f" lr {v.lr}" if v.lr is not None else ""))
    elif v.optimizer is not None:
        parts.append(f"{v.optimizer} lr {v.lr}" if v.lr is not None else v.optimizer)
    parts.append(f"{v.scheduler} schedule" if v.scheduler else "constant lr")
    parts.append(f"gradient clipping {v.gradient_clipping}" if v.gradient_clipping else "no gradient clipping")
    k = v.checkpoint_every
    parts.append(
        (
            "no activation checkpointing"
            if k == 0
            else "checkpointing every block"
            if k == 1
            else f"checkpointing 1 block in {k}"
        )
        + (" (selective)" if k and v.checkpoint_policy == "selective" else "")
    )
    if v.compile:
        parts.append(f"compiled blocks ({v.compile_mode})")
    elif v.compile is None:
        parts.append("blocks compiled on a GPU" + (" (not at ZeRO-3)" if v.stage == 3 else ""))
    if v.fp8:
        parts.append(f"FP8 matmuls ({v.fp8} scaling)")
    return ", ".join(parts)
