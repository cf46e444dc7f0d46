"""Distributed setup and cross-rank error reporting: the process group, barriers, one error line per failure.

torch only: DeepSpeed joins the group this module creates (deepspeed.initialize wraps an initialised
torch.distributed), so the one training module that imports deepspeed stays fluxzero.train.engine.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import sys
import time
import warnings

import torch
import torch.distributed as dist


class TrainingError(RuntimeError):
    """A user-facing training failure; the message is one sentence that says what to change."""


class Interrupted(TrainingError):
    """Ctrl-C (SIGINT), or SIGTERM before training started; the message names the checkpoint a rerun resumes from."""


class Stopped(TrainingError):
    """SIGTERM or SIGUSR1 during training: a checkpoint was saved at the next step boundary, then the run ended."""


def quiet_other_ranks() -> None:
    """Ranks other than 0 print errors only: DeepSpeed warns once per rank ("Setting accelerator to CPU", ...)
    and every rank would repeat rank 0's Python warnings. FLUXZERO_DEBUG=1 keeps them talking. Call before
    DeepSpeed's import, which already warns."""
    if os.environ.get("RANK", "0") != "0" and not os.environ.get("FLUXZERO_DEBUG"):
        logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
        warnings.filterwarnings("ignore")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or create) the process group; returns (rank, world_size, device).

    Works under the deepspeed launcher, torchrun and a plain `python` start: with no launcher the rank
    variables are set for a one-process group here. NCCL on GPUs, gloo on CPU.
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")
    for name in ("deepspeed", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # DeepSpeed 0.19.8 calls collectives that torch 2.13 deprecates, once per step and rank: not actionable
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    # engine.get_lr() before the first step (the trainer logs the lr each step will use) warns every run
    logging.getLogger("DeepSpeed").addFilter(_not_scheduler_not_started)
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # ranks share the cores: do not oversubscribe them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size()))
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
        )
        atexit.register(_destroy_group_at_exit)
    return dist.get_rank(), dist.get_world_size(), device


def local_world_size() -> int:
    """Ranks on this machine (the launchers set LOCAL_WORLD_SIZE; without it, all of WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def _not_scheduler_not_started(record: logging.LogRecord) -> bool:
    return "before it has started" not in record.getMessage()


def _destroy_group_at_exit():
    """Tear down the group this module created, while the interpreter is still whole.

    A gloo group left for interpreter teardown can abort the process (SIGABRT, "terminate called without an
    active exception") after all work is done: its worker threads still hold finished work whose tensors
    are freed after Python is gone. Measured on the 2-core CI machine: 5 of 10 5-rank runs aborted
    without this, 0 of 15 with it. A no-op when the caller destroyed the group already.
    """
    if dist.is_initialized():
        dist.destroy_process_group()


# gloo's words (in a plain RuntimeError) when a peer process went away mid-collective, its sockets with it
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_stopped(e: RuntimeError) -> bool:
    """A collective failed because another rank left (gloo), or its backend says so (NCCL's DistBackendError).
    Not DistNetworkError / DistStoreError: those come from a rendezvous that never formed."""
    backend_error = getattr(dist, "DistBackendError", ())
    return (
        dist.is_initialized()
        and dist.get_world_size() > 1
        and ((backend_error and isinstance(e, backend_error)) or any(m in str(e) for m in PEER_GONE))
    )


def barrier():
    if dist.is_initialized():
        dist.barrier()


def sum_across_ranks(values: torch.Tensor) -> list[float]:
    """The sums of a small 1-D tensor over all ranks, as Python floats (one all_reduce, one host sync)."""
    return all_reduce(values.detach().clone()).tolist()


def all_ranks_ok(problem: str | None) -> None:
    """Every rank passes its own problem (or None); all raise TrainingError with the first one found."""
    first = next((p for p in gather_objects(problem) if p), None)
    if first:
        raise TrainingError(first)


# ---------------------------------------------------------------------------------------------------------
# Collectives the trainer issues itself: ONE rule for the device their tensors travel on
# ---------------------------------------------------------------------------------------------------------
# Every collective of fluxzero's own (finite checks, the resume decision, metrics, stop flags, validation sums,
# EMA reductions, the pretrained-weights broadcast) goes through the functions below, never torch.distributed
# directly. NCCL has no CPU backend, and where a tensor lives depends on settings far from the call site: with
# ZeRO-3 parameter offload the weights, and a flag built from them, are on the CPU while the group is NCCL
# ("No backend type associated with device type cpu"). DeepSpeed's own collectives are DeepSpeed's business.
COMM_CHECK = "FLUXZERO_COMM_CHECK"  # tests only: see _record


def backend_device(backend: str) -> torch.device:
    """The device a backend moves tensors on: the CPU for gloo, this rank's GPU (LOCAL_RANK) for NCCL and the rest."""
    if backend == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def comm_device(group=None) -> torch.device:
    """The device the process group's backend serves, whatever the tensors' own devices (offload included)."""
    return backend_device(dist.get_backend(group))


def placement_problem(device: torch.device, backend: str) -> str | None:
    """Why a tensor on `device` cannot reach a `backend` group (None if it can)."""
    if device.type == "cpu" and backend != "gloo":
        return f"a CPU tensor would reach the {backend} process group, which has no CPU backend"
    return None


def _to_comm(tensor: torch.Tensor, group, op: str) -> torch.Tensor:
    """`tensor` on the group's device (itself when it is there already), checked against the rule."""
    backend = dist.get_backend(group)
    moved = tensor.to(comm_device(group))
    checked = _checked_backend()
    problem = placement_problem(moved.device if checked is None else backend_device(checked), checked or backend)
    if problem:
        raise RuntimeError(f"{problem} ({_caller()}, {op}): place it with fluxzero.train.distributed.comm_device()")
    if checked is not None:
        _record(op)
    return moved


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """torch.distributed.all_reduce in place on `tensor`, reduced on the group's device; returns `tensor`."""
    moved = _to_comm(tensor, group, "all_reduce")
    dist.all_reduce(moved, op=op, group=group)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def reduce(tensor: torch.Tensor, group=None, group_dst: int = 0) -> torch.Tensor:
    """torch.distributed.reduce (sum) into `tensor` of group rank `group_dst`; returns `tensor`."""
    moved = _to_comm(tensor, group, "reduce")
    dist.reduce(moved, group=group, group_dst=group_dst)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def all_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on all), in rank order, on `tensor`'s own device."""
    moved = _to_comm(tensor, group, "all_gather")
    every = [torch.empty_like(moved) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, moved, group=group)
    return [t.to(tensor.device) for t in every]


def _object_device(group, op: str) -> torch.device:
    """Object collectives pickle into a tensor on torch.cuda.current_device() under NCCL: it must be this
    rank's GPU (init_distributed sets it), or two ranks of a node would share one GPU's buffers."""
    device = _to_comm(torch.empty(0), group, op).device
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        raise RuntimeError(
            f"torch.cuda.current_device() is {torch.cuda.current_device()} on the rank of LOCAL_RANK "
            f"{device.index} ({_caller()}, {op}): call torch.cuda.set_device(LOCAL_RANK) first"
        )
    return device


def broadcast_objects(objects: list, src: int = 0, group=None) -> list:
    """torch.distributed.broadcast_object_list of `objects` (in place) from rank `src`; returns `objects`."""
    dist.broadcast_object_list(objects, src=src, group=group, device=_object_device(group, "broadcast_object_list"))
    return objects


def gather_objects(obj, group=None) -> list:
    """Every rank's picklable `obj`, in rank order (torch.distributed.all_gather_object)."""
    _object_device(group, "all_gather_object")
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, obj, group=group)
    return every


# Tests only. FLUXZERO_COMM_CHECK=<file prefix> in a CPU (gloo) run: the helpers above judge every tensor as if
# the group were NCCL (the device they would have chosen must be this rank's GPU) and append "caller op" lines
# to <prefix>.rank<N>, so that a test can see every trainer collective pass through them
# (tests/train/test_comm_rule.py, which also makes a direct torch.distributed call from fluxzero code fail).
def _checked_backend() -> str | None:
    return "nccl" if os.environ.get(COMM_CHECK) else None


def _caller() -> str:
    """module.function of the first frame outside this module."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_globals.get('__name__')}.{frame.f_code.co_qualname}"


def _record(op: str) -> None:
    with open(f"{os.environ[COMM_CHECK]}.rank{dist.get_rank()}", "a") as f:
        f.write(f"{_caller()} {op}\n")


# ---------------------------------------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------------------------------------
STOP_SIGNALS = ("SIGTERM", "SIGUSR1")  # what Slurm (--signal), Kubernetes and the launchers send before a kill
_stop = {"graceful": False, "requested": None, "interrupted": False}


def _interrupt() -> None:
    """Raise KeyboardInterrupt once: Ctrl-C reaches a rank together with the launcher's SIGTERM, and the second
    signal must not cut short the cleanup the first one started."""
    if not _stop["interrupted"]:
        _stop["interrupted"] = True
        raise KeyboardInterrupt


def _on_interrupt(signum, frame):
    _interrupt()


def _on_stop_signal(signum, frame):
    """SIGTERM / SIGUSR1: during the loop, ask for a checkpoint at the next step boundary (every rank learns of
    it in that step's loss all-reduce, so all save the same step); before it, stop at once like Ctrl-C."""
    if not _stop["graceful"]:
        _interrupt()
    else:
        _stop["requested"] = signal.Signals(signum).name


def graceful_stops(on: bool) -> None:
    """From now on (on=True) a stop signal asks for a checkpoint instead of interrupting."""
    _stop["graceful"], _stop["requested"] = on, None


def stop_requested() -> str | None:
    """The stop signal this rank received during the loop (SIGTERM, SIGUSR1), or None."""
    return _stop["requested"]


def install_stop_handlers() -> dict:
    """Install the stop-signal and Ctrl-C handlers (main thread only; elsewhere signals cannot be set); returns
    the old ones."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    _stop["interrupted"] = False
    old = {name: signal.signal(getattr(signal, name), _on_stop_signal) for name in STOP_SIGNALS}
    old["SIGINT"] = signal.signal(signal.SIGINT, _on_interrupt)
    return old


def restore_handlers(old: dict) -> None:
    for name, handler in old.items():
        if handler is not None:
            signal.signal(getattr(signal, name), handler)


def ignore_stop_signals() -> None:
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


# ---------------------------------------------------------------------------------------------------------
# Errors: one line each, once
# ---------------------------------------------------------------------------------------------------------
ERROR_WAIT_S = 5.0  # how long ranks compare their errors before printing (and exiting)
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch.OutOfMemoryError: 2.5+


def current_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def write_line(text: str) -> None:
    """One write call per message, newline included: lines of ranks sharing a terminal never run together."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def write_error(text: str) -> None:
    """write_line for the error that ends this process, also handed to torchrun: torchrun ends its output with a
    summary of the failed ranks whose `traceback :` line is read from the file TORCHELASTIC_ERROR_FILE names, so
    the sentence is the last line of that summary instead of a link to torch's docs."""
    write_line(text)
    _tell_launcher(text)


def _tell_launcher(text: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": text.strip(), "timestamp": int(time.time())}, f)
        except OSError:
            pass  # the sentence is on stderr already


def report(msg: str, call: int) -> None:
    """Print an error once for all the ranks that hit it.

    Every rank posts its message in the process group's key-value store. Rank 0 prints its own; another
    rank prints its message (naming its rank) only when rank 0 did not post the same one within
    ERROR_WAIT_S, i.e. when only some ranks hit it. Rank 0 then keeps the store (which it hosts under the
    deepspeed launcher) up for as long, so the others can still compare.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _report_once(msg, call)
    # the launcher's SIGTERM (sent to every rank once one exits) must not cut the comparison short with a
    # KeyboardInterrupt traceback
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        _report_once(msg, call)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _report_once(msg: str, call: int) -> None:
    rank = current_rank()
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or not dist.is_initialized():
        write_error(f"\n[rank {rank}] error: {msg}" if rank else f"error: {msg}")
        return
    if rank == 0:
        write_error(f"error: {msg}")
    key = f"fluxzero/error/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{call}/"
    shared = False
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{key}{rank}", msg)
        if rank == 0:
            _posted(store, [f"{key}{r}" for r in range(1, world)])
            return
        shared = _posted(store, [f"{key}0"]) and store.get(f"{key}0").decode() == msg
    except (RuntimeError, OSError, ValueError):  # rank 0 is gone (it hosted the store)
        pass
    if rank != 0 and not shared:  # on a line of its own: rank 0's progress bar may hold the current one
        write_error(f"\n[rank {rank}] error: {msg}")
    elif rank != 0:  # printed once, by rank 0; torchrun's summary lists this rank's failure too
        _tell_launcher(f"error: {msg}")


def _posted(store, keys: list[str]) -> bool:
    """Whether all `keys` appear in the store within ERROR_WAIT_S (polled: store.wait logs its timeouts)."""
    deadline = time.monotonic() + ERROR_WAIT_S
    while not store.check(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
