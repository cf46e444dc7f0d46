"""Where a benchmark result comes from: a UTC timestamp, package versions and the code version (git commit and
whether the tracked files differ from it). sweep.py, bench_blocks.py and ckpt_zero3.py write these into
every result, so a figure can be traced to the code that produced it.

Stdlib only: sweep.py's parent process imports it without torch.
"""

from __future__ import annotations

import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNKNOWN = {"git_commit": "unknown", "git_dirty": "unknown"}


def stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def code_version(root: Path = ROOT) -> dict:
    """{"git_commit": 40 hex digits, "git_dirty": True when tracked files differ from that commit}.

    "unknown" for both where git is missing, or `root` is not the top of a git work tree: the GPU machines get a
    copy of the working tree that may lack .git, and a git repository above that copy must not be named.
    """

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "--show-toplevel", "HEAD")
        lines = head.stdout.split()
        if head.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != Path(root).resolve():
            return dict(UNKNOWN)
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return dict(UNKNOWN)
    return {"git_commit": lines[1], "git_dirty": bool(status.stdout.strip()) if status.returncode == 0 else "unknown"}


def versions(*packages: str) -> dict:
    """Installed versions of `packages` (read from their metadata, nothing is imported), Python's, and the code's."""
    out = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return {**out, **code_version()}
