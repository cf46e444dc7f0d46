"""What the maintained benchmarks share: child processes in their own process group, killed whole on timeout;
JSON-lines rows; provenance; the command-line flags every tool spells the same way.

    import runner                                # from a script in benchmarks/ (its folder is on sys.path)
    p = runner.parser(__doc__)
    runner.add_out(p, "thing.jsonl")             # --out, default $OUT/thing.jsonl ($OUT unset: the current folder)
    runner.add_timeout(p, 300)                   # --timeout, seconds per case
    a = p.parse_args()
    res = runner.run([sys.executable, "x.py"], timeout=a.timeout, log=Path("x.log"))   # rc, timed_out, wall_s, rss_gb
    runner.append_row(a.out, {**row, **runner.provenance_fields("torch")})

Stdlib only: sweep.py's parent process imports it without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # provenance, also when this file is loaded by path
import provenance  # noqa: E402 - needs the line above

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------
# Child processes
# ---------------------------------------------------------------------------------------------------------
def children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (Linux /proc)."""
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                kids.append(int(d.name))
    return kids


def _signal_groups(pgids: list[int], sig) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(pids: list[int], seconds: float) -> None:
    deadline = time.time() + seconds
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.time() < deadline:
        time.sleep(0.1)


def start(cmd: list[str], *, log, env: dict | None = None, cwd: Path | str = ROOT) -> subprocess.Popen:
    """Start `cmd` in a session (and process group) of its own, its output to the open file `log`, so that
    kill_group ends it and whatever it started without touching anything else."""
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(cwd), start_new_session=True)


def kill_group(proc: subprocess.Popen, term_s: float = 0.0) -> None:
    """End a child that start() began, and what it started. torch.distributed.run starts each rank in a session
    of its own, so the child's children are found by id first. With term_s > 0 the group gets SIGTERM and that
    long to stop (torchrun passes it on to its ranks); SIGKILL then goes to the child's group and to each of its
    children's groups. term_s 0: SIGKILL at once (a trainer rank answers SIGTERM by saving a checkpoint)."""
    kids = children(proc.pid)
    if term_s > 0:
        _signal_groups([proc.pid], signal.SIGTERM)
        try:
            proc.wait(term_s)
        except subprocess.TimeoutExpired:
            pass
        _wait_gone(kids, term_s)
    _signal_groups([proc.pid, *kids], signal.SIGKILL)
    proc.wait()
    _wait_gone(kids, 30)  # gone before the caller reads or deletes the folders they were writing


@dataclass
class Result:
    rc: int  # the exit status (negative: the signal that ended it)
    timed_out: bool
    wall_s: float
    rss_gb: float  # peak resident set of the child itself (wait4's ru_maxrss)


def run(cmd: list[str], *, timeout: float, log: Path, env: dict | None = None, cwd: Path | str = ROOT) -> Result:
    """Run `cmd` to its end or to `timeout` seconds, whichever comes first; on timeout its whole process group
    (and its children's) is killed. Output goes to `log`."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = start(cmd, log=out, env=env, cwd=cwd)
        fired = threading.Event()

        def expire() -> None:
            fired.set()
            for pgid in [proc.pid, *children(proc.pid)]:
                _signal_groups([pgid], signal.SIGKILL)

        timer = threading.Timer(timeout, expire)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Result(
        rc=proc.returncode,
        timed_out=fired.is_set(),
        wall_s=time.perf_counter() - t0,
        rss_gb=usage.ru_maxrss * 1024 / 1e9,
    )


def log_tail(path: Path, chars: int) -> str:
    """The last `chars` characters of a log ('' when there is none)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------------------
# Rows and provenance
# ---------------------------------------------------------------------------------------------------------
def append_row(path: Path | str, row: dict) -> None:
    """Append one JSON line to `path` (its folder made if missing), flushed at once: a run cut short keeps every
    row measured before."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def provenance_fields(*packages: str) -> dict:
    """{"date": UTC now, "versions": {python, packages..., git_commit, git_dirty}} for a result."""
    return {"date": provenance.stamp(), "versions": provenance.versions(*packages)}


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------
def out_dir() -> Path:
    """Where results go by default: $OUT, or the current folder."""
    return Path(os.environ.get("OUT", "."))


def parser(doc: str, raw: bool = False) -> argparse.ArgumentParser:
    """A parser whose description is the docstring's first paragraph (raw: the whole docstring, as written)."""
    if raw:
        return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


def add_out(
    p: argparse.ArgumentParser, default: Path | str | None, help: str = "result file", required: bool = False
) -> None:
    """--out. `default`: a name under out_dir() (an absolute path stays itself), or None: no default (with
    required, the flag must be given; without, --out unset means the tool writes no file)."""
    if default is None:
        p.add_argument("--out", type=Path, default=None, required=required, help=help)
    else:
        p.add_argument("--out", type=Path, default=out_dir() / default, help=f"{help} (default: %(default)s)")


def add_timeout(p: argparse.ArgumentParser, default: float | None, help: str = "seconds per case", type=float) -> None:
    """--timeout in seconds; default None: each case's own."""
    p.add_argument("--timeout", type=type, default=default, help=help)
