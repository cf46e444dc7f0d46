"""Checkpoints: save (latest moves only once every rank finished), load, the RNG states each rank saves, and
pruning of old checkpoints. Whether to resume and from which checkpoint is resume.py's decision; what a step folder
must hold is integrity.py's; the locks are locks.py's.

No deepspeed import: the engine object saves and loads its own states.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from fluxzero.fsutil import atomic_write
from fluxzero.train.checkpoint.locks import READ_LOCK, folder_lock
from fluxzero.train.distributed import TrainingError, all_reduce, barrier, peer_stopped


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
    older = [t for t in step_folders(ckpt_dir) if re.fullmatch(r"step_\d{8}", t) and t < latest]
    doomed = older[: max(0, len(older) - (keep - 1))]
    for left in ckpt_dir.glob(".pruning-step_*"):  # what a pruning killed midway left
        shutil.rmtree(left, ignore_errors=True)
    deleted = []
    for tag in doomed:
        gone = ckpt_dir / f".pruning-{tag}"
        try:
            with folder_lock(ckpt_dir / tag, exclusive=True) as held:
                if not held:  # an export is reading it: the next save's pruning tries again
                    continue
                # renamed under the lock: a reader arriving later finds no folder, rather than half of one
                os.rename(ckpt_dir / tag, gone)
            deleted.append(tag)
            shutil.rmtree(gone)
        except OSError as e:
            sys.stderr.write(f"warning: could not delete old checkpoint {ckpt_dir / tag} ({e.strerror or e})\n")
    return deleted


def latest_tag(ckpt_dir: str | Path) -> str | None:
    p = Path(ckpt_dir) / "latest"
    return p.read_text().strip() if p.is_file() else None


def save(
    engine,
    ckpt_dir: str | Path,
    step: int,
    trainer_state: dict,
    run_config_text: str,
    ds: dict,
    keep: int = 0,
    rank_files: dict[str, bytes] | None = None,
) -> str:
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
        engine.save_checkpoint(
            str(ckpt_dir),
            tag=tag,
            client_state={"step": step},
            save_latest=False,
            exclude_frozen_parameters=has_frozen(engine),
        )
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
        raise TrainingError(
            f"could not save checkpoint {tag} in {ckpt_dir} ({reason}); {kept}, "
            f"free disk space or change output_dir and resume"
        ) from None
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
    # on one device: streamed blocks (fluxzero.train.block_stream) keep their weights on the host
    where = params[0].device if params else None
    ok = torch.stack([torch.isfinite(t).all().to(where) for t in params]).all() if params else torch.tensor(True)
    flag = ok.to(dtype=torch.float32).reshape(1)  # on the CPU under parameter offload: all_reduce moves it
    if dist.is_initialized():
        all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def _torch_bytes(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load(engine, ckpt_dir: Path, tag: str) -> dict:
    """Restore checkpoint `tag` (model, optimizer, lr scheduler, this rank's RNG), which resume.decide_resume chose
    and checked on every rank; returns the trainer state (step, loader position)."""
    rank = dist.get_rank()
    state = load_trainer_state(ckpt_dir / tag / f"trainer_state_rank{rank}.pt")
    path, _ = engine.load_checkpoint(
        str(ckpt_dir),
        tag=tag,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_strict=not has_frozen(engine),
    )  # LoRA: no base saved
    if path is None:
        raise TrainingError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    set_rng_state(state["rng"])
    return state


def load_trainer_state(path: Path) -> dict:
    """fluxzero's own per-rank state (step, loader position, RNG states, world size), loaded without running
    code (torch.load weights_only=True; safe_files says why that suffices)."""
    from fluxzero.train.checkpoint import safe_files

    return safe_files.load_trainer_state(path)


def step_folders(ckpt_dir: Path) -> list[str]:
    """The step_* folders of a checkpoints folder, oldest first; [] when it cannot be listed."""
    try:
        return sorted(p.name for p in ckpt_dir.glob("step_*") if p.is_dir())
    except OSError:
        return []
