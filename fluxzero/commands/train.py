"""`fluxzero train` (one process, or under torchrun / the deepspeed launcher) and `fluxzero export`."""

from __future__ import annotations

from pathlib import Path

import click

from . import refuse_existing
from .model import as_lora_options


@click.command("train", context_settings={"ignore_unknown_options": True})
@click.option(
    "--config",
    "config",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="YAML run file (e.g. launch/tiny.yaml).",
)
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
def train(config: Path, overrides: tuple[str, ...]):
    """Train FLUX.1 as the run file says (same as `python launch/train.py`).

    One process when started plainly; under `torchrun` or the `deepspeed` launcher, one rank per process.
    KEY=VALUE pairs override run-file settings, e.g. `steps=50 flow.shift=none`.
    """
    from fluxzero.config.runfile import override_key
    from fluxzero.train.loop import main

    for item in overrides:
        if "=" not in item:
            hint = f"; run-file settings are overridden as {override_key(item)}=VALUE" if item.startswith("--") else ""
            raise click.BadParameter(f"{item!r} is not KEY=VALUE{hint}", param_hint="[KEY=VALUE]...")
    code = main(["--config", str(config), *overrides])
    raise SystemExit(code)


@click.command("export")
@click.argument("ckpt_dir", metavar="CKPT_DIR", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", metavar="OUT", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "layout",
    type=click.Choice(["bfl", "diffusers", "comfyui"]),
    default="bfl",
    show_default=True,
    help="Layout to write: a BFL or ComfyUI .safetensors file, or a diffusers folder.",
)
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp32"]),
    default="bf16",
    show_default=True,
    help="Tensor dtype of the export (the checkpoint's fp32 master weights are the source).",
)
@click.option(
    "--weights",
    type=click.Choice(["live", "ema"]),
    default="live",
    show_default=True,
    help="The trained weights, or the EMA the run kept (its ema: section).",
)
@click.option(
    "--merge",
    is_flag=True,
    help="LoRA checkpoints: write the base weights with the LoRA merged in (full weights in --format) "
    "instead of the LoRA file.",
)
@click.option(
    "--base",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="With --merge: the base weights to merge into; with --as-lora-rank, a DoRA's base weights  "
    "[default: the run's weights:].",
)
@as_lora_options
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
def export(
    ckpt_dir: Path,
    out: Path,
    layout: str,
    dtype: str,
    weights: str,
    merge: bool,
    base: Path | None,
    as_lora_rank: int | None,
    max_error: float | None,
    overwrite: bool,
):
    """Consolidate a training checkpoint (any ZeRO stage) into FLUX.1 safetensors.

    CKPT_DIR is a run's output_dir, its checkpoints/ folder (the `latest` checkpoint is used) or one
    checkpoint folder such as checkpoints/step_00001000. ZeRO shards are merged with DeepSpeed's own
    zero_to_fp32 consolidation, so this runs on one CPU process.

    A LoRA run's checkpoint gives its LoRA file (OUT.safetensors): the diffusers/PEFT layout for --format
    diffusers, the kohya layout ComfyUI reads for bfl and comfyui; with --merge, the full weights. A DoRA or
    LoKr run's gives its file in LyCORIS' layout (ComfyUI reads it), or with --as-lora-rank a plain LoRA.
    """
    if merge and as_lora_rank:
        raise click.UsageError("--merge writes full weights and --as-lora-rank a plain LoRA; choose one")
    if max_error is not None and as_lora_rank is None:
        raise click.UsageError("--max-error bounds the error of --as-lora-rank; add --as-lora-rank R or drop it")
    refuse_existing(out, overwrite)
    if layout != "diffusers" and out.suffix != ".safetensors":
        raise click.BadParameter(f"--format {layout} writes one file: give OUT a .safetensors name", param_hint="OUT")
    from fluxzero.train.distributed import TrainingError
    from fluxzero.train.export.consolidate import resolve_checkpoint
    from fluxzero.train.export.full import export_checkpoint

    try:
        ckpt, tag = resolve_checkpoint(ckpt_dir)
    except TrainingError as e:
        raise click.BadParameter(str(e), param_hint="CKPT_DIR") from None
    try:
        if as_lora_rank or merge or base:
            from fluxzero.train.export.lora import export_lora

            export_lora(
                ckpt / tag,
                out,
                layout,
                dtype,
                merge=not as_lora_rank,
                base=str(base) if base else None,
                weights=weights,
                as_lora_rank=as_lora_rank,
                max_error=max_error,
                report=click.echo,
            )
        else:  # a LoRA checkpoint writes its LoRA file (kohya layout for bfl / comfyui)
            export_checkpoint(ckpt / tag, out, layout, dtype, weights)
    except TrainingError as e:  # a corrupt checkpoint or an unwritable OUT: the message names which
        raise click.UsageError(str(e)) from None
    from fluxzero.model.adapters import has_adapter_keys
    from fluxzero.model.lora_keys import is_lora_file
    from fluxzero.train.export.lora import LORA_LAYOUTS

    if as_lora_rank:
        what = f"plain LoRA of rank {as_lora_rank}, {LORA_LAYOUTS[layout]} layout"
    elif merge or base:
        what = f"full weights with the LoRA merged in, {layout}"
    elif has_adapter_keys(out):
        what = "LoKr / DoRA, LyCORIS layout"
    elif is_lora_file(out):
        what = f"LoRA, {LORA_LAYOUTS[layout]} layout" + (f" for {layout}" if LORA_LAYOUTS[layout] != layout else "")
    else:
        what = layout
    click.echo(f"wrote {out} ({what}, {dtype}, {weights} weights) from {ckpt / tag}")
