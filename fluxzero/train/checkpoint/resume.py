"""The ONE resume decision, made on rank 0 and broadcast: start fresh or continue a checkpoint, and which one,
refused in one sentence when the checkpoint cannot continue under this run (another model, training settings,
LoRA, ZeRO stage, precision, scheduler or world size, or damaged files). Also the reader of a checkpoint's saved
run.yaml, and the advice a refusal of `latest` gives.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from fluxzero.config import LoraConfig, TrainConfig
from fluxzero.config.deepspeed.view import DSView, view
from fluxzero.config.models import model_name, same_model
from fluxzero.config.runfile import read_saved_run
from fluxzero.config.user_files import parse_json
from fluxzero.train.checkpoint.integrity import (
    clean_save_files,
    file_problem,
    latest_problem,
    rank_checkpoint_problem,
    stray_files_problem,
)
from fluxzero.train.checkpoint.locks import READ_LOCK, lock_output_dir
from fluxzero.train.checkpoint.store import load_trainer_state, step_folders
from fluxzero.train.distributed import TrainingError, all_ranks_ok, broadcast_objects, write_line

# Settings a resume must keep, because they change what the next steps compute. Others (steps, epochs,
# stop_after, logging, checkpointing, export, attention kernel, workers, the lr schedule) may change: extending
# a run or logging more often is common. micro_batch and grad_accum are the DeepSpeed config's
# (train_micro_batch_size_per_gpu, gradient_accumulation_steps); the others the run file's.
FIXED_ON_RESUME = ("micro_batch", "seed")  # the loader's saved position means other samples under others
DS_KEYS = {"micro_batch": "train_micro_batch_size_per_gpu", "grad_accum": "gradient_accumulation_steps"}
SAME_ON_RESUME = ("data", "grad_accum") + tuple(
    f"flow.{f}"
    for f in ("timestep_sampling", "logit_mean", "logit_std", "shift", "shift_value", "guidance", "mask_floor")
)


def decide_resume(cfg: TrainConfig, v: DSView, ckpt_dir: Path, allow_config_change: bool = False) -> str | None:
    """The checkpoint tag every rank resumes from, or None for a fresh start: ONE decision, made on rank 0.

    Rank 0 alone reads `latest` and judges the checkpoint (another node's view of the disk could differ):
    resume switched off over existing checkpoints, another model, other training settings, another ZeRO
    stage or precision, another world size, a damaged trainer state. Its answer (tag or sentence) is
    broadcast once. Then every rank checks what only it can see (output_dir writable, the files it will read
    present and intact), and all stop with the same sentence if any rank found a problem. Nothing is modified.
    Call before the engine is built: a refusal then costs no model construction.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    decision = [None, None, None]  # [tag to resume or None, error, the names a clean save of it writes]
    if rank == 0:
        try:
            tag, expected = _rank0_decision(cfg, v, ckpt_dir, world, allow_config_change)
            decision = [tag, None, expected]
        except TrainingError as e:
            decision = [None, str(e), None]
    broadcast_objects(decision, src=0)
    tag, error, expected = decision
    if error:
        raise TrainingError(error)
    problem = _writable_problem(Path(cfg.output_dir))
    if problem is None and tag is not None:  # first what this rank sees of the files it reads (names its host)
        problem = rank_checkpoint_problem(v, ckpt_dir, tag, rank, resume_advice(ckpt_dir, tag))
    if problem is None and tag is not None:  # every rank looks: another node may see other files
        problem = stray_files_problem(ckpt_dir / tag, expected, v.load_universal, resume_advice(ckpt_dir, tag))
    all_ranks_ok(problem)
    return tag


def _rank0_decision(
    cfg: TrainConfig, v: DSView, ckpt_dir: Path, world: int, allow: bool
) -> tuple[str | None, list[str] | None]:
    """(tag to resume or None, the file names a clean save of that checkpoint writes)."""
    lock_output_dir(Path(cfg.output_dir))
    tag, error = latest_problem(ckpt_dir, resume_advice)
    if error:
        raise TrainingError(error)
    found = tag is None and newest_complete(ckpt_dir)
    if found:  # `latest` was lost, the step folders were not: never train from 0 over them
        tag = found
        if cfg.checkpoint.resume:
            write_line(
                f"note: {ckpt_dir / 'latest'} is missing; resuming from {tag}, the newest complete checkpoint there"
            )
    if tag is None:
        results = [
            p.name
            for name in ("export", "export_ema")
            for p in (Path(cfg.output_dir) / f"{name}.safetensors", Path(cfg.output_dir) / name)
            if p.exists()
        ]
        results += [n for n in ("lora.safetensors", "lora_ema.safetensors") if (Path(cfg.output_dir) / n).exists()]
        if results:  # a finished run whose checkpoints were deleted: its export and logs would be overwritten
            raise TrainingError(
                f"output_dir {cfg.output_dir} holds the results of an earlier run ({', '.join(results)}"
                f") but no checkpoint to resume; choose another output_dir, or move them away to "
                f"start over there"
            )
        return None, None
    if not cfg.checkpoint.resume:
        raise TrainingError(
            f"{ckpt_dir} already holds checkpoints (latest {tag}) and checkpoint.resume is off; "
            f"choose another output_dir or set checkpoint.resume to true"
        )
    tag_dir = ckpt_dir / tag
    saved = saved_run(tag_dir / "run.yaml")
    model = saved.get("model")
    if model and not same_model(model, cfg.model):  # resolved shapes: a preset equals its mapping spelling
        raise TrainingError(
            f"{tag_dir} is a checkpoint of {model_name(model)} but the run file trains "
            f"{model_name(cfg.model)}; "
            f"choose another output_dir"
        )
    saved_ds = saved_view(tag_dir / "ds_config.json")
    if saved_ds is not None:
        if saved_ds.stage != v.stage:  # DeepSpeed's loader fails with a bare assertion deep inside
            raise TrainingError(
                f"{tag_dir} was written under ZeRO stage {saved_ds.stage} but {cfg.deepspeed} uses stage "
                f"{v.stage}; resume with a stage-{saved_ds.stage} DeepSpeed config, or choose another "
                f"output_dir (DeepSpeed's ds_to_universal converts between layouts)"
            )
        if saved_ds.precision != v.precision:  # DeepSpeed names its files per precision
            raise TrainingError(
                f"{tag_dir} was written in {saved_ds.precision} but {cfg.deepspeed} trains in "
                f"{v.precision}; resume in {saved_ds.precision}, or choose another output_dir"
            )
        if saved_ds.scheduler != v.scheduler:  # DeepSpeed's load fails with a TypeError deep inside
            raise TrainingError(
                f"{tag_dir} was trained with lr scheduler {saved_ds.scheduler or 'none'} but "
                f"{cfg.deepspeed} has {v.scheduler or 'none'}; resume with the checkpoint's "
                f"scheduler, or choose another output_dir"
            )
        # older run.yaml files hold micro_batch and grad_accum themselves; the DeepSpeed config owns them now
        saved = {**saved, "micro_batch": saved_ds.micro_batch, "grad_accum": saved_ds.grad_accum}
    _check_same_adapters(cfg, saved, tag_dir)
    _check_same_training(
        {**cfg.to_dict(), "micro_batch": v.micro_batch, "grad_accum": v.grad_accum}, saved, tag_dir, allow
    )
    state_file = tag_dir / "trainer_state_rank0.pt"
    problem = file_problem(state_file)
    if problem:
        raise TrainingError(
            f"checkpoint {tag_dir} is incomplete or corrupt ({problem}); {resume_advice(ckpt_dir, tag)}"
        )
    try:
        saved_world = load_trainer_state(state_file)["world_size"]
    except Exception:  # intact zip, but not a fluxzero trainer state
        raise TrainingError(
            f"checkpoint {tag_dir} holds no fluxzero trainer state in {state_file.name}; {resume_advice(ckpt_dir, tag)}"
        ) from None
    if saved_world != world:
        raise TrainingError(
            f"checkpoint {tag_dir} was saved by {saved_world} ranks but {world} are running; "
            f"resume with {saved_world} ranks (or convert it with DeepSpeed's ds_to_universal)"
        )
    view_ = saved_ds or v  # an older checkpoint without ds_config.json: the stage and precision of this run
    return tag, sorted(
        clean_save_files(
            view_.stage, view_.precision == "bf16", saved_world, saved.get("ema") if "ema" in saved else None
        )
    )


def newest_complete(ckpt_dir: Path) -> str | None:
    """The newest step folder holding every file its save writes (by name; resume's checks judge the bytes), or
    None. A save killed midway lacks some of them: DeepSpeed's files come first, rank 0's run.yaml and
    ds_config.json after its own, and `latest` only once every rank finished."""
    for tag in reversed(step_folders(ckpt_dir)):
        tag_dir = ckpt_dir / tag
        try:
            v = saved_view(tag_dir / "ds_config.json")
            saved = saved_run(tag_dir / "run.yaml") if (tag_dir / "run.yaml").is_file() else None
            state = tag_dir / "trainer_state_rank0.pt"
            if v is None or saved is None or file_problem(state):
                continue
            world = load_trainer_state(state)["world_size"]
            # an older run.yaml without an ema key: its shards are not required
            names = clean_save_files(v.stage, v.precision == "bf16", world, bool(saved.get("ema"))) - {READ_LOCK}
        except Exception:  # unreadable pieces: not a complete save
            continue
        if all((tag_dir / n).is_file() for n in names):
            return tag
    return None


def _writable_problem(out: Path) -> str | None:
    try:  # fail here, in one sentence, rather than deep inside TensorBoard or DeepSpeed's save
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".fluxzero-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return f"cannot write to output_dir {out} ({e.strerror or e}); choose a writable output_dir"
    return None


def saved_view(path: Path, otherwise: str = "choose another output_dir") -> DSView | None:
    """The view of the DeepSpeed config saved beside a checkpoint (the one reader of a checkpoint's
    ds_config.json); None when absent (an older checkpoint).

    Present but unreadable is one sentence ending in "restore it (...), or <otherwise>": the stage / precision /
    scheduler checks would otherwise be skipped and DeepSpeed's own load fail deep inside on a mismatch."""
    try:
        return view(parse_json(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, AttributeError) as e:
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0][:200] or type(e).__name__
        raise TrainingError(
            f"{path} cannot be read as the DeepSpeed config the checkpoint was written with "
            f"({reason}); restore it (a copy of the config that run used), or {otherwise}"
        ) from None


def saved_run(
    path: Path,
    fix: str = "it records the settings the checkpoint was trained with: repair it, or choose another output_dir",
) -> dict:
    """The run.yaml saved beside a checkpoint ({} when there is none): `path` is the file or its step folder
    (read by config.runfile.read_saved_run, the one reader); `fix` ends the sentence refusing a damaged one."""
    path = Path(path)
    if path.is_dir():
        path = path / "run.yaml"
    return read_saved_run(path, fix, TrainingError)


def _setting(d: dict, key: str):
    """A dotted key of a run-file dict (flow.shift), or None when absent."""
    *parents, leaf = key.split(".")
    for p in parents:
        d = d.get(p) if isinstance(d.get(p), dict) else {}
    return d.get(leaf)


def _check_same_training(now: dict, saved: dict, ckpt: Path, allow_config_change: bool) -> None:
    """Refuse to continue a checkpoint under settings that change what is trained, in one sentence naming
    each field with both values; data, grad_accum and flow options may change with allow_config_change."""

    def changed(keys):
        return [
            k
            for k in keys
            if _setting(saved, k) is not None  # an older run.yaml may lack a key
            and _setting(saved, k) != _setting(now, k)
            and not (k == "data" and _same_path(_setting(saved, k), _setting(now, k)))
        ]

    def name(k):  # the batch sizes are the DeepSpeed config's: name its key, where the user changes it
        return DS_KEYS.get(k, k)

    in_ds = f" in {now.get('deepspeed') or 'the DeepSpeed config'}"
    for keys, fix in (
        (FIXED_ON_RESUME, "resume with the checkpoint's values, or choose another output_dir"),
        (
            () if allow_config_change else SAME_ON_RESUME,
            "resume with the checkpoint's values, choose another output_dir, or add "
            "allow_config_change=true to the command line to continue this checkpoint with the new ones",
        ),
    ):
        if diff := changed(keys):
            where = in_ds if any(k in DS_KEYS for k in diff) else ""
            raise TrainingError(
                f"{ckpt} was trained with {', '.join(f'{name(k)}={_setting(saved, k)}' for k in diff)} but this run "
                f"has {', '.join(f'{name(k)}={_setting(now, k)}' for k in diff)}{where}; {fix}"
            )


# the adapters' kind, shapes and scale; dropout may change
LORA_FIXED_ON_RESUME = ("rank", "alpha", "targets", "init", "type", "factor", "decompose_both")


def _check_same_adapters(cfg: TrainConfig, saved: dict, ckpt: Path) -> None:
    """A LoRA checkpoint holds only its adapters and a full one no adapters: neither continues as the other,
    nor a LoRA under another rank, alpha or targets (lora.weights may change: the checkpoint replaces it)."""
    if not saved:
        return
    was, now = saved.get("lora"), cfg.lora
    if bool(was) != (now is not None):
        raise TrainingError(
            f"{ckpt} is a checkpoint of {'a LoRA' if was else 'a full fine-tune'} but the run file "
            f"trains {'a LoRA' if now else 'the full model (no lora section)'}; "
            f"{'add its lora section back' if was else 'remove the lora section'}, or choose another "
            f"output_dir"
        )
    if was:  # a key a checkpoint's run.yaml lacks was written before it existed: it had the default
        was = {**LoraConfig(rank=1).to_dict(), **was}
    diff = [k for k in LORA_FIXED_ON_RESUME if was and was.get(k) != getattr(now, k)]
    if diff:
        raise TrainingError(
            f"{ckpt} was trained with {', '.join(f'lora.{k}={was.get(k)}' for k in diff)} but this "
            f"run has {', '.join(f'lora.{k}={getattr(now, k)}' for k in diff)}; resume with the "
            f"checkpoint's values, or choose another output_dir"
        )
    # the frozen base is not in a LoRA checkpoint: it is loaded from `weights` again, which must be the same
    if was and "weights" in saved and saved["weights"] != cfg.weights and not _same_path(saved["weights"], cfg.weights):
        raise TrainingError(
            f"{ckpt} is a LoRA trained on weights={saved['weights']} but this run has weights="
            f"{cfg.weights}; a LoRA checkpoint holds only its adapters, so resume on the same base "
            f"weights, or choose another output_dir"
        )


def _same_path(a, b) -> bool:
    """Two spellings of one shard folder (relative and absolute, or through a link)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, TypeError, ValueError):
        return False


def resume_advice(ckpt_dir: Path, tag: str | None) -> str:
    """What to do when `latest` cannot be resumed: point it at the newest complete-looking folder before."""
    earlier = [t for t in step_folders(ckpt_dir) if tag is None or t < tag]
    if earlier:
        return (
            f"write {earlier[-1]} (the newest checkpoint before it) into {ckpt_dir / 'latest'} to resume "
            f"from there, or choose another output_dir"
        )
    return "no earlier checkpoint is there to fall back on: choose another output_dir to start over"
