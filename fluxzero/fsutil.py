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
