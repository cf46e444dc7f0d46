"""benchmarks/runner.py: children in their own process group, killed whole on timeout; JSON-lines rows; flags."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import runner  # noqa: E402

# A parent that starts a child in a session of its own (as torch.distributed.run starts its ranks), writes the
# child's pid, then waits: killing the parent's group alone would leave that child running.
PARENT = """
import subprocess, sys, time
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
open(sys.argv[1], "w").write(str(kid.pid))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] if Path(f"/proc/{pid}").exists() else "X"
    return state != "Z"


def _wait_for(path: Path, seconds: float = 30) -> int:
    deadline = time.time() + seconds
    while not (path.exists() and path.read_text()):
        assert time.time() < deadline, "the child never started"
        time.sleep(0.05)
    return int(path.read_text())


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_run_kills_the_group_and_the_children_in_their_own_sessions_on_timeout(tmp_path):
    pidfile = tmp_path / "kid.pid"
    res = runner.run([sys.executable, "-c", PARENT, str(pidfile)], timeout=8, log=tmp_path / "log.txt")
    assert res.timed_out and res.rc == -9 and 8 <= res.wall_s < 60
    kid = _wait_for(pidfile)
    deadline = time.time() + 10
    while _alive(kid) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(kid)


def test_run_reports_exit_code_and_output_without_timeout(tmp_path):
    res = runner.run([sys.executable, "-c", "print('hello'); raise SystemExit(3)"], timeout=60, log=tmp_path / "l")
    assert (res.rc, res.timed_out) == (3, False) and res.rss_gb > 0
    assert runner.log_tail(tmp_path / "l", 100).strip() == "hello" and runner.log_tail(tmp_path / "none", 9) == ""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_kill_group_ends_a_started_child_and_its_session_children(tmp_path):
    pidfile = tmp_path / "kid.pid"
    with open(tmp_path / "log", "w") as log:
        proc = runner.start([sys.executable, "-c", PARENT, str(pidfile)], log=log)
        kid = _wait_for(pidfile)
        runner.kill_group(proc, term_s=0.5)
    assert proc.returncode is not None and not _alive(kid)


def test_append_row_and_the_common_flags(tmp_path, monkeypatch):
    out = tmp_path / "new" / "rows.jsonl"
    runner.append_row(out, {"a": 1})
    runner.append_row(out, {"b": 2, **runner.provenance_fields()})
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0] == {"a": 1} and rows[1]["b"] == 2 and "git_commit" in rows[1]["versions"]
    monkeypatch.setenv("OUT", str(tmp_path))
    p = runner.parser("Title line.\n\nMore.")
    runner.add_out(p, "x.jsonl")
    runner.add_timeout(p, 90)
    a = p.parse_args([])
    assert (a.out, a.timeout, p.description) == (tmp_path / "x.jsonl", 90, "Title line.")
    req = runner.parser("t")
    runner.add_out(req, None, required=True)
    with pytest.raises(SystemExit):
        req.parse_args([])
