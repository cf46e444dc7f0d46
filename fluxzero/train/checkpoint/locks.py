"""Locks of a run's output_dir and of its checkpoint folders, all flock: the kernel drops a lock when its holder
ends, however it ends, so a killed process never leaves a stale one. Rank 0 holds output_dir while a run lasts (a
second run into it is refused); an export holds the step folder it reads shared (pruning skips it meanwhile).
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from fluxzero.train.distributed import TrainingError

READ_LOCK = ".fluxzero-read.lock"  # in a step folder: readers hold it shared, pruning takes it exclusively


@contextlib.contextmanager
def folder_lock(tag_dir: Path, exclusive: bool):
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
    with folder_lock(Path(ckpt_dir) / tag, exclusive=False) as held:
        if not held:
            raise TrainingError(
                f"{tag} was pruned by the running training (checkpoint.keep) before it could be "
                f"read; run export again (it takes the newest checkpoint) or raise checkpoint.keep"
            )
        yield


_held_lock: dict = {}  # output_dir -> open file descriptor holding its lock (rank 0, for the run's duration)
LOCK_FILE = ".fluxzero.lock"


def lock_output_dir(out: Path) -> None:
    """Rank 0 holds an exclusive lock on output_dir while the run lasts: a second run into a folder in use is
    refused in one sentence. flock: the kernel drops it when the process ends, however it ends, so a killed run
    never leaves a stale lock (its lock file may stay, empty of meaning without the lock; a run that ends removes it)."""
    import fcntl

    key = str(out.resolve())
    if key in _held_lock:
        return
    for _ in range(3):
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
            raise TrainingError(
                f"output_dir {out} is in use by another run ({holder}); wait for it to finish or "
                f"choose another output_dir"
            ) from None
        if _is_path_of(fd, out / LOCK_FILE):
            break
        os.close(fd)  # locked a file a finishing run had just removed: lock the one at the path now
    else:
        raise TrainingError(
            f"output_dir {out} is being taken by other runs starting at the same time; start one run per output_dir"
        )
    os.ftruncate(fd, 0)
    os.write(fd, f"process {os.getpid()} on {socket.gethostname()}".encode())
    _held_lock[key] = fd


def _is_path_of(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def release_output_dir() -> None:
    """Give up the output_dir lock this process holds and remove its file (the end of train(); a killed run's
    lock the kernel drops, and its file stays: empty of meaning without the lock)."""
    while _held_lock:
        key, fd = _held_lock.popitem()
        with contextlib.suppress(OSError):  # removed while held, so a run that opens it next sees it is stale
            if _is_path_of(fd, Path(key) / LOCK_FILE):
                os.unlink(Path(key) / LOCK_FILE)
        os.close(fd)
