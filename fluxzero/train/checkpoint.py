"""Checkpoints: save (latest moves only once every rank finished), ONE resume decision made on rank 0, the
files each rank reads validated before DeepSpeed reads them, pruning of old checkpoints.

No deepspeed import: the engine object saves and loads its own states.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import socket
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from fluxzero.config import TrainConfig
from fluxzero.config.models import model_name, same_model
from fluxzero.config.runfile import read_saved_run
from fluxzero.config.ds_view import DSView, view
from fluxzero.fsutil import atomic_write
from fluxzero.train.distributed import (TrainingError, all_ranks_ok, all_reduce, barrier, broadcast_objects,
                                        peer_stopped)

def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def prune_checkpoints(ckpt_dir: Path, latest: str, keep: int) -> list[str]:
    """Delete step_* folders older than `latest` beyond the newest `keep` (latest counted); returns them.

    Called only after `latest` names a complete checkpoint. A folder that cannot be deleted is reported and
    left: the new checkpoint is saved either way.
    """
    older = [t for t in _step_folders(ckpt_dir) if re.fullmatch(r"step_\d{8}", t) and t < latest]
    doomed = older[:max(0, len(older) - (keep - 1))]
    for left in ckpt_dir.glob(".pruning-step_*"):  # what a pruning killed midway left
        shutil.rmtree(left, ignore_errors=True)
    deleted = []
    for tag in doomed:
        gone = ckpt_dir / f".pruning-{tag}"
        try:
            with _folder_lock(ckpt_dir / tag, exclusive=True) as held:
                if not held:  # an export is reading it: the next save's pruning tries again
                    continue
                # renamed under the lock: a reader arriving later finds no folder, rather than half of one
                os.rename(ckpt_dir / tag, gone)
            deleted.append(tag)
            shutil.rmtree(gone)
        except OSError as e:
            sys.stderr.write(f"warning: could not delete old checkpoint {ckpt_dir / tag} ({e.strerror or e})\n")
    return deleted


READ_LOCK = ".fluxzero-read.lock"  # in a step folder: readers hold it shared, pruning takes it exclusively


@contextlib.contextmanager
def _folder_lock(tag_dir: Path, exclusive: bool):
    """flock on tag_dir's READ_LOCK file; yields whether it is held. Exclusive (pruning) never waits: False
    while a reader holds it. Shared (a reader) waits for a pruning in progress, then yields False when the
    folder is gone (the lock file it waited on was deleted with it). The kernel drops the lock when its holder
    ends, however it ends, so a killed export never keeps a checkpoint forever."""
    import fcntl

    path = tag_dir / READ_LOCK
    try:  # save writes it into every step folder; a checkpoint saved before that gets it now
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:  # the folder itself is gone
        yield False
        return
    except OSError:  # a read-only checkpoint: nothing prunes it, but a shared lock needs only read access
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            yield not exclusive and tag_dir.is_dir()
            return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
        except BlockingIOError:
            yield False
            return
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        yield same
    finally:
        os.close(fd)


@contextlib.contextmanager
def reading(ckpt_dir: Path, tag: str):
    """Hold checkpoint `tag` against pruning while the block reads it (an export beside a running training with
    checkpoint.keep); one sentence when the training pruned it first."""
    with _folder_lock(Path(ckpt_dir) / tag, exclusive=False) as held:
        if not held:
            raise TrainingError(f"{tag} was pruned by the running training (checkpoint.keep) before it could be "
                                f"read; run export again (it takes the newest checkpoint) or raise checkpoint.keep")
        yield


def latest_tag(ckpt_dir: str | Path) -> str | None:
    p = Path(ckpt_dir) / "latest"
    return p.read_text().strip() if p.is_file() else None


def save(engine, ckpt_dir: str | Path, step: int, trainer_state: dict, run_config_text: str,
                    ds: dict, keep: int = 0, rank_files: dict[str, bytes] | None = None) -> str:
    """Save step `step` as tag step_XXXXXXXX; `latest` moves to it only after every rank finished.

    rank_files: further files of this rank (name -> bytes, e.g. its EMA shard), written into the folder
    before `latest` moves.

    A failure while writing (disk full, ...) leaves `latest` on the previous, complete checkpoint. keep > 0:
    once `latest` names the new checkpoint, delete the older ones beyond the newest `keep` (never a newer one).
    """
    ckpt_dir = Path(ckpt_dir)
    rank = dist.get_rank()
    tag = f"step_{step:08d}"
    tag_dir = ckpt_dir / tag
    previous = latest_tag(ckpt_dir)
    if rank == 0:
        if tag_dir.exists() and tag != previous:  # left over from an interrupted save: never the latest
            shutil.rmtree(tag_dir)
        tag_dir.mkdir(parents=True, exist_ok=True)
        (tag_dir / READ_LOCK).touch()  # an export's read lock: there before anyone reads, so reading adds no file
    barrier()
    try:
        # LoRA: the frozen base is left out (it comes from the run's weights again), megabytes not gigabytes
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step}, save_latest=False,
                               exclude_frozen_parameters=has_frozen(engine))
        buf = _torch_bytes({**trainer_state, "rng": rng_state(), "world_size": dist.get_world_size()})
        atomic_write(tag_dir / f"trainer_state_rank{rank}.pt", buf)
        for name, data in (rank_files or {}).items():
            atomic_write(tag_dir / name, data)
        if rank == 0:
            atomic_write(tag_dir / "run.yaml", run_config_text.encode())
            atomic_write(tag_dir / "ds_config.json", json.dumps(ds, indent=2).encode())
        barrier()
        if rank == 0:
            atomic_write(ckpt_dir / "latest", tag.encode())
            if keep:
                prune_checkpoints(ckpt_dir, tag, keep)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write (disk full) as RuntimeError
        if isinstance(e, RuntimeError) and peer_stopped(e):
            raise  # another rank left mid-save (its barrier broke): not a write failure here
        reason = e.strerror if isinstance(e, OSError) and e.strerror else "a write failed; is the disk full?"
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        raise TrainingError(f"could not save checkpoint {tag} in {ckpt_dir} ({reason}); {kept}, "
                            f"free disk space or change output_dir and resume") from None
    barrier()
    return str(tag_dir)


def has_frozen(engine) -> bool:
    """Whether part of the model is frozen (a LoRA run): its checkpoints then hold the trainable part only."""
    return any(not p.requires_grad for p in engine.module.parameters())


@torch.no_grad()
def weights_finite(engine) -> bool:
    """Whether the weights of every rank are finite (a diverged update must never be saved or replace a good
    checkpoint). Each rank checks what it holds (its ZeRO-3 partitions, or the module's parameters below stage 3):
    one pass over the weights and one all_reduce."""
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    ok = torch.stack([torch.isfinite(t).all() for t in params]).all() if params else torch.tensor(True)
    flag = ok.to(dtype=torch.float32).reshape(1)  # on the CPU under parameter offload: all_reduce moves it
    if dist.is_initialized():
        all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def _torch_bytes(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()



# Settings a resume must keep, because they change what the next steps compute. Others (steps, epochs,
# stop_after, logging, checkpointing, export, attention kernel, workers, the lr schedule) may change: extending
# a run or logging more often is common. micro_batch and grad_accum are the DeepSpeed config's
# (train_micro_batch_size_per_gpu, gradient_accumulation_steps); the others the run file's.
FIXED_ON_RESUME = ("micro_batch", "seed")  # the loader's saved position means other samples under others
DS_KEYS = {"micro_batch": "train_micro_batch_size_per_gpu", "grad_accum": "gradient_accumulation_steps"}
SAME_ON_RESUME = ("data", "grad_accum") + tuple(f"flow.{f}" for f in (
    "timestep_sampling", "logit_mean", "logit_std", "shift", "shift_value", "guidance"))


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
        problem = _rank_checkpoint_problem(v, ckpt_dir, tag, rank)
    if problem is None and tag is not None:  # every rank looks: another node may see other files
        problem = stray_files_problem(ckpt_dir / tag, expected, v.load_universal, resume_advice(ckpt_dir, tag))
    all_ranks_ok(problem)
    return tag


def _rank0_decision(cfg: TrainConfig, v: DSView, ckpt_dir: Path, world: int,
                    allow: bool) -> tuple[str | None, list[str] | None]:
    """(tag to resume or None, the file names a clean save of that checkpoint writes)."""
    _lock_output_dir(Path(cfg.output_dir))
    tag, error = _latest_problem(ckpt_dir)
    if error:
        raise TrainingError(error)
    if tag is None:
        results = [p.name for name in ("export", "export_ema")
                   for p in (Path(cfg.output_dir) / f"{name}.safetensors", Path(cfg.output_dir) / name) if p.exists()]
        results += [n for n in ("lora.safetensors", "lora_ema.safetensors") if (Path(cfg.output_dir) / n).exists()]
        if results:  # a finished run whose checkpoints were deleted: its export and logs would be overwritten
            raise TrainingError(f"output_dir {cfg.output_dir} holds the results of an earlier run ({', '.join(results)}"
                                f") but no checkpoint to resume; choose another output_dir, or move them away to "
                                f"start over there")
        return None, None
    if not cfg.checkpoint.resume:
        raise TrainingError(f"{ckpt_dir} already holds checkpoints (latest {tag}) and checkpoint.resume is off; "
                            f"choose another output_dir or set checkpoint.resume to true")
    tag_dir = ckpt_dir / tag
    saved = saved_run(tag_dir / "run.yaml")
    model = saved.get("model")
    if model and not same_model(model, cfg.model):  # resolved shapes: a preset equals its mapping spelling
        raise TrainingError(f"{tag_dir} is a checkpoint of {model_name(model)} but the run file trains "
                            f"{model_name(cfg.model)}; "
                            f"choose another output_dir")
    saved_view = _saved_view(tag_dir / "ds_config.json")
    if saved_view is not None:
        if saved_view.stage != v.stage:  # DeepSpeed's loader fails with a bare assertion deep inside
            raise TrainingError(
                f"{tag_dir} was written under ZeRO stage {saved_view.stage} but {cfg.deepspeed} uses stage "
                f"{v.stage}; resume with a stage-{saved_view.stage} DeepSpeed config, or choose another "
                f"output_dir (DeepSpeed's ds_to_universal converts between layouts)")
        if saved_view.precision != v.precision:  # DeepSpeed names its files per precision
            raise TrainingError(f"{tag_dir} was written in {saved_view.precision} but {cfg.deepspeed} trains in "
                                f"{v.precision}; resume in {saved_view.precision}, or choose another output_dir")
        if saved_view.scheduler != v.scheduler:  # DeepSpeed's load fails with a TypeError deep inside
            raise TrainingError(f"{tag_dir} was trained with lr scheduler {saved_view.scheduler or 'none'} but "
                                f"{cfg.deepspeed} has {v.scheduler or 'none'}; resume with the checkpoint's "
                                f"scheduler, or choose another output_dir")
        # older run.yaml files hold micro_batch and grad_accum themselves; the DeepSpeed config owns them now
        saved = {**saved, "micro_batch": saved_view.micro_batch, "grad_accum": saved_view.grad_accum}
    _check_same_adapters(cfg, saved, tag_dir)
    _check_same_training({**cfg.to_dict(), "micro_batch": v.micro_batch, "grad_accum": v.grad_accum}, saved,
                         tag_dir, allow)
    state_file = tag_dir / "trainer_state_rank0.pt"
    problem = _file_problem(state_file)
    if problem:
        raise TrainingError(f"checkpoint {tag_dir} is incomplete or corrupt ({problem}); "
                            f"{resume_advice(ckpt_dir, tag)}")
    try:
        saved_world = load_trainer_state(state_file)["world_size"]
    except Exception:  # intact zip, but not a fluxzero trainer state
        raise TrainingError(f"checkpoint {tag_dir} holds no fluxzero trainer state in {state_file.name}; "
                            f"{resume_advice(ckpt_dir, tag)}") from None
    if saved_world != world:
        raise TrainingError(f"checkpoint {tag_dir} was saved by {saved_world} ranks but {world} are running; "
                            f"resume with {saved_world} ranks (or convert it with DeepSpeed's ds_to_universal)")
    view_ = saved_view or v  # an older checkpoint without ds_config.json: the stage and precision of this run
    return tag, sorted(clean_save_files(view_.stage, view_.precision == "bf16", saved_world,
                                        saved.get("ema") if "ema" in saved else None))


_held_lock: dict = {}  # output_dir -> open file descriptor holding its lock (rank 0, for the run's duration)
LOCK_FILE = ".fluxzero.lock"


def _lock_output_dir(out: Path) -> None:
    """Rank 0 holds an exclusive lock on output_dir while the run lasts: a second run into a folder in use is
    refused in one sentence. flock: the kernel drops it when the process ends, however it ends, so a killed run
    never leaves a stale lock (the lock file itself may stay; it is empty of meaning without the lock)."""
    import fcntl

    key = str(out.resolve())
    if key in _held_lock:
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return  # unwritable: every rank's writability check says so in its own sentence
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise TrainingError(f"output_dir {out} is in use by another run ({holder}); wait for it to finish or choose "
                            f"another output_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"process {os.getpid()} on {socket.gethostname()}".encode())
    _held_lock[key] = fd


def release_output_dir() -> None:
    """Give up the output_dir lock this process holds (the end of train(); also done by the kernel at exit)."""
    while _held_lock:
        os.close(_held_lock.popitem()[1])


def _writable_problem(out: Path) -> str | None:
    try:  # fail here, in one sentence, rather than deep inside TensorBoard or DeepSpeed's save
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".fluxzero-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return f"cannot write to output_dir {out} ({e.strerror or e}); choose a writable output_dir"
    return None


def _saved_view(path: Path) -> DSView | None:
    """The view of the DeepSpeed config saved beside a checkpoint; None when absent (an older checkpoint).

    Present but unreadable is one sentence: the stage / precision / scheduler checks would otherwise be skipped
    and DeepSpeed's own load fail deep inside on a mismatch."""
    try:
        return view(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, AttributeError) as e:
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0][:200] or type(e).__name__
        raise TrainingError(f"{path} cannot be read as the DeepSpeed config the checkpoint was written with "
                            f"({reason}); restore it (a copy of the config that run used), or choose another "
                            f"output_dir") from None


def saved_run(path: Path) -> dict:
    """The run.yaml saved beside a checkpoint ({} when there is none): `path` is the file or its step folder
    (read by config.runfile.read_saved_run, the one reader)."""
    path = Path(path)
    if path.is_dir():
        path = path / "run.yaml"
    return read_saved_run(path, "it records the settings the checkpoint was trained with: repair it, or choose "
                          "another output_dir", TrainingError)


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
        return [k for k in keys if _setting(saved, k) is not None  # an older run.yaml may lack a key
                and _setting(saved, k) != _setting(now, k)
                and not (k == "data" and _same_path(_setting(saved, k), _setting(now, k)))]

    def name(k):  # the batch sizes are the DeepSpeed config's: name its key, where the user changes it
        return DS_KEYS.get(k, k)

    in_ds = f" in {now.get('deepspeed') or 'the DeepSpeed config'}"
    for keys, fix in ((FIXED_ON_RESUME, "resume with the checkpoint's values, or choose another output_dir"),
                      (() if allow_config_change else SAME_ON_RESUME,
                       "resume with the checkpoint's values, choose another output_dir, or add "
                       "allow_config_change=true to the command line to continue this checkpoint with the new ones")):
        if diff := changed(keys):
            where = in_ds if any(k in DS_KEYS for k in diff) else ""
            raise TrainingError(
                f"{ckpt} was trained with {', '.join(f'{name(k)}={_setting(saved, k)}' for k in diff)} but this run "
                f"has {', '.join(f'{name(k)}={_setting(now, k)}' for k in diff)}{where}; {fix}")


LORA_FIXED_ON_RESUME = ("rank", "alpha", "targets", "init")  # the adapters' shapes and scale; dropout may change


def _check_same_adapters(cfg: TrainConfig, saved: dict, ckpt: Path) -> None:
    """A LoRA checkpoint holds only its adapters and a full one no adapters: neither continues as the other,
    nor a LoRA under another rank, alpha or targets (lora.weights may change: the checkpoint replaces it)."""
    if not saved:
        return
    was, now = saved.get("lora"), cfg.lora
    if bool(was) != (now is not None):
        raise TrainingError(f"{ckpt} is a checkpoint of {'a LoRA' if was else 'a full fine-tune'} but the run file "
                            f"trains {'a LoRA' if now else 'the full model (no lora section)'}; "
                            f"{'add its lora section back' if was else 'remove the lora section'}, or choose another "
                            f"output_dir")
    diff = [k for k in LORA_FIXED_ON_RESUME if was and was.get(k) != getattr(now, k)]
    if diff:
        raise TrainingError(f"{ckpt} was trained with {', '.join(f'lora.{k}={was.get(k)}' for k in diff)} but this "
                            f"run has {', '.join(f'lora.{k}={getattr(now, k)}' for k in diff)}; resume with the "
                            f"checkpoint's values, or choose another output_dir")
    # the frozen base is not in a LoRA checkpoint: it is loaded from `weights` again, which must be the same
    if was and "weights" in saved and saved["weights"] != cfg.weights and not _same_path(saved["weights"], cfg.weights):
        raise TrainingError(f"{ckpt} is a LoRA trained on weights={saved['weights']} but this run has weights="
                            f"{cfg.weights}; a LoRA checkpoint holds only its adapters, so resume on the same base "
                            f"weights, or choose another output_dir")


def _same_path(a, b) -> bool:
    """Two spellings of one shard folder (relative and absolute, or through a link)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, TypeError, ValueError):
        return False


def load(engine, ckpt_dir: Path, tag: str) -> dict:
    """Restore checkpoint `tag` (model, optimizer, lr scheduler, this rank's RNG), which decide_resume chose and
    checked on every rank; returns the trainer state (step, loader position)."""
    rank = dist.get_rank()
    state = load_trainer_state(ckpt_dir / tag / f"trainer_state_rank{rank}.pt")
    path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True,
                                     load_lr_scheduler_states=True,
                                     load_module_strict=not has_frozen(engine))  # LoRA: no base saved
    if path is None:
        raise TrainingError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    set_rng_state(state["rng"])
    return state


def load_trainer_state(path: Path) -> dict:
    """fluxzero's own per-rank state (step, loader position, RNG states, world size), loaded without running
    code (torch.load weights_only=True; safe_files says why that suffices)."""
    from fluxzero.train import safe_files

    return safe_files.load_trainer_state(path)


def checkpoint_files(stage: int, bf16: bool, rank: int) -> tuple[list[str], list[str]]:
    """(files only `rank` reads, files every rank reads) of a fluxzero checkpoint folder.

    DeepSpeed 0.19.8's names (engine._get_ckpt_name, _get_rank_zero_ckpt_name) without model parallelism
    (mp rank 00): under ZeRO-3 each rank has its own model states, below it all ranks read one file; from
    stage 1 on each rank has its own optimizer partition ("bf16_" prefix in bf16), at stage 0 the optimizer
    lives in the model states file.
    """
    own = [f"trainer_state_rank{rank}.pt"]
    shared = []
    if stage == 3:
        own.append(f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    else:
        shared.append("mp_rank_00_model_states.pt")
    if stage >= 1:
        own.append(f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return own, shared


FLUXZERO_FILES = ("run.yaml", "ds_config.json")  # rank 0's, besides each rank's trainer state and EMA shard


def clean_save_files(stage: int, bf16: bool, world: int, ema) -> set[str]:
    """Every name a fluxzero save writes into a step folder at this ZeRO stage, precision and world size.

    ema: whether the run had an ema: section (its shards); None when unknown (an older run.yaml), which
    allows them. Measured with real 2-rank saves of flux-tiny at ZeRO 0, 1, 2, 3, 2 and 3 with CPU offload,
    fp32 and bf16, full fine-tunes and LoRA + EMA: the folder holds exactly these names (tests/train/
    test_train_reliability.py's test_a_clean_save_writes_exactly_the_expected_files); DeepSpeed's recovery
    scripts (zero_to_fp32.py, zero_to_torch.py) go one folder up, into checkpoints/.
    """
    from fluxzero.train.ema import shard_name

    names = {*FLUXZERO_FILES, READ_LOCK}
    for rank in range(world):
        own, shared = checkpoint_files(stage, bf16, rank)
        names.update(own, shared)
        if ema or ema is None:
            names.add(shard_name(rank))
    return names


def stray_files_problem(tag_dir: Path, expected, universal: bool = False, advice: str = "") -> str | None:
    """The sentence refusing a step folder that holds a name no clean save writes, or None.

    DeepSpeed's loader finds its files by wildcard (mp_rank_*_model_states.pt, zero_pp_rank_N_mp_rank_*_...)
    and unpickles the first match in sorted order, so a torch file planted beside the intact ones would run its
    code whatever fluxzero checks of the files it expects: nothing in such a folder is loaded. A universal
    checkpoint (DeepSpeed's ds_to_universal, checkpoint.load_universal) has its own tree: there every torch
    file in it, at any depth, must pass the pickle scan instead.
    """
    tag_dir = Path(tag_dir)
    if universal:
        for f in sorted(p for p in tag_dir.rglob("*") if p.is_file() and _loadable(p)):
            if problem := _file_problem(f, crc=False):
                return f"checkpoint {tag_dir} is incomplete or corrupt ({problem}); {advice}"
        return None
    try:
        names = sorted(os.listdir(tag_dir))
    except OSError as e:
        return f"cannot list checkpoint {tag_dir} ({e.strerror or e}); {advice}"
    stray = [n for n in names if n not in set(expected) | {READ_LOCK}]  # older checkpoints lack the lock file
    if not stray:
        return None
    more = f" (and {len(stray) - 1} more)" if len(stray) > 1 else ""
    return (f"checkpoint {tag_dir} holds {stray[0]}{more}, which no fluxzero save of this run writes (DeepSpeed's "
            f"loader picks its files by name pattern and would unpickle it), so nothing in it is loaded; "
            f"remove it if you know what it is, otherwise {advice or 'use another checkpoint'}")


def _loadable(path: Path) -> bool:
    """Whether torch.load could be handed `path`: a .pt name, or a zip archive or pickle by its first bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return True  # unreadable: the scan says so
    return path.suffix == ".pt" or head == b"PK\x03\x04" or head[:1] == b"\x80"


def _step_folders(ckpt_dir: Path) -> list[str]:
    try:
        return sorted(p.name for p in ckpt_dir.glob("step_*") if p.is_dir())
    except OSError:
        return []


def resume_advice(ckpt_dir: Path, tag: str | None) -> str:
    """What to do when `latest` cannot be resumed: point it at the newest complete-looking folder before."""
    earlier = [t for t in _step_folders(ckpt_dir) if tag is None or t < tag]
    if earlier:
        return (f"write {earlier[-1]} (the newest checkpoint before it) into {ckpt_dir / 'latest'} to resume "
                f"from there, or choose another output_dir")
    return "no earlier checkpoint is there to fall back on: choose another output_dir to start over"


def _export_advice(ckpt_dir: Path, tag: str | None) -> str:
    folders = _step_folders(ckpt_dir)
    return (f"export one of its checkpoint folders instead, such as {ckpt_dir / folders[-1]}" if folders
            else "export another checkpoint")


def _latest_problem(ckpt_dir: Path, advice=resume_advice) -> tuple[str | None, str | None]:
    """(tag named by `latest`, None), (None, None) without `latest`, or (None, what is wrong with it)."""
    latest = ckpt_dir / "latest"
    if not latest.is_file():
        return None, None
    try:
        tag = latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"cannot read {latest} ({getattr(e, 'strerror', None) or e}); {advice(ckpt_dir, None)}"
    if not tag:
        return None, f"{latest} is empty; {advice(ckpt_dir, None)}"
    if "/" in tag or "\\" in tag or not (ckpt_dir / tag).is_dir():
        return None, f"{latest} names {tag!r}, which is not a folder in {ckpt_dir}; {advice(ckpt_dir, None)}"
    return tag, None


def _rank_checkpoint_problem(v: DSView, ckpt_dir: Path, tag: str, rank: int) -> str | None:
    """This rank's view of the checkpoint rank 0 chose: the folder, then the files it reads, then their CRCs.

    The files every rank reads (the model states below ZeRO-3) are CRC-checked once per node (local rank 0),
    the rest by the rank that reads them. CRC-checking reads the whole file; measured ~0.4 s/GB on one core
    from the page cache (torch.load of the same file: ~0.6 s/GB).
    """
    tag_dir = ckpt_dir / tag
    if not tag_dir.is_dir():
        return (f"rank {rank} (host {socket.gethostname()}) cannot see {tag_dir}, the checkpoint rank 0 resumes "
                f"from; output_dir must be on a filesystem all nodes share (or hold identical copies on every "
                f"node)")
    own, shared = checkpoint_files(v.stage, v.precision == "bf16", rank)
    if v.load_universal:  # DeepSpeed reads the universal layout itself
        own, shared = own[:1], []
    mine = own + (shared if int(os.environ.get("LOCAL_RANK", "0")) == 0 else [])
    for name in own + shared:
        problem = _file_problem(tag_dir / name, crc=name in mine)
        if problem:
            return f"checkpoint {tag_dir} is incomplete or corrupt ({problem}); {resume_advice(ckpt_dir, tag)}"
    return None


def _file_problem(path: Path, crc: bool = True) -> str | None:
    """What makes a torch.save file unusable, in a few words (missing, truncated, overwritten), or None.

    torch.save writes a zip archive with a CRC-32 for every record, which torch.load never checks: a file
    overwritten in place with its size unchanged loads silently. testzip() reads every record and compares.
    """
    if not path.is_file():
        return f"{path.name} is missing"
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip() if crc else None
    except Exception:  # zipfile raises BadZipFile, EOFError, struct.error, ... for damaged archives
        return f"{path.name} is not a complete torch file"
    if bad:
        return f"{path.name} fails its CRC-32 check in {bad}"
    from fluxzero.train import safe_files

    # before anything unpickles it: torch.load and DeepSpeed's loads would run code that a crafted file names
    try:
        bad = [g for g in safe_files.unsafe_globals(path) if g not in safe_files.ALLOWED_GLOBALS]
    except (OSError, ValueError):
        return f"{path.name} is not a torch file fluxzero can read"
    if bad:
        return (f"{path.name} holds Python code references ({', '.join(bad[:3])}), which no fluxzero or DeepSpeed "
                f"checkpoint holds, so it is not loaded")
    return None


def _unreadable_files(tag_dir: Path) -> list[str]:
    """Names of the checkpoint folder's torch files that are truncated, overwritten or otherwise damaged."""
    return [f.name for f in sorted(Path(tag_dir).glob("*.pt")) if _file_problem(f)]

