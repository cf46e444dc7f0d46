"""What an export is made from, and whether it is already written: a checkpoint of any ZeRO stage as one fp32
state dict (live weights or the EMA), and the freshness check of a full or LoRA export (written after the
checkpoint, in the layout and dtype asked). full.py (full weights) and lora.py (adapters) share it."""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
from pathlib import Path

import torch

from fluxzero.config.user_files import parse_json
from fluxzero.dtypes import safetensors_code
from fluxzero.train.checkpoint import locks
from fluxzero.train.checkpoint.integrity import clean_save_files, file_problem, latest_problem, stray_files_problem
from fluxzero.train.checkpoint.resume import newest_complete, saved_run, saved_view
from fluxzero.train.checkpoint.store import load_trainer_state, step_folders
from fluxzero.train.distributed import TrainingError, write_line


def resolve_checkpoint(path: str | Path) -> tuple[Path, str]:
    """A checkpoints folder (uses `latest`; without it, the newest complete step folder, as a resume does), the
    run's output_dir, or one tag folder -> (checkpoints folder, tag)."""
    path = Path(path)
    for ckpt_dir in (path, path / "checkpoints"):
        if (ckpt_dir / "latest").is_file():
            tag, error = latest_problem(ckpt_dir, _export_advice)
            if error:
                raise TrainingError(error)
            return ckpt_dir, tag
    if any(path.glob("*model_states.pt")):  # ZeRO-3 folders have one per rank, none named mp_rank_00_...
        return path.parent, path.name
    for ckpt_dir in (path, path / "checkpoints"):
        if step_folders(ckpt_dir):  # `latest` was lost, the step folders were not: the trainer's choice on resume
            tag = newest_complete(ckpt_dir)
            if tag is None:
                raise TrainingError(
                    f"{ckpt_dir} has no 'latest' file and none of its step folders is a complete "
                    f"checkpoint (each save was cut short); export another checkpoint"
                )
            write_line(f"note: {ckpt_dir / 'latest'} is missing; exporting {tag}, the newest complete checkpoint there")
            return ckpt_dir, tag
    if not path.exists() and re.fullmatch(r"step_\d{8}", path.name) and (path.parent / "latest").is_file():
        raise TrainingError(
            f"{path} is gone: pruned by the running training (checkpoint.keep); export the run's "
            f"output_dir (its newest checkpoint) or raise checkpoint.keep"
        )
    raise TrainingError(f"{path} is not a fluxzero checkpoint (no 'latest' file and no DeepSpeed model states)")


def _export_advice(ckpt_dir: Path, tag: str | None) -> str:
    folders = step_folders(ckpt_dir)
    return (
        f"export one of its checkpoint folders instead, such as {ckpt_dir / folders[-1]}"
        if folders
        else "export another checkpoint"
    )


def consolidated_state_dict(path: str | Path, weights: str = "live") -> tuple[dict, Path]:
    """Full fp32 weights from a checkpoint of any ZeRO stage: the fp32 master weights wherever training kept
    them (DeepSpeed's own zero_to_fp32 consolidation for stages 1-3); weights "ema": the run's EMA in place of
    the trained parameters it averages. Returns (state_dict, tag folder)."""
    sd, tag_dir, _ = consolidated_checkpoint(path, weights)
    return sd, tag_dir


def consolidated_checkpoint(path: str | Path, weights: str = "live") -> tuple[dict, Path, dict]:
    """(state_dict, tag folder, its run.yaml as a dict): consolidated_state_dict and the settings saved beside it,
    all read while the checkpoint is held against pruning (an export beside a running training), so the
    settings are the ones of the weights read, never a file pruned in between."""
    ckpt_dir, tag = resolve_checkpoint(path)
    with locks.reading(ckpt_dir, tag):
        sd = _consolidate(ckpt_dir, tag)
        if weights == "ema":
            sd = {**sd, **ema_state_dict(ckpt_dir / tag)}
        saved = saved_run(
            ckpt_dir / tag, "it records what the checkpoint trained: repair it, or export another checkpoint"
        )
    return sd, ckpt_dir / tag, saved


def _consolidate(ckpt_dir: Path, tag: str) -> dict:
    tag_dir = ckpt_dir / tag
    advice = f"export another checkpoint folder of {ckpt_dir}"
    if not any(tag_dir.glob("*model_states.pt")):
        raise TrainingError(
            f"checkpoint {tag_dir} is incomplete or corrupt (it has no DeepSpeed model states file); {advice}"
        )
    layout = _saved_layout(tag_dir, advice)
    if layout is not None:  # DeepSpeed's zero_to_fp32 globs *_model_states.pt and *_optim_states.pt
        problem = stray_files_problem(tag_dir, clean_save_files(*layout), advice=advice)
        if problem:
            raise TrainingError(problem)
    for f in sorted(tag_dir.glob("*.pt")):  # a damaged file would otherwise export wrong weights silently
        problem = file_problem(f)
        if problem:
            raise TrainingError(f"checkpoint {tag_dir} is incomplete or corrupt ({problem}); {advice}")
    try:
        if glob.glob(str(tag_dir / "*zero_pp_rank_*optim_states.pt")):
            sd = zero_fp32_state_dict(str(ckpt_dir), tag)
        else:  # ZeRO stage 0: model and optimizer states in one file
            sd = _stage0_master_weights(
                torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
            )
    except TrainingError:
        raise
    except Exception as e:  # missing shard files: torch and DeepSpeed raise many kinds
        reason = str(e).splitlines()[0].split(". ")[0].rstrip(".") if str(e) else type(e).__name__
        raise TrainingError(f"checkpoint {tag_dir} is incomplete or corrupt ({reason[:200]}); {advice}") from None
    return {k: v.float() for k, v in sd.items()}


def _saved_layout(tag_dir: Path, advice: str) -> tuple[int, bool, int, object] | None:
    """(ZeRO stage, bf16, world size, ema section) a step folder was saved with, from its ds_config.json,
    trainer state and run.yaml; None for an older checkpoint without ds_config.json (then every torch file in
    it is scanned, which is all DeepSpeed's consolidation reads)."""
    v = saved_view(tag_dir / "ds_config.json", otherwise=advice)
    if v is None:
        return None
    world, step = _saved_world_step(tag_dir, advice)
    saved = saved_run(tag_dir)
    return v.stage, v.precision == "bf16", world, saved.get("ema") if "ema" in saved else None


def _saved_world_step(tag_dir: Path, advice: str) -> tuple[int, int]:
    """(world size, step) from the checkpoint's trainer state (scanned before it is loaded, without code)."""
    state_file = tag_dir / "trainer_state_rank0.pt"
    problem = file_problem(state_file)
    if problem:
        raise TrainingError(f"checkpoint {tag_dir} is incomplete or corrupt ({problem}); {advice}")
    try:
        state = load_trainer_state(state_file)
        return int(state["world_size"]), int(state["step"])
    except Exception:  # intact zip, but not a fluxzero trainer state
        raise TrainingError(
            f"checkpoint {tag_dir} holds no fluxzero trainer state in {state_file.name}; {advice}"
        ) from None


def zero_fp32_state_dict(ckpt_dir: str, tag: str) -> dict:
    """The fp32 master weights of a ZeRO-1/2/3 checkpoint, merged from every rank's partition by DeepSpeed's
    own zero_to_fp32 (one CPU process)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # it prints five lines of its own bookkeeping per export; its shard progress bar (stderr) stays
    quiet = contextlib.nullcontext() if os.environ.get("FLUXZERO_DEBUG") else contextlib.redirect_stdout(io.StringIO())
    with quiet:
        return get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag=tag)


def _stage0_master_weights(states: dict) -> dict:
    """The weights of a ZeRO-0 model-states file, taken from the optimizer's fp32 masters where it has them.

    In bf16 or fp16, stage 0 wraps the optimizer in DeepSpeed's FP16 optimizers, which keep fp32 master
    copies and save them into this file: FP16_UnfusedOptimizer (torch and other unfused optimizers) as
    "fp32_groups", one tensor per parameter; FP16_Optimizer (FusedAdam) as "fp32_groups_flat", one flat
    tensor per parameter group. Both follow the order of the parameters fluxzero hands DeepSpeed
    (model.parameters()), which is the module state dict's order without its buffers; each master rounded to
    the module's dtype must equal the saved module weight, which checks the pairing. fp32 runs have no
    wrapper: the module weights are the masters.
    """
    module, opt = states["module"], states.get("optimizer") or {}
    if "fp32_groups" not in opt and "fp32_groups_flat" not in opt:
        return module
    buffers = set(states.get("buffer_names") or ())
    names = [k for k in module if k not in buffers]
    if "fp32_groups" in opt:
        masters = [t for group in opt["fp32_groups"] for t in group]
    else:
        flat = torch.cat([g.reshape(-1) for g in opt["fp32_groups_flat"]])
        sizes = [module[n].numel() for n in names]
        masters = list(flat.split(sizes)) if flat.numel() == sum(sizes) else []
        masters = [m.view(module[n].shape) for m, n in zip(masters, names)]
    if len(masters) != len(names) or not all(
        m.shape == module[n].shape and torch.equal(m.to(module[n].dtype), module[n]) for m, n in zip(masters, names)
    ):
        raise TrainingError(
            "the optimizer's fp32 master weights in this ZeRO-0 checkpoint do not pair up with its "
            "module weights, so the fluxzero trainer did not write it; consolidate it with "
            "DeepSpeed's own tools"
        )
    return {**module, **dict(zip(names, masters))}


def ema_state_dict(tag_dir: Path) -> dict:
    """The consolidated fp32 EMA of a checkpoint folder (name -> full tensor), from its per-rank shard files,
    each checked (step, rank, world size, checksum) before it is used."""
    from fluxzero.train.ema import ShardError, consolidate, read_shard, shard_name

    tag_dir = Path(tag_dir)
    had = saved_run(tag_dir).get("ema")
    if not had and not any(tag_dir.glob("ema_*.safetensors")):
        raise TrainingError(
            f"checkpoint {tag_dir} holds no EMA (the run had no ema: section); export its live weights instead"
        )
    advice = "export its live weights (--weights live), or another checkpoint"
    world, step = _saved_world_step(tag_dir, advice)
    shards = (
        read_shard(tag_dir / shard_name(r), rank=r, world=world, step=step, advice=advice)[0] for r in range(world)
    )
    try:
        ema = consolidate(shards)
        for _ in shards:  # ZeRO-0: one shard holds the whole EMA; the others are checked all the same
            pass
        return ema
    except ShardError as e:
        raise TrainingError(str(e)) from None
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise TrainingError(
            f"the EMA shards of {tag_dir} cannot be read ({str(e).splitlines()[0][:200]}); {advice}"
        ) from None


def _diffusers_files(folder: Path) -> list[Path]:
    """The weight files of a complete diffusers export (a Kontext export's in its transformer/ folder), [] when it
    is incomplete: the index is written last, so shards without it are an export that stopped midway."""
    from fluxzero.model.layouts import DIFFUSERS_INDEX, DIFFUSERS_WEIGHTS

    if (folder / "transformer").is_dir():
        folder = folder / "transformer"
    index = folder / DIFFUSERS_INDEX
    if index.is_file():
        names = sorted(set(parse_json(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
        return files if files and all(f.is_file() for f in files) else []
    single = folder / DIFFUSERS_WEIGHTS
    return [single] if single.is_file() and not list(folder.glob("diffusion_pytorch_model-*")) else []


def _tensor_dtypes(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """({tensor: safetensors dtype ("BF16", "F32")}, metadata) of a safetensors file, without reading tensors;
    ValueError when it is no readable safetensors file."""
    from fluxzero.data.shards import read_header

    entries, meta = read_header(path)
    return {k: v["dtype"] for k, v in entries.items()}, meta


def export_is_current(out: Path, latest: Path, layout: str, dtype: str) -> bool:
    """`out` was written after the checkpoint `latest` names, in this layout and dtype (read from the
    safetensors header: tensor dtypes, and ComfyUI's key prefix; diffusers is the folder)."""
    from fluxzero.model.layouts import COMFY_PREFIX

    try:
        files = _diffusers_files(out) if layout == "diffusers" else [out]
        if not files or any(f.stat().st_mtime < latest.stat().st_mtime for f in files):
            return False
        tensors, _ = _tensor_dtypes(files[0])
        dtypes = set(tensors.values())
        comfy = any(k.startswith(COMFY_PREFIX) for k in tensors)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):  # missing, a folder, not safetensors
        return False
    want = safetensors_code(dtype)
    return dtypes == {want} and comfy == (layout == "comfyui")


def lora_is_current(out: Path, latest: Path, layout: str, dtype: str) -> bool:
    """`out` is a LoRA file written after the checkpoint `latest` names, in this layout and dtype."""
    try:
        if out.stat().st_mtime < latest.stat().st_mtime:
            return False
        tensors, meta = _tensor_dtypes(out)
        dtypes = {d for k, d in tensors.items() if not k.endswith(".alpha")}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False
    return meta.get("fluxzero.format") == layout and dtypes == {safetensors_code(dtype)}
