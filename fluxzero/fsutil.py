"""One all-or-nothing write for every file fluxzero produces (configs, shards, checkpoint records), and one for
folders (a diffusers export): readers see the old one or the new one, never part of either.

Pure standard library: the config generator imports it without torch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `data` to a temp file beside `path`, fsync, then rename over it: readers never see a partial file."""
    with atomic_file(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a binary file open on a temp file beside `path`; when the block ends without an error it is
    fsynced and renamed over `path`, otherwise removed (`path` stays as it was). For files written piece by
    piece (a safetensors file one tensor at a time); `atomic_write` for data in hand.

    The new file gets the usual permissions (0666 minus the umask), or those of the file it replaces; a
    symlink is followed, so the file it points at is replaced and the link stays.
    """
    path = os.path.realpath(os.fspath(path))
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike):
    """Yield an empty temp folder beside `path` to write into; when the block ends without an error it replaces
    `path` (the old folder is removed only then), otherwise it is removed and `path` stays as it was.

    The swap is two renames (old folder aside, new one in): a writer killed between them leaves the old folder
    as `.NAME.old-PID`, which remove_stale_temps (called here first) puts back. A symlink is followed.
    """
    path = os.path.realpath(os.fspath(path))
    remove_stale_temps(path)
    parent, name = os.path.split(path)
    tmp, old = (os.path.join(parent, f".{name}.{kind}-{os.getpid()}") for kind in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        if os.path.isdir(path):
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temps(path: str | os.PathLike) -> list[str]:
    """Delete the temp files and folders a killed writer of `path` left beside it (or inside it, for a folder such
    as a diffusers export): `.NAME.tmp-PID` whose process no longer runs on this host. A FLUX.1-dev export's temp
    is ~24 GB, and nothing else would ever remove it. A folder a killed atomic_folder had set aside
    (`.NAME.old-PID`) is put back when `path` is missing, else removed. Returns the names removed or put back."""
    import re

    path = os.path.realpath(os.fspath(path))
    places = [(os.path.dirname(path), re.compile(re.escape(f".{os.path.basename(path)}.") + r"(tmp|old)-(\d+)$"))]
    if os.path.isdir(path):
        places.append((path, re.compile(r"\..+\.(tmp)-(\d+)$")))
    removed = []
    for folder, pattern in places:
        try:
            names = sorted(os.listdir(folder), key=lambda n: ".old-" not in n)  # a set-aside folder first
        except OSError:
            continue
        for name in names:
            m = pattern.fullmatch(name)
            if not m or int(m[2]) == os.getpid() or _running(int(m[2])):
                continue
            stale = os.path.join(folder, name)
            try:
                if m[1] == "old" and not os.path.lexists(path):
                    os.rename(stale, path)
                elif os.path.isdir(stale) and not os.path.islink(stale):
                    shutil.rmtree(stale)
                else:
                    os.unlink(stale)
                removed.append(name)
            except OSError:
                pass
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
