"""One all-or-nothing file write for every file fluxzero produces (configs, shards, checkpoint records).

Pure standard library: the config generator imports it without torch.
"""
from __future__ import annotations

import os
import stat


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `data` to a temp file beside `path`, fsync, then rename over it: readers never see a partial file.

    The new file gets the usual permissions (0666 minus the umask), or those of the file it replaces; a
    symlink is followed, so the file it points at is replaced and the link stays.
    """
    path = os.path.realpath(os.fspath(path))
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    if isinstance(data, str):
        data = data.encode("utf-8")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def remove_stale_temps(path: str | os.PathLike) -> list[str]:
    """Delete the temp files a killed writer of `path` left beside it (or inside it, for a folder such as a
    diffusers export): `.NAME.tmp-PID` whose process no longer runs on this host. A FLUX.1-dev export's temp is
    ~24 GB, and nothing else would ever remove it. Returns the names removed."""
    import re

    path = os.path.realpath(os.fspath(path))
    places = [(os.path.dirname(path), re.compile(re.escape(f".{os.path.basename(path)}.tmp-") + r"(\d+)$"))]
    if os.path.isdir(path):
        places.append((path, re.compile(r"\..+\.tmp-(\d+)$")))
    removed = []
    for folder, pattern in places:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            m = pattern.fullmatch(name)
            if not m or int(m[1]) == os.getpid() or _running(int(m[1])):
                continue
            try:
                os.unlink(os.path.join(folder, name))
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
