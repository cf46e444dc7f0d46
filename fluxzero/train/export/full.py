"""Export: a checkpoint of any ZeRO stage, consolidated (consolidate.py), as FLUX.1 safetensors (BFL, diffusers,
ComfyUI), and the end-of-run export (a rerun of a finished run writes nothing again); LoRA checkpoints go to
lora.py."""

from __future__ import annotations

from pathlib import Path

from fluxzero.config.sections import ExportConfig
from fluxzero.dtypes import torch_dtype
from fluxzero.train.distributed import TrainingError
from fluxzero.train.export.consolidate import consolidated_checkpoint, export_is_current


def export_checkpoint(
    path: str | Path, out: str | Path, layout: str = "bfl", dtype: str = "bf16", weights: str = "live"
) -> str:
    """Consolidate a checkpoint and write safetensors in the BFL, diffusers or ComfyUI layout.

    weights "ema": the EMA the run kept (its per-rank shards, consolidated on this CPU) replaces the trained
    weights it averages; the others (none, in a full fine-tune) stay the checkpoint's.
    """
    from safetensors import SafetensorError

    from fluxzero.config import resolve_model
    from fluxzero.model.layouts import WeightsError
    from fluxzero.model.weights import save_weights

    sd, tag_dir, saved = consolidated_checkpoint(path, weights)  # run.yaml read with the weights
    from fluxzero.train.export import lora as lora_export

    if lora_export.is_lora_state_dict(sd):  # adapters only: a LoRA file in the layout's LoRA counterpart
        return lora_export.write_lora_export(sd, tag_dir, out, layout, dtype, saved=saved)
    run = tag_dir / "run.yaml"
    cfg = None
    if saved:
        try:
            cfg = resolve_model(saved["model"])
        except (TypeError, KeyError, ValueError) as e:
            raise TrainingError(
                f"{run} does not name a known model ({str(e).splitlines()[0][:200]}); it records "
                f"what the checkpoint trained: repair it, or export another checkpoint"
            ) from None
    from fluxzero.fsutil import remove_stale_temps

    remove_stale_temps(out)  # what a killed earlier export left (its process is gone)
    try:
        save_weights(sd, str(out), layout=layout, dtype=torch_dtype(dtype), cfg=cfg)
    except WeightsError as e:  # the weights do not fit the model run.yaml names, or the layout cannot hold them
        raise TrainingError(f"cannot export {tag_dir}: {e}") from None
    except (OSError, SafetensorError) as e:  # safetensors reports a failed write as SafetensorError
        raise TrainingError(
            f"cannot write the export {out} ({_write_reason(e)}); choose a writable place with free space"
        ) from None
    return str(out)


def _write_reason(e: Exception) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def final_export(
    cfg: ExportConfig, output_dir: str, ckpt_dir: Path, rank: int, *, lora: bool, base: str | None
) -> tuple[str, bool]:
    """Export the final checkpoint on rank 0 as the run file's export: section says; returns (path, whether it
    was written): an export newer than the checkpoint, in the same layout and dtype, is left as it is (a rerun
    of a finished run does nothing). lora: the run trains a LoRA (base: its base weights, for export.merged)."""
    if lora:  # lora.safetensors (and the merged weights with export.merged)
        from fluxzero.train.export.lora import final_lora_export

        return final_lora_export(cfg, output_dir, ckpt_dir, rank, base)
    name = "export_ema" if cfg.weights == "ema" else "export"
    out = Path(output_dir) / (name if cfg.format == "diffusers" else f"{name}.safetensors")
    # The other ranks do not wait for it: an export of FLUX.1-dev can outlast the collectives' timeout
    # (DeepSpeed's default is 10 minutes), and they have nothing left to do. The caller met them at a barrier.
    if rank != 0:
        return str(out), False
    try:
        if export_is_current(out, ckpt_dir / "latest", cfg.format, cfg.dtype):
            return str(out), False
        export_checkpoint(ckpt_dir, out, cfg.format, cfg.dtype, cfg.weights)
    except TrainingError as e:
        raise TrainingError(
            f"{e} (training finished and is saved: `fluxzero export {output_dir} OUT` writes it again)"
        ) from None
    return str(out), True
