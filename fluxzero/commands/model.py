"""`fluxzero convert`: move FLUX.1 transformer weights between BFL, ComfyUI and diffusers layouts, and LoRA files
between the diffusers/PEFT and kohya/ComfyUI layouts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import click

from fluxzero.dtypes import TORCH_NAMES, torch_dtype

from . import refuse_existing
from .options import Finite

DTYPES = ("keep", *TORCH_NAMES)


def as_lora_options(f):
    """--as-lora-rank and --max-error, which `convert` and `export` share (fluxzero.model.adapters)."""
    f = click.option(
        "--max-error",
        type=Finite(min=0, example="a relative error such as 0.05"),
        default=None,
        help="With --as-lora-rank: refuse (writing nothing) when a layer's relative error is above this.",
    )(f)
    return click.option(
        "--as-lora-rank",
        type=click.IntRange(min=1),
        default=None,
        help="Write a plain LoRA of this rank standing for the adapters (LoRA, DoRA or LoKr; in "
        "convert, IN in any trainer's layout): the truncated SVD of each layer's change, for "
        "Nunchaku and other plain-LoRA loaders; prints its relative error per layer and "
        "overall.",
    )(f)


@click.command("convert")
@click.argument("src", metavar="IN", type=click.Path(exists=True, path_type=Path))
@click.argument("dst", metavar="OUT", type=click.Path(path_type=Path))
@click.option(
    "--to",
    "layout",
    type=click.Choice(["bfl", "diffusers", "comfyui", "kohya"]),
    required=True,
    help="Layout to write: a BFL or ComfyUI .safetensors file, or a diffusers transformer folder. A LoRA "
    "file: diffusers writes the diffusers/PEFT layout, kohya (or bfl, comfyui) the kohya layout "
    "ComfyUI reads.",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default="keep",
    show_default=True,
    help="Convert tensors to this dtype while writing.",
)
@click.option(
    "--model",
    "preset",
    default=None,
    help="Model the weights must match: a preset, PRESET:field=value,... or a diffusers config.json "
    "(default: the tensor shapes, with the RoPE axes the weights declare).",
)
@click.option(
    "--max-shard-gb",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Largest diffusers shard, in GB (2**30 bytes); more than one shard writes an index JSON.",
)
@as_lora_options
@click.option(
    "--base",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="With --as-lora-rank on a DoRA: the base weights it was trained on (a DoRA rescales them).",
)
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
def convert(  # noqa: C901
    src: Path,
    dst: Path,
    layout: str,
    dtype: str,
    preset: str | None,
    max_shard_gb: float,
    as_lora_rank: int | None,
    max_error: float | None,
    base: Path | None,
    overwrite: bool,
):
    """Convert FLUX.1 transformer weights between BFL, ComfyUI and diffusers layouts.

    IN is a .safetensors file (BFL, ComfyUI or diffusers naming, detected from its keys) or a diffusers
    folder (a pipeline folder with transformer/, or the transformer folder itself). OUT is a
    .safetensors file for --to bfl/comfyui and a folder for --to diffusers.

    IN may also be a LoRA file (diffusers/PEFT, kohya, or fluxzero's own module names): OUT is then a LoRA
    .safetensors file in the layout --to names, with the same rank, alpha and delta. A LoKr or DoRA file
    (LyCORIS, SimpleTuner, ai-toolkit, OneTrainer layouts) is written as a plain LoRA with --as-lora-rank.
    """

    from ..config import resolve_model
    from ..model.layouts import WeightsError
    from ..model.lora_keys import is_lora_file
    from ..model.weights import ignored_tensors, load_weights, save_weights, source_config

    refuse_existing(dst, overwrite)
    if max_error is not None and as_lora_rank is None:
        raise click.UsageError("--max-error bounds the error of --as-lora-rank; add --as-lora-rank R or drop it")
    if base is not None and as_lora_rank is None:
        raise click.UsageError("--base is a DoRA's base weights for --as-lora-rank; add --as-lora-rank R or drop it")
    from ..model.adapters import has_adapter_keys

    if has_adapter_keys(src) and as_lora_rank is None:
        raise click.BadParameter(
            f"{src} is a LoKr or DoRA, which plain-LoRA loaders (Nunchaku, diffusers) cannot "
            "apply; pass --as-lora-rank R to write it as a plain LoRA of rank R",
            param_hint="IN",
        )
    if as_lora_rank is not None:
        if preset:
            raise click.UsageError(
                "--model applies to full weights; an adapter file is converted as it is (drop --model)"
            )
        return _convert_to_plain(src, dst, layout, dtype, as_lora_rank, max_error, base)
    if is_lora_file(src):
        if preset:
            raise click.UsageError("--model applies to full weights; a LoRA file is converted as it is (drop --model)")
        return _convert_lora(src, dst, layout, dtype)
    if layout != "diffusers" and layout != "kohya" and dst.suffix != ".safetensors":
        raise click.BadParameter(f"--to {layout} writes one file: give OUT a .safetensors name", param_hint="OUT")
    try:
        cfg = resolve_model(preset) if preset else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--model") from None
    out_dtype = None if dtype == "keep" else torch_dtype(dtype)
    from safetensors import SafetensorError

    try:
        if layout == "kohya":
            ignored_tensors(src)  # reads IN's header: an unreadable or pickled IN is named as such, not as weights
            raise click.BadParameter(
                "kohya is a LoRA layout and IN holds full weights; write them as bfl, comfyui or diffusers",
                param_hint="--to",
            )
        if cfg is None:  # keeps the RoPE axes the weights declare, for the file or config.json written
            cfg = source_config(src)
        state = load_weights(src, cfg=cfg, dtype=None if dtype == "fp16" else out_dtype)
    except WeightsError as e:
        raise click.BadParameter(str(e), param_hint="IN") from None
    if dtype == "fp16":
        _to_fp16(state, src)
    try:
        save_weights(state, dst, layout=layout, cfg=cfg, max_shard_bytes=int(max_shard_gb * 2**30))
    except WeightsError as e:  # a model the diffusers layout cannot hold
        raise click.BadParameter(str(e), param_hint="--to") from None
    except (OSError, SafetensorError) as e:  # unwritable folder, a file where a folder should be, disk full
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0][:200]
        raise click.BadParameter(
            f"cannot write {dst} ({reason}); choose a writable place with free space", param_hint="OUT"
        ) from None
    n = sum(t.numel() for t in state.values())
    click.echo(f"wrote {dst} ({layout}, {len(state)} tensors, {n:,} parameters)")
    left = ignored_tensors(src)
    if left:
        groups = Counter(k.split(".", 1)[0] for k in left)
        click.echo(
            f"left out {len(left)} tensors of IN that are not the transformer's: "
            f"{', '.join(f'{g}.* ({c})' for g, c in groups.items())}"
        )


def _to_fp16(state: dict, src: Path) -> None:
    """`state`'s floating tensors cast to fp16 in place, or BadParameter when a value lies beyond fp16's range
    (it would be written as inf, and fluxzero refuses weights holding inf)."""
    import torch

    top = torch.finfo(torch.float16).max
    over = [k for k, t in state.items() if t.is_floating_point() and t.numel() and t.abs().max() > top]
    if over:
        raise click.BadParameter(
            f"{len(over)} of {len(state)} tensors of {src} hold values beyond fp16's range "
            f"(+-{top:g}; e.g. {over[0]}), which fp16 would store as inf; write bf16 (the same "
            f"size, fp32's range) or keep",
            param_hint="--dtype",
        )
    for k, t in state.items():
        if t.is_floating_point():
            state[k] = t.to(torch.float16)


def _convert_lora(src: Path, dst: Path, layout: str, dtype: str) -> None:
    """A LoRA file rewritten in another LoRA layout (fluxzero.model.lora_formats reads any, writes two)."""

    from ..config.lora import LoraConfig
    from ..model.lora_formats import read_lora, save_lora
    from ..model.lora_keys import LoraError
    from ..train.export.lora import LORA_LAYOUTS

    if dst.suffix != ".safetensors":
        raise click.BadParameter("a LoRA is written as one file: give OUT a .safetensors name", param_hint="OUT")
    out_layout = LORA_LAYOUTS[layout]
    try:
        sd, info = read_lora(src)
        try:  # the targets it was trained with when it says (fluxzero's header), else the modules it holds
            lcfg = LoraConfig(rank=info.rank, alpha=info.alpha, targets=info.targets or list(info.modules))
        except ValueError:
            lcfg = LoraConfig(rank=info.rank, alpha=info.alpha, targets=list(info.modules))
        out_dtype = None if dtype in ("keep", "fp16") else torch_dtype(dtype)
        if dtype == "fp16":
            _to_fp16(sd, src)
        save_lora(dst, sd, lcfg, layout=out_layout, base_model=info.base_model, dtype=out_dtype)
    except LoraError as e:
        raise click.BadParameter(str(e), param_hint="IN") from None
    except OSError as e:
        raise click.BadParameter(
            f"cannot write {dst} ({e.strerror or e}); choose a writable place with free space", param_hint="OUT"
        ) from None
    click.echo(
        f"wrote {dst} (LoRA, {out_layout} layout, {len(info.modules)} modules, rank {info.rank}, "
        f"alpha {info.alpha:g}) from {src} ({info.layout} layout)"
    )


def _convert_to_plain(
    src: Path, dst: Path, layout: str, dtype: str, rank: int, max_error: float | None, base: Path | None
) -> None:
    """An adapter file (LoKr, DoRA or LoRA) as a plain LoRA of `rank` (fluxzero.model.adapters), nothing written
    when a layer's error is above `max_error`."""
    import torch

    from ..config.lora import LoraConfig
    from ..model import adapters
    from ..model.layouts import WeightsError
    from ..model.lora_formats import read_lora, save_lora
    from ..model.lora_keys import LoraError
    from ..model.weights import load_weights
    from ..train.export.lora import LORA_LAYOUTS

    if dst.suffix != ".safetensors":
        raise click.BadParameter("a LoRA is written as one file: give OUT a .safetensors name", param_hint="OUT")
    out_layout = LORA_LAYOUTS[layout]
    try:
        if adapters.has_adapter_keys(src):
            parts, _ = adapters.read_adapters(src)
        else:  # a plain LoRA at another rank: read_lora knows every LoRA layout's scale
            sd, info = read_lora(src)
            parts = adapters.trained_parts(sd, LoraConfig(rank=info.rank, alpha=info.alpha, targets=list(info.modules)))
        first = next(t for p in parts for t in p.tensors.values() if t.is_floating_point())
        out_dtype = first.dtype if dtype == "keep" else torch_dtype(dtype)
        try:
            weights = load_weights(base, dtype=torch.float32) if base else None
        except WeightsError as e:
            raise click.BadParameter(str(e), param_hint="--base") from None
        plain = adapters.as_plain_lora(adapters.module_deltas(parts, weights), rank, out_dtype)
        for line in adapters.error_report(plain):
            click.echo(line)
        adapters.check_error(plain, max_error, str(src))
        save_lora(dst, plain.state_dict, plain.config, layout=out_layout)
    except LoraError as e:
        raise click.BadParameter(str(e), param_hint="IN") from None
    except OSError as e:
        raise click.BadParameter(
            f"cannot write {dst} ({e.strerror or e}); choose a writable place with free space", param_hint="OUT"
        ) from None
    kinds = sorted({p.kind for p in parts})
    click.echo(
        f"wrote {dst} (plain LoRA of rank {rank}, {out_layout} layout, {len(plain.errors)} modules, relative "
        f"error {plain.overall:.3g} overall) from {src} ({', '.join(kinds)})"
    )
