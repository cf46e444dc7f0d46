"""`fluxzero estimate`: will this run fit? Peak GPU memory per rank and host memory per node, itemised.

Imports only pure modules: it answers without torch or deepspeed installed.
"""

from __future__ import annotations

import json

import click
from click.core import ParameterSource

from fluxzero import plan as memory
from fluxzero.commands import options
from fluxzero.commands.model_spec import MODEL_SPEC
from fluxzero.commands.options import (
    ADAPTER_OPTIONS,
    POS,
    Finite,
    gpu_memory_from,
    topology_from,
)
from fluxzero.config import get_model_config, optim_modes, reshaped
from fluxzero.config.deepspeed import check as ds_check
from fluxzero.config.deepspeed import view as ds_view
from fluxzero.config.deepspeed.adam_impl import ADAM_IMPLS, optimizer_impl
from fluxzero.config.lora import ADAPTER_NAMES, BASE_QUANTS, DEFAULT_TARGETS
from fluxzero.plan import GiB

PHASE_NAMES = {"train": "fwd/bwd", "step": "step", "init": "init"}


OPTIONS = [
    click.option(
        "--model",
        type=MODEL_SPEC,
        default="flux-dev",
        show_default=True,
        help="Model: a preset, PRESET:field=value,... (e.g. flux-dev:depth=5,depth_single_blocks=10) "
        "or a diffusers config.json or its folder.",
    ),
    click.option(
        "--depth",
        type=click.IntRange(min=0),
        default=None,
        help="What-if: this many double-stream blocks instead of the preset's.",
    ),
    click.option(
        "--single-depth",
        type=click.IntRange(min=0),
        default=None,
        help="What-if: this many single-stream blocks instead of the preset's.",
    ),
    click.option("--hidden-size", type=POS, default=None, help="What-if: this model width instead of the preset's."),
    click.option("--heads", type=POS, default=None, help="What-if: this many attention heads (with --hidden-size)."),
    click.option(
        "--ds-config",
        "ds_path",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help="Read stage, offload, precision, micro batch, optimizer, buckets and checkpointing from "
        "this DeepSpeed config (e.g. gen-config's); options given here override it.",
    ),
    options.topology,
    options.gpu(),
    options.gpu_memory(then="; without either, no fit verdict."),
    options.host_memory(),
    options.resolution(),
    options.txt_len(),
    click.option("--micro-batch", type=POS, default=1, show_default=True, help="Samples per GPU per step."),
    click.option(
        "--precision",
        type=click.Choice(ds_check.PRECISIONS),
        default="bf16",
        show_default=True,
        help="Training precision.",
    ),
    click.option("--zero-stage", type=click.IntRange(0, 3), default=2, show_default=True, help="ZeRO stage."),
    click.option(
        "--offload-optimizer",
        type=click.Choice(ds_check.OFFLOAD_DEVICES),
        default="none",
        show_default=True,
        help="Optimizer state offload (stage 1-3; nvme: stage 3).",
    ),
    click.option(
        "--offload-param",
        type=click.Choice(ds_check.OFFLOAD_DEVICES),
        default="none",
        show_default=True,
        help="Parameter offload (stage 3).",
    ),
    click.option(
        "--checkpoint-every",
        type=click.IntRange(min=0),
        default=1,
        show_default=True,
        help="Activation checkpointing: every k-th block (0 off, 1 all).",
    ),
    click.option(
        "--checkpoint-policy",
        type=click.Choice(memory.CHECKPOINT_POLICIES),
        default="full",
        show_default=True,
        help="What a checkpointed block keeps: its inputs (full), or also its matmul and "
        "attention outputs (selective).",
    ),
    click.option(
        "--optimizer",
        type=click.Choice(list(memory.OPTIMIZER_STATE_BYTES)),
        default="adamw",
        show_default=True,
        help="Optimizer (fp32 states: 8 B/param for Adam(W), 4 for SGD/Lion).",
    ),
    click.option(
        "--adam-impl",
        type=click.Choice(ADAM_IMPLS),
        default="torch",
        show_default=True,
        help="torch: torch.optim.AdamW(fused=True), as gen-config writes it; fused: DeepSpeed FusedAdam; cpu: DeepSpeedCPUAdam.",
    ),
    click.option(
        "--optimizer-mode",
        type=click.Choice(list(optim_modes.MODES)),
        default=None,
        help="Memory-saving optimizer mode (fluxzero.config.optim_modes; --ds-config reads fluxzero."
        "optimizer_mode) [default: none, DeepSpeed's AdamW on fp32 masters].",
    ),
    click.option(
        "--offload-blocks",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Fused optimizer modes, or a LoRA's frozen base: the last K blocks' bf16 weights in pinned host "
        "memory, streamed to the GPU (--ds-config reads fluxzero.offload_blocks).",
    ),
    click.option(
        "--lora-rank",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="LoRA adapters of this rank, the base frozen in bf16 (0: full fine-tune).",
    ),
    options.lora_targets(),
    click.option(
        "--lora-dropout",
        type=Finite(0, 1, max_open=True, example="a fraction such as 0.1"),
        default=0.0,
        show_default=True,
        help="LoRA dropout (> 0 saves a dropped-out copy of each adapted input).",
    ),
    *ADAPTER_OPTIONS,
    click.option(
        "--base-quant",
        type=click.Choice(BASE_QUANTS),
        default="none",
        show_default=True,
        help="LoRA: the frozen base quantized (int8 or fp8 weight-only through "
        "torchao; fp8-matmul: e4m3 with FP8 matmuls, on an Ada or Hopper GPU; the run "
        "file's lora.base_quant), the adapters in bf16 with fp32 masters.",
    ),
    options.ema(),
    options.ema_device(),
    click.option(
        "--attention",
        type=click.Choice(memory.ATTENTION_KERNELS),
        default="flash",
        show_default=True,
        help="Attention kernel: flash/efficient keep O(L), math O(L^2).",
    ),
    click.option(
        "--expandable-segments/--no-expandable-segments",
        default=False,
        show_default=True,
        help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation).",
    ),
    click.option(
        "--weights/--no-weights",
        default=True,
        show_default=True,
        help="Pretrained weights are loaded (each rank reads the file one tensor at a time: one layer on the host).",
    ),
    options.margin(),
    click.option("--json", "as_json", is_flag=True, default=False, help="Print one JSON object instead of tables."),
]


def _with_options(fn):
    for decorator in reversed(OPTIONS):
        fn = decorator(fn)
    return fn


def build_spec(
    ctx,
    model,
    ds_path,
    nodes,
    gpus_per_node,
    resolution,
    txt_len,
    attention,
    expandable_segments,
    adam_impl,
    weights=True,
    **values,
) -> memory.RunSpec:
    """RunSpec from defaults < DeepSpeed config (--ds-config) < options given on the command line."""
    fields = {ours: values[opt] for opt, ours in memory.OPTION_FIELDS.items()}
    fields["optimizer_impl"] = optimizer_impl(adam_impl)
    try:  # the run file's sections these options describe, as the trainer reads them
        lora = options.lora_section(values, values["base_quant"])
        ema = options.ema_section(values["ema"], values["ema_device"])
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    fields["zero"] = memory.gen_config_zero(model, fields["stage"])
    if ds_path is not None:
        from fluxzero.config.deepspeed import check as ds_check
        from fluxzero.config.deepspeed import file as ds_file

        try:
            ds = ds_file.read_json(ds_path)
        except ds_view.DSConfigError as e:
            raise click.BadParameter(str(e), param_hint="--ds-config") from None

        for problem in ds_check.check(ds):  # DeepSpeed would ignore a misspelled key; the trainer refuses the file
            if problem.startswith("unknown key"):
                raise click.BadParameter(
                    f"{ds_path}: {problem}, which DeepSpeed ignores and the trainer refuses: "
                    f"fix it (`fluxzero check-config {ds_path}` checks the whole file)",
                    param_hint="--ds-config",
                )
            if problem.startswith(tuple(f"{k} must be" for k in ds_view.BATCH_KEYS)):  # NaN would read as unset
                raise click.BadParameter(f"{ds_path}: {problem}", param_hint="--ds-config")
        try:  # read through ds_view.view, as the trainer reads it
            from_file = memory.run_options_from_ds_config(ds, nodes * gpus_per_node)
        except ds_view.DSConfigError as e:
            raise click.BadParameter(f"{ds_path}: {e}", param_hint="--ds-config") from None
        except (ValueError, TypeError, AttributeError) as e:
            raise click.BadParameter(
                f"{ds_path} has a value of the wrong kind ({e}); `fluxzero check-config {ds_path}` names it",
                param_hint="--ds-config",
            ) from None
        if "micro_batch" not in from_file and ctx.get_parameter_source("micro_batch") != ParameterSource.COMMANDLINE:
            click.echo(
                f"warning: {ds_path} does not set the micro batch (train_micro_batch_size_per_gpu); "
                f"estimated with micro batch "
                f"{values['micro_batch']} (pass --micro-batch)",
                err=True,
            )
        given = {
            ours
            for opt, ours in memory.OPTION_FIELDS.items()
            if ctx.get_parameter_source(opt) == ParameterSource.COMMANDLINE
        }
        if ctx.get_parameter_source("adam_impl") == ParameterSource.COMMANDLINE:
            given.add("optimizer_impl")
        fields.update({k: v for k, v in from_file.items() if k not in given})
    h, w = resolution
    try:
        shape = reshaped(
            get_model_config(model),
            depth=values.get("depth"),
            depth_single_blocks=values.get("single_depth"),
            hidden_size=values.get("hidden_size"),
            num_heads=values.get("heads"),
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:
        if ctx.get_parameter_source("precision") != ParameterSource.COMMANDLINE:
            fields["precision"] = optim_modes.trained_precision(fields.get("optimizer_mode"), fields["precision"])
        return memory.RunSpec.from_run(
            shape,
            lora=lora,
            ema=ema,
            weights=weights,
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            height=h,
            width=w,
            txt_len=txt_len,
            attention=attention,
            expandable_segments=expandable_segments,
            **fields,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def _gib(n: int) -> str:
    return f"{n / GiB:8.2f}"


def describe(spec: memory.RunSpec) -> str:
    inv = memory.param_inventory(spec.model)
    opt = spec.optimizer + (" (torch foreach)" if spec.optimizer_impl == "torch" else "")
    if spec.optimizer_mode is not None:
        opt = f"optimizer mode {spec.optimizer_mode}"
    if spec.offload_blocks:
        opt += f", the last {spec.offload_blocks} blocks streamed from host memory"
    if spec.lora_rank:
        kind = ADAPTER_NAMES[spec.lora_type]
        opt += (
            f", {kind} rank {spec.lora_rank} on {spec.lora_targets} ({memory.trained_params(spec) / 1e6:.1f}M trained)"
        )
    if spec.ema:
        opt += f", EMA {spec.ema} on the {spec.ema_device}"
    size = f"{inv.total / 1e9:.2f}B" if inv.total >= 1e8 else f"{inv.total / 1e6:.2f}M"
    return (
        f"{spec.model.name} ({size} parameters), {spec.world_size} GPU(s) "
        f"({spec.nodes} node(s) x {spec.gpus_per_node}), {spec.height}x{spec.width} px = {spec.img_tokens} image "
        f"{'(target + Kontext reference) ' if spec.reference_tokens else ''}+ {spec.txt_len} text tokens, micro batch {spec.micro_batch}, {spec.precision}, {opt}, "
        f"{spec.attention} attention\n"
        f"{memory.zero_label(spec.stage, spec.offload_optimizer, spec.offload_param)}, "
        f"{memory.checkpointing_text(spec.checkpoint_every, spec.checkpoint_policy)}"
    )


def report(est: memory.Estimate, hw: memory.Hardware | None, margin: float, zero_by_stage=None) -> str:
    s = est.spec
    phase_name = {"resident": "always", "train": "fwd/bwd", "step": "step", "load": "loading", "init": "init"}
    lines = [describe(s), "", f"GPU memory per rank{'':33}GiB  when     note"]
    for i in est.group("gpu"):
        lines.append(f"  {i.name:<48}{_gib(i.bytes)}  {phase_name[i.phase]:<8} {i.note}")
    lines += [
        f"  {'peak while building the engine':<48}{_gib(est.gpu_phase('init'))}",
        f"  {'peak at forward/backward':<48}{_gib(est.gpu_phase('train'))}",
        f"  {'peak at optimizer step':<48}{_gib(est.gpu_phase('step'))}",
        f"  {'= max_memory_allocated':<48}{_gib(est.gpu_allocated)}  ({PHASE_NAMES[est.peak_phase]})",
        f"  {f'+ {est.fragmentation:.0%} of transients (fragmentation) = reserved':<48}{_gib(est.gpu_reserved)}",
        f"  {f'+ CUDA context and NCCL ({s.cuda_context_gib:g} GiB) = needed':<48}{_gib(est.gpu_total)}",
        "",
        f"Host memory per node ({s.gpus_per_node} rank(s)){'':22}GiB  when     note",
    ]
    for i in est.group("host"):
        lines.append(
            f"  {i.name + ' x ' + str(s.gpus_per_node):<48}{_gib(i.bytes * s.gpus_per_node)}  "
            f"{phase_name[i.phase]:<8} {i.note}"
        )
    lines.append(f"  {'needed (larger of loading and training)':<48}{_gib(est.host_per_node)}")
    moved = memory.stream_traffic(s)
    if moved:
        lines += [
            "",
            "Moved between host and GPU per micro batch (streamed blocks, side CUDA streams, one block "
            "ahead of the compute)",
        ]
        lines += [f"  {what:<48}{_gib(n)}" for what, n in moved]
    if est.nvme_per_node:
        lines.append(f"  {'NVMe per node':<48}{_gib(est.nvme_per_node)}")
    if hw is not None:
        ok, why = memory.verdict(est, hw, margin)
        unchecked = ok and hw.host_memory_gib is None
        lines += [
            "",
            ("FITS THE GPU: " if unchecked else "FITS: " if ok else "DOES NOT FIT: ")
            + why
            + (
                f"; host memory not checked: it needs {est.host_per_node / GiB:.1f} GiB per node (pass --host-memory)"
                if unchecked
                else ""
            ),
        ]
    lines += [
        "",
        "The same run at every ZeRO stage and offload choice:",
        f"  {'configuration':<58}{'allocated':>10}{'needed':>9}  {'peak at':<8}{'host/node':>10}  fits",
    ]
    for r, e in memory.table(s, zero_by_stage):
        fits = "-" if hw is None else _fits_word(memory.verdict(e, hw, margin)[0], hw)
        label = memory.zero_label(r.stage, r.offload_optimizer, r.offload_param)
        lines.append(
            f"  {label:<58}{e.gpu_allocated / GiB:10.1f}{e.gpu_total / GiB:9.1f}  "
            f"{PHASE_NAMES[e.peak_phase]:<8}{e.host_per_node / GiB:10.1f}  {fits}"
        )
    if hw is not None and hw.host_memory_gib is None:
        lines.append("  (gpu: fits the GPU; host memory not checked: pass --host-memory)")
    return "\n".join(lines)


def _fits_word(ok: bool, hw: memory.Hardware) -> str:
    """A table row's verdict: "yes" only when the host was checked too."""
    return "no" if not ok else "yes" if hw.host_memory_gib is not None else "gpu"


def as_dict(est: memory.Estimate, hw: memory.Hardware | None, margin: float, zero_by_stage=None) -> dict:
    s = est.spec
    out = {
        "model": s.model.name,
        "world_size": s.world_size,
        "nodes": s.nodes,
        "gpus_per_node": s.gpus_per_node,
        "height": s.height,
        "width": s.width,
        "txt_len": s.txt_len,
        "micro_batch": s.micro_batch,
        "precision": s.precision,
        "stage": s.stage,
        "offload_optimizer": s.offload_optimizer,
        "optimizer_mode": s.optimizer_mode,
        "lora_rank": s.lora_rank,
        "lora_type": s.lora_type,
        "ema": s.ema,
        "trained_params": memory.trained_params(s),
        "fragmentation": est.fragmentation,
        "offload_param": s.offload_param,
        "checkpoint_every": s.checkpoint_every,
        "checkpoint_policy": s.checkpoint_policy,
        "offload_blocks": s.offload_blocks,
        "stream_traffic": dict(memory.stream_traffic(s)),
        "gpu_allocated_gib": est.gpu_allocated / GiB,
        "gpu_reserved_gib": est.gpu_reserved / GiB,
        "gpu_needed_gib": est.gpu_total / GiB,
        "peak_phase": est.peak_phase,
        "host_per_node_gib": est.host_per_node / GiB,
        "nvme_per_node_gib": est.nvme_per_node / GiB,
        "items": [{"name": i.name, "gib": i.bytes / GiB, "where": i.where, "phase": i.phase} for i in est.items],
        "table": [
            {
                "stage": r.stage,
                "offload_optimizer": r.offload_optimizer,
                "offload_param": r.offload_param,
                "gpu_allocated_gib": e.gpu_allocated / GiB,
                "gpu_needed_gib": e.gpu_total / GiB,
                "host_per_node_gib": e.host_per_node / GiB,
            }
            for r, e in memory.table(s, zero_by_stage)
        ],
    }
    if hw is not None:
        out["fits"], out["reason"] = memory.verdict(est, hw, margin)
        out["host_checked"] = hw.host_memory_gib is not None
        for row, (_r, e) in zip(out["table"], memory.table(s, zero_by_stage)):
            row["fits"] = _fits_word(memory.verdict(e, hw, margin)[0], hw)
    return out


@click.command("estimate")
@options.renamed(
    "--config",
    "--ds-config",
    "ds_path",
    click.Path(exists=True, dir_okay=False),
    note=" (--config is the run file in `fluxzero train`)",
)
@_with_options
@click.pass_context
def estimate(
    ctx,
    model,
    ds_path,
    hostfile,
    nodes,
    gpus_per_node,
    gpu,
    gpu_memory,
    host_memory,
    resolution,
    txt_len,
    attention,
    expandable_segments,
    adam_impl,
    weights,
    margin,
    as_json,
    **values,
):
    """Predict peak GPU memory per rank and host memory per node of a run, itemised, before launching it.

    The breakdown covers parameters, gradients, fp32 master copy and optimizer states (per ZeRO stage and
    offload), communication buckets, ZeRO-3 gathered parameters, activations per block with checkpointing,
    allocator slack and the CUDA context; a table repeats the run at every stage and offload choice.
    """
    nodes, gpus_per_node = topology_from(hostfile, nodes, gpus_per_node)
    spec = build_spec(
        ctx,
        model,
        ds_path,
        nodes,
        gpus_per_node,
        resolution,
        txt_len,
        attention,
        expandable_segments,
        adam_impl,
        weights,
        **values,
    )
    capacity = gpu_memory_from(gpu, gpu_memory, values["base_quant"])
    hw = None
    if capacity is not None:
        hw = memory.Hardware(capacity, host_memory, nodes, gpus_per_node, fp8_matmul=gpu in memory.GPU_FP8_MATMUL)
    est = memory.estimate(spec)
    # the table's other stages: gen-config's defaults, unless a config file fixes the settings for all rows
    zero_by_stage = None if ds_path else {st: memory.gen_config_zero(model, st) for st in range(4)}
    world = {"hostfile": hostfile, "nodes": nodes, "gpus_per_node": gpus_per_node}
    advice = None if hw is None else advise(est, hw, margin, zero_by_stage, gpu, world, resolution, txt_len)
    if as_json:
        d = as_dict(est, hw, margin, zero_by_stage)
        if advice is not None:
            d["instead"], d["next"] = advice[1], advice[2]
        click.echo(json.dumps(d, indent=1))
    else:
        click.echo(report(est, hw, margin, zero_by_stage) + ("" if advice is None else "\n\n" + advice[0]))


def advise(
    est: memory.Estimate,
    hw: memory.Hardware,
    margin: float,
    zero_by_stage,
    gpu: str | None,
    world: dict,
    resolution: tuple[int, int],
    txt_len: int,
) -> tuple[str, dict | None, str]:
    """(text, the configuration that fits instead or None, the next command): for a run that fits, the
    gen-config line that writes it; for one that does not, what memory.fit chooses on this hardware and the
    `gen-config --fit` line that writes that."""
    s = est.spec
    hw_flags = [f"--gpu {gpu}" if gpu else f"--gpu-memory {hw.gpu_memory_gib:g}"]
    if hw.host_memory_gib is not None:
        hw_flags.append(f"--host-memory {hw.host_memory_gib:g}")
    shape = _shape_flags(s, world, resolution, txt_len)
    if memory.verdict(est, hw, margin)[0]:
        flags = [
            f"--zero-stage {s.stage}",
            f"--micro-batch {s.micro_batch}",
            f"--checkpoint-every {s.checkpoint_every}",
        ]
        flags += (
            [f"--checkpoint-policy {s.checkpoint_policy}"]
            if s.checkpoint_every and s.checkpoint_policy != "full"
            else []
        )
        flags += [f"--offload-optimizer {s.offload_optimizer}"] if s.offload_optimizer != "none" else []
        flags += [f"--offload-param {s.offload_param}"] if s.offload_param != "none" else []
        flags += [f"--optimizer-mode {s.optimizer_mode}"] if s.optimizer_mode else []
        flags += [f"--offload-blocks {s.offload_blocks}"] if s.offload_blocks else []
        cmd = " ".join(["fluxzero gen-config", *shape, *flags, "-o ds.json"])
        return f"next: {cmd}" + _host_note(est, hw), None, cmd
    r = memory.fit(s, hw, margin, zero_by_stage=zero_by_stage, modes=() if s.lora_rank else memory.FIT_MODES)
    cmd = " ".join(["fluxzero gen-config --fit", *hw_flags, *shape, "-o ds.json"])
    if r.spec is None:
        return (
            "\n".join(["What fits instead:"] + r.reason.split("\n") + [f"next: {cmd} (with one of the changes above)"]),
            None,
            cmd,
        )
    o = r.options
    chosen = memory.zero_label(o["stage"], o["offload_optimizer"], o["offload_param"])
    extra = [f"optimizer mode {o['optimizer_mode']}"] if o["optimizer_mode"] else []
    extra += [f"{o['base_quant']} base"] if o.get("base_quant") else []
    extra += [f"the last {o['offload_blocks']} blocks streamed from host memory"] if o.get("offload_blocks") else []
    text = (
        f"What fits instead: {chosen}{''.join(', ' + e for e in extra)}, micro batch {o['micro_batch']}, "
        f"{memory.checkpointing_text(o['checkpoint_every'], o['checkpoint_policy'])}: predicted {r.estimate.gpu_allocated / GiB:.1f} GiB "
        f"allocated, {r.estimate.gpu_total / GiB:.1f} GiB needed, {r.estimate.host_per_node / GiB:.1f} GiB "
        f"host per node"
    )
    return f"{text}\nnext: {cmd}" + _host_note(r.estimate, hw), o, cmd


def _host_note(est: memory.Estimate, hw: memory.Hardware) -> str:
    """A last line when the host was not checked and the run needs more than common machines have."""
    need, common = est.host_per_node / GiB, memory.COMMON_HOST_GIB_PER_GPU * hw.gpus_per_node
    if hw.host_memory_gib is not None or need <= common:
        return ""
    return (
        f"\nwarning: it needs {need:.0f} GiB of host memory per node, more than the {common} GiB common machines "
        f"have for {hw.gpus_per_node} GPU(s); pass --host-memory with yours"
    )


def _shape_flags(s: memory.RunSpec, world: dict, resolution: tuple[int, int], txt_len: int) -> list[str]:
    """gen-config flags for the model, topology, image size and LoRA of an estimate."""
    flags = [] if s.model.name == "flux-dev" else [f"--model {s.model.name}"]
    if world["hostfile"]:
        flags.append(f"--hostfile {world['hostfile']}")
    elif world["nodes"] > 1:
        flags.append(f"--nodes {world['nodes']} --gpus-per-node {world['gpus_per_node']}")
    else:
        flags.append(f"--world-size {world['gpus_per_node']}")
    h, w = resolution
    flags += [] if (h, w) == (512, 512) else [f"--resolution {h}" if h == w else f"--resolution {h}x{w}"]
    flags += [] if txt_len == 512 else [f"--txt-len {txt_len}"]
    if s.lora_rank:
        flags.append(f"--lora-rank {s.lora_rank}")
        if s.lora_targets != DEFAULT_TARGETS:
            targets = s.lora_targets if isinstance(s.lora_targets, str) else ",".join(s.lora_targets)
            flags.append(f"--lora-targets {targets}")
        if s.lora_type != "lora":
            flags.append(f"--lora-type {s.lora_type}")
        if s.lora_factor != -1:
            flags.append(f"--lora-factor {s.lora_factor}")
        if s.lora_decompose_both:
            flags.append("--lora-decompose-both")
        if s.base_quant:
            flags.append(f"--base-quant {s.base_quant}")
    return flags
