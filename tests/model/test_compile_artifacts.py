"""Compiled code kept beside the checkpoints (fluxzero.model.compile.save_artifacts / load_artifacts, torch's
portable "mega-cache"), so that a resume on a machine without the first one's compile cache reads what the first
run compiled. Each process below starts with an empty Inductor cache folder of its own: a cache hit there can only
come from the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import json, sys, torch
    from torch._dynamo.utils import counters
    from fluxzero.model.compile import load_artifacts, save_artifacts
    mode, path = sys.argv[1], sys.argv[2]
    out, loaded = {}, frozenset()
    if mode != "save":  # one save a process (save_artifacts): each case is a child of its own
        out["file_bytes"], loaded = load_artifacts(path)
        out["loaded"] = len(loaded)
    f = torch.compile(lambda x: (x.sin() * 2 + x.cos()).sum(), backend="inductor")
    g = torch.compile(lambda x: (x.tanh() * 5 - x.exp()).mean(), backend="inductor")
    f(torch.randn(64))
    if mode != "f-only":
        g(torch.randn(64))
    out["counters"] = dict(counters["inductor"])
    saved = save_artifacts(path, loaded)
    out["saved"] = None if saved is None else len(saved)
    print("RESULT " + json.dumps(out))
""")


def _child(tmp_path: Path, mode: str, cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache), "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(tmp_path / "compile_cache.bin")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])


@pytest.mark.slow
def test_a_fresh_process_reads_what_an_earlier_one_compiled(tmp_path):
    saved = _child(tmp_path, "save", "cache-a")
    assert saved["counters"].get("fxgraph_cache_miss") == 2 and saved["saved"] >= 2  # f and g, from scratch
    size = (tmp_path / "compile_cache.bin").stat().st_size
    assert not list(tmp_path.glob(".*.tmp"))  # written whole, then renamed
    # another empty cache folder: a hit can only come from the file. f alone used: writing would drop g's
    # entries, so the file stays as it was
    partial = _child(tmp_path, "f-only", "cache-b")
    assert partial["file_bytes"] == size and partial["loaded"] == saved["saved"]
    assert partial["counters"].get("fxgraph_cache_hit") == 1 and not partial["counters"].get("fxgraph_cache_miss")
    assert partial["saved"] is None and (tmp_path / "compile_cache.bin").stat().st_size == size
    # f and g both used: all of it is written again (every entry: the hits count as this process's own)
    full = _child(tmp_path, "full", "cache-c")
    assert full["counters"].get("fxgraph_cache_hit") == 2 and full["saved"] == saved["saved"]


def test_no_file_loads_nothing(tmp_path):
    from fluxzero.model.compile import load_artifacts

    assert load_artifacts(tmp_path / "compile_cache.bin") is None


def test_a_file_torch_cannot_read_is_refused_in_one_sentence(tmp_path):
    from fluxzero.model.compile import load_artifacts

    (tmp_path / "compile_cache.bin").write_bytes(b"not a cache")
    with pytest.raises(ValueError, match="not a compile cache this torch can read"):
        load_artifacts(tmp_path / "compile_cache.bin")
