"""What the whole test run shares: DeepSpeed's JIT-built C++ ops go to a folder of this run, which must stay empty;
child processes get one OpenMP thread (pytest_collection_finish below).

A JIT build costs 55-110 s of CPU (the shared-memory comm op at every DeepSpeed start, FusedAdam without
"torch_adam": true, DeepSpeedCPUAdam for CPU offload) and CI starts from a clean machine, so none may happen:
tests/helpers.py's ONE_RANK and fluxzero.train.engine.join_deepspeed_comm skip the first, tests/helpers.tiny_ds sets
"torch_adam". A test (or a child process: they inherit the variable) that builds one anyway fails the run here.
"""

from __future__ import annotations

import os
import shutil
import tempfile

_EXT_VAR = "TORCH_EXTENSIONS_DIR"


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # a worker of a parallel run: the controller's folder came with os.environ
        return
    config._fluxzero_ext_dir = tempfile.mkdtemp(prefix="fluxzero-test-extensions-")
    config._fluxzero_ext_before = os.environ.get(_EXT_VAR)
    os.environ[_EXT_VAR] = config._fluxzero_ext_dir


def built_ops(folder: str) -> list[str]:
    """The ops torch.utils.cpp_extension built under `folder` (one sub-folder per op, under py3X_cpu/ or not)."""
    found = []
    for root, dirs, files in os.walk(folder):
        if any(f.endswith(".so") or f == "build.ninja" for f in files):
            found.append(os.path.relpath(root, folder))
            dirs.clear()
    return sorted(found)


def pytest_sessionfinish(session, exitstatus):
    folder = getattr(session.config, "_fluxzero_ext_dir", None)
    if folder is None:
        return
    ops = built_ops(folder)
    shutil.rmtree(folder, ignore_errors=True)
    before = session.config._fluxzero_ext_before
    if before is None:
        os.environ.pop(_EXT_VAR, None)
    else:
        os.environ[_EXT_VAR] = before
    if ops:
        writer = session.config.get_terminal_writer()
        writer.line()
        writer.line(
            f"error: DeepSpeed JIT-built {', '.join(ops)} during the tests (55-110 s of CPU each); skip the shm op "
            f"as tests/helpers.py's ONE_RANK does and set \"torch_adam\": true in the test's optimizer params",
            red=True,
            bold=True,
        )
        session.exitstatus = 1


def pytest_collection_finish(session):
    # Every child process of the tests (trainer runs, spawned ranks, one-rank DeepSpeed scripts) gets one OpenMP
    # thread unless it sets its own: flux-tiny's ops are too small to gain from a second thread, and on a shared
    # 2-core machine two spinning threads per process cost CPU time the other processes need. Set after collection,
    # once this process has imported torch with its own default.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # HostAdamW (the cpu-* optimizer modes) steps eagerly in this process and its children unless a test asks for
    # its compiled kernel: Inductor's C++ build costs 10-30 s of CPU a process. FLUXZERO_HOST_OPTIM_EAGER=0 pytest
    # ... runs them all compiled.
    os.environ.setdefault("FLUXZERO_HOST_OPTIM_EAGER", "1")
