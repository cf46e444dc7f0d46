"""Export of a LoRA run: its checkpoint's adapters as a LoRA file (diffusers/PEFT or kohya/ComfyUI layout),
or merged into the base weights in any full layout. full.py consolidates the checkpoint and hands LoRA
checkpoints here.

A LoRA checkpoint holds the adapters only (checkpoint.save leaves the frozen base out), so consolidation
gives just the fp32 master adapters; rank, alpha and targets come from the run.yaml saved beside them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fluxzero.config.sections import ExportConfig
from fluxzero.dtypes import torch_dtype
from fluxzero.train.distributed import TrainingError
from fluxzero.train.export.consolidate import consolidated_checkpoint, export_is_current, lora_is_current

# export.format -> the layout of the adapter file: ComfyUI (and tools on BFL's names) read kohya's layout,
# diffusers and PEFT their own (fluxzero.model.lora_formats)
LORA_LAYOUTS = {"bfl": "kohya", "comfyui": "kohya", "diffusers": "diffusers", "kohya": "kohya"}
LORA_FILE = "lora.safetensors"
LORA_EMA_FILE = "lora_ema.safetensors"  # export.weights: ema


def is_lora_state_dict(sd: dict) -> bool:
    """The consolidated checkpoint holds adapters (LoRA, DoRA or LoKr), not full weights."""
    from fluxzero.model.lora import ADAPTER
    from fluxzero.model.lora_keys import canonical_adapter_name

    return any(canonical_adapter_name(k, ADAPTER) for k in sd)


def lora_layout(layout: str, lcfg) -> str:
    """The adapter file's layout for export.format `layout`: LORA_LAYOUTS' for a LoRA; a DoRA or LoKr exists in
    LyCORIS' layout only (fluxzero.model.adapters), which ComfyUI reads."""
    return LORA_LAYOUTS[layout] if lcfg.type == "lora" else "lycoris"


def lora_settings(tag_dir: Path, saved: dict | None = None):
    """(LoraConfig, ModelConfig or None, the run's base weights path or None) from a checkpoint's run.yaml, or from
    `saved`, that file as consolidate.consolidated_checkpoint read it with the weights."""
    from fluxzero.config import LoraConfig, resolve_model
    from fluxzero.config.runfile import read_saved_run

    if saved is None:
        saved = read_saved_run(
            Path(tag_dir) / "run.yaml",
            "it records the LoRA's rank, alpha and targets: restore it, or export another checkpoint",
            TrainingError,
        )
    if not saved.get("lora"):
        raise TrainingError(
            f"checkpoint {tag_dir} holds LoRA adapters but its run.yaml has no lora section (their "
            f"rank, alpha and targets); restore run.yaml, or export another checkpoint"
        )
    try:
        lcfg = LoraConfig.from_dict(saved["lora"])
        cfg = resolve_model(saved["model"]) if saved.get("model") else None  # a preset name or a whole shape
    except ValueError as e:
        raise TrainingError(f"{Path(tag_dir) / 'run.yaml'}: {e}") from None
    return lcfg, cfg, saved.get("weights")


def canonical_lora(sd: dict) -> dict:
    """The adapter tensors of a consolidated checkpoint under fluxzero.model.lora's canonical names."""
    from fluxzero.model.lora import ADAPTER
    from fluxzero.model.lora_keys import canonical_adapter_name

    return {canonical_adapter_name(k, ADAPTER): v for k, v in sd.items() if canonical_adapter_name(k, ADAPTER)}


def write_lora_export(
    sd: dict,
    tag_dir: Path,
    out: str | Path,
    layout: str = "bfl",
    dtype: str = "bf16",
    merge: bool = False,
    base: str | None = None,
    saved: dict | None = None,
    as_lora_rank: int | None = None,
    max_error: float | None = None,
    report=None,
) -> str:
    """Write the consolidated adapter checkpoint `sd` (of folder `tag_dir`, whose run.yaml is `saved` when it was
    read with it): an adapter file in lora_layout(layout), or with `merge` the full weights in `layout` (bfl,
    comfyui, diffusers): `base` (default: the run's `weights`) with the adapters merged in (in fp32, then rounded
    to `dtype`), or with `as_lora_rank` a plain LoRA of that rank standing for the adapters
    (fluxzero.model.adapters; a DoRA reads `base`), refused when a layer's relative error is above `max_error`;
    `report` receives its error lines."""
    from safetensors import SafetensorError

    from fluxzero.fsutil import remove_stale_temps
    from fluxzero.model import adapters
    from fluxzero.model.layouts import WeightsError
    from fluxzero.model.lora_formats import merge_lora, save_lora
    from fluxzero.model.lora_keys import LoraError
    from fluxzero.model.weights import save_weights

    lcfg, cfg, run_weights = lora_settings(tag_dir, saved)
    lora_sd = canonical_lora(sd)
    name = cfg.name if cfg else None
    remove_stale_temps(out)  # what a killed earlier export of `out` left beside it (its process is gone)
    try:
        if as_lora_rank is not None:
            parts = adapters.trained_parts(lora_sd, lcfg)
            weights = _base_weights(tag_dir, base, run_weights, cfg) if lcfg.type == "dora" else None
            plain = adapters.as_plain_lora(adapters.module_deltas(parts, weights), as_lora_rank, torch_dtype(dtype))
            for line in adapters.error_report(plain) if report else ():
                report(line)
            adapters.check_error(plain, max_error)
            save_lora(out, plain.state_dict, plain.config, layout=LORA_LAYOUTS[layout], base_model=name)
            return str(out)
        if not merge:
            if lcfg.type == "lora":
                save_lora(out, lora_sd, lcfg, layout=LORA_LAYOUTS[layout], base_model=name, dtype=torch_dtype(dtype))
            else:
                adapters.save_lycoris(out, lora_sd, lcfg, base_model=name, dtype=torch_dtype(dtype))
            return str(out)
        weights = _base_weights(tag_dir, base, run_weights, cfg)
        if lcfg.type == "lora":
            merged = merge_lora(weights, lora_sd, lcfg)
        else:
            merged = adapters.merge_deltas(
                weights, adapters.module_deltas(adapters.trained_parts(lora_sd, lcfg), weights)
            )
        save_weights(merged, str(out), layout=layout, dtype=torch_dtype(dtype), cfg=cfg)
    except (WeightsError, LoraError) as e:
        raise TrainingError(f"cannot export {tag_dir}: {e}") from None
    except (OSError, SafetensorError) as e:  # safetensors reports a failed write as SafetensorError
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0][:200]
        raise TrainingError(
            f"cannot write the export {out} ({reason}); choose a writable place with free space"
        ) from None
    return str(out)


def _base_weights(tag_dir: Path, base: str | None, run_weights: str | None, cfg) -> dict:
    """The base weights (fp32, our names) an export merges into or a DoRA rescales: `base`, else the run's."""
    from fluxzero.model.weights import load_weights

    base = base or run_weights
    if not base:
        raise TrainingError(
            f"checkpoint {tag_dir} is an adapter trained on random weights (its run.yaml has no "
            f"weights:), so there is no base weight to merge into or rescale; name the base weights "
            f"file (--base)"
        )
    if base == run_weights and not Path(base).exists():  # the run's own base, moved or read from elsewhere
        raise TrainingError(
            f"cannot export {tag_dir}: its base is the run's weights: {run_weights} (in its "
            f"run.yaml, a path relative to the folder training was launched from), which is "
            f"not found from {os.getcwd()}; run the export from that folder, or pass --base "
            f"with the base weights file"
        )
    return load_weights(base, cfg=cfg, dtype=torch.float32)


def export_lora(
    path: str | Path,
    out: str | Path,
    layout: str = "bfl",
    dtype: str = "bf16",
    merge: bool = False,
    base: str | None = None,
    weights: str = "live",
    as_lora_rank: int | None = None,
    max_error: float | None = None,
    report=None,
) -> str:
    """A LoRA checkpoint (output_dir, checkpoints/ or one tag folder) -> LoRA file, or merged full weights, or
    (as_lora_rank) a plain LoRA of that rank standing for its adapters (write_lora_export).
    weights "ema": the EMA of the adapters the run kept instead of the trained ones."""
    # weights "ema": the EMA shards hold the trainable parameters, the adapters, under the same names
    sd, tag_dir, saved = consolidated_checkpoint(path, weights)
    if not is_lora_state_dict(sd):
        if merge:
            raise TrainingError(
                f"checkpoint {tag_dir} is a full fine-tune, not a LoRA: there is nothing to merge; "
                f"export it without merging"
            )
        if as_lora_rank is not None:
            raise TrainingError(
                f"checkpoint {tag_dir} is a full fine-tune, not an adapter: --as-lora-rank has "
                f"nothing to approximate; export it without --as-lora-rank"
            )
        raise TrainingError(f"checkpoint {tag_dir} is a full fine-tune, not a LoRA; export its full weights")
    return write_lora_export(
        sd,
        tag_dir,
        out,
        layout,
        dtype,
        merge=merge,
        base=base,
        saved=saved,
        as_lora_rank=as_lora_rank,
        max_error=max_error,
        report=report,
    )


def final_lora_export(
    cfg: ExportConfig, output_dir: str, ckpt_dir: Path, rank: int, base: str | None
) -> tuple[str, bool]:
    """A LoRA run's end, on rank 0: output_dir/lora.safetensors in export.format's LoRA layout and, with
    export.merged, the base weights `base` with it merged where a full fine-tune's export goes (export.safetensors
    or export/); export.weights: ema writes lora_ema.safetensors (and export_ema...) from the adapters' EMA.
    Returns (LoRA file, whether anything was written): files already current are left alone."""
    ema = cfg.weights == "ema"
    out = Path(output_dir) / (LORA_EMA_FILE if ema else LORA_FILE)
    name = "export_ema" if ema else "export"
    merged = Path(output_dir) / (name if cfg.format == "diffusers" else f"{name}.safetensors")
    if rank != 0:
        return str(out), False
    latest, written = ckpt_dir / "latest", False
    try:
        lcfg = lora_settings(ckpt_dir / latest.read_text().strip())[0]
    except (OSError, TrainingError):  # export_lora below names what is wrong with the checkpoint
        lcfg = None
    try:
        layout = lora_layout(cfg.format, lcfg) if lcfg else LORA_LAYOUTS[cfg.format]
        if not lora_is_current(out, latest, layout, cfg.dtype):
            export_lora(ckpt_dir, out, cfg.format, cfg.dtype, weights=cfg.weights)
            written = True
        if cfg.merged and not export_is_current(merged, latest, cfg.format, cfg.dtype):
            export_lora(ckpt_dir, merged, cfg.format, cfg.dtype, merge=True, base=base, weights=cfg.weights)
            written = True
    except TrainingError as e:
        raise TrainingError(
            f"{e} (training finished and is saved: `fluxzero export {output_dir} OUT` writes it again)"
        ) from None
    return str(out), written
