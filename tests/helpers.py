"""What the test files share: tiny DeepSpeed dicts, rank environments, runs of launch/train.py, spawned ranks.

Imported as `from tests.helpers import ...` (tests/ and its sub-folders are packages, so a test file anywhere
under tests/ finds it). No torch import at module level: pure tests import this too.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = ROOT / "launch" / "train.py"


def tiny_ds(
    stage: int = 2, *, clipping: float = 1.0, lr: float = 1e-3, weight_decay: float | None = None, **top_level
) -> dict:
    """The DeepSpeed dict of a flux-tiny run on CPU: micro batch 2, no accumulation, ZeRO `stage`.

    torch's AdamW ("torch_adam": no ~95 s FusedAdam JIT build on CPU) and gradient_clipping set explicitly
    (deepspeed 0.19.8 defaults it to 1.0; 0.0 for parity tests); `top_level` keys replace the dict's own.
    """
    params = {"lr": lr, "torch_adam": True}
    if weight_decay is not None:
        params["weight_decay"] = weight_decay
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clipping,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    ds.update(top_level)
    return ds


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_vars(rank: int, world: int, port: int | str) -> dict[str, str]:
    """The variables one rank started without a launcher needs (with none, DeepSpeed tries MPI discovery)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def rank_env(rank: int = 0, world: int = 1, port: int | None = None) -> dict[str, str]:
    """The environment of a launch/train.py child: this checkout importable, one thread, no progress bar; the
    rank variables when world > 1 (ranks started by hand, so a signal can reach one of them)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FLUXZERO_NO_PROGRESS": "1"}
    if world > 1:
        env.update(rank_vars(rank, world, port))
    return env


def train_cmd(run_file, *overrides) -> list[str]:
    return [sys.executable, str(TRAIN_PY), "--config", str(run_file), *overrides]


def train(run_file, *overrides, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """launch/train.py on `run_file` with `key=value` overrides, in one process; returns it finished."""
    return subprocess.run(
        train_cmd(run_file, *overrides), capture_output=True, text=True, env=env or rank_env(), timeout=timeout
    )


def popen_ranks(cmd: list[str], world: int = 2, **popen) -> list[subprocess.Popen]:
    """`world` processes of `cmd` on one free port, each with its rank's rank_env (no launcher), output piped."""
    port = free_port()
    return [
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=rank_env(r, world, port), **popen
        )
        for r in range(world)
    ]


def start_ranks(run_file, *overrides, world: int = 2) -> list[subprocess.Popen]:
    """`world` launch/train.py processes on one free port, started by hand (no launcher), stdout/err piped."""
    return popen_ranks(train_cmd(run_file, *overrides), world)


def train_ok(run_file, *overrides, world: int = 1, timeout: float = 600) -> None:
    """launch/train.py on one rank or `world` ranks; fails the test with the end of stderr unless all exit 0."""
    if world == 1:
        r = train(run_file, *overrides, timeout=timeout)
        assert r.returncode == 0, r.stderr[-3000:]
        return
    procs = start_ranks(run_file, *overrides, world=world)
    errs = [p.communicate(timeout=timeout)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, errs[0][-3000:] + errs[-1][-3000:]


# The first lines of a `python -c` script that calls the trainer (main or train) once per case in one process:
# quiet, no progress bar, the loop imported first (as launch/train.py: it quiets other ranks before DeepSpeed's
# import), one process group for all cases (DeepSpeed caches its groups per process).
TRAINER_CHILD = r"""
import json, os, sys, warnings
warnings.filterwarnings("ignore")
os.environ["FLUXZERO_NO_PROGRESS"] = "1"
from fluxzero.train.loop import main, train
from fluxzero.train.distributed import init_distributed
init_distributed()
"""


def train_all_ok(*runs, timeout: float = 600) -> None:
    """launch/train.py's main() on each `(run_file, *overrides)` of `runs`, in order, in ONE child process (a
    process's start, ~3-4 s of CPU for the imports and DeepSpeed's setup, is more than a few flux-tiny steps);
    fails the test with the child's stderr unless every run returns 0. Not for the run that resumes: a resume is
    a new process in real use, so it gets one here too (train_ok)."""
    script = TRAINER_CHILD + "codes = [main(argv) for argv in json.loads(sys.argv[1])]\nsys.exit(max(codes))\n"
    argv = [["--config", str(run_file), *overrides] for run_file, *overrides in runs]
    r = subprocess.run(
        [sys.executable, "-c", script, json.dumps(argv)],
        capture_output=True,
        text=True,
        env=rank_env(),
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-3000:]


# The first lines of a `python -c` script that runs DeepSpeed as one rank (gloo) in a fresh interpreter: the rank
# variables on a free port unless the caller set them (with none, DeepSpeed tries MPI discovery), the unused
# shared-memory C++ op not built (~60 s on CPU), the process group up. The script's own lines follow it.
ONE_RANK = r"""
import importlib, os, socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
    os.environ.setdefault(k, v)
import torch, deepspeed
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo")
"""


# ---------------------------------------------------------------------------------------------------------
# Ranks spawned by torch.multiprocessing (spawn: fork hung once the parent had run DeepSpeed)
# ---------------------------------------------------------------------------------------------------------
def spawn_ranks(worker, world: int, *args) -> None:
    """worker(rank, world, port, *args) on `world` spawned ranks sharing one free port; returns when all end."""
    import torch.multiprocessing

    torch.multiprocessing.spawn(worker, args=(world, free_port(), *args), nprocs=world, join=True)


def enter_rank(rank: int, world: int, port: int | str, **extra: str) -> None:
    """Inside a spawned rank: its rank variables and one thread, so that the ranks do not fight over 2 cores."""
    os.environ.update(rank_vars(rank, world, port), OMP_NUM_THREADS="1", **extra)


def enter_training_rank(rank: int, world: int, port: int | str) -> None:
    """A spawned rank that trains: enter_rank without progress bars, one torch thread, warnings off, and a rank
    stuck in a collective its peer never joins fails the test after 600 s (with stacks) instead of hanging CI."""
    import faulthandler
    import warnings

    import torch

    faulthandler.dump_traceback_later(600, exit=True)
    enter_rank(rank, world, port, FLUXZERO_NO_PROGRESS="1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")


def close_group(done: bool) -> None:
    """A spawned rank's end: when it finished its work, a barrier first, so that neither rank tears its
    process group down while the other still talks; then the group is destroyed."""
    import torch.distributed as dist

    if dist.is_initialized():
        if done:
            dist.barrier()
        dist.destroy_process_group()


def exit_rank(rank: int, out_file, results: dict) -> None:
    """A spawned rank's last lines, after close_group: rank 0 writes `results` to out_file as JSON, then the process
    ends without interpreter teardown (gloo's threads can abort a finished rank there)."""
    if rank == 0:
        Path(out_file).write_text(json.dumps(results))
    os._exit(0)


def tiny_weights(path: Path, seed: int = 11) -> Path:
    """A flux-tiny model's random initial weights for `seed`, saved at `path` (BFL layout): the one start the
    trainer's runs and their plain-PyTorch reference share."""
    import torch

    from fluxzero.model import build_model
    from fluxzero.model.weights import save_weights

    torch.manual_seed(seed)
    save_weights(build_model("flux-tiny").state_dict(), path)
    return path


def plain_losses(model, opt, data: str, steps: int, seed: int, samples: int = 4) -> list[float]:
    """The reference loop in plain PyTorch: the whole `samples`-sample set of `data` as one batch per step (what
    ranks x micro batch make in the trainer), the trainer's data order and flow noise for (seed, step)."""
    from fluxzero.config import FlowConfig
    from fluxzero.data import build_dataloader
    from fluxzero.train import flow

    loader = build_dataloader(data, micro_batch=samples, rank=0, world_size=1, seed=seed)

    losses = []
    for epoch in range(steps):
        loader.set_epoch(epoch)
        (batch,) = list(loader)
        inputs, target = flow.prepare_batch(batch, FlowConfig(), seed, epoch, guidance_embed=True)
        loss = flow.loss(model(**inputs), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def umask_027():
    """A pytest fixture (import it into the test module): the process umask 027 while the test runs, so a file
    written with the usual permissions is 0640, one a writer forced to 0600 shows, and a kept chmod 644 too."""
    old = os.umask(0o027)
    yield
    os.umask(old)
