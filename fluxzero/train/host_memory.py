"""Host memory: what this machine can give a run, and the refusal of a run that needs more, before the engine
starts (a host short of memory would swap, or meet the OOM killer mid-run or mid-save, instead).

The need is the memory model's (fluxzero.plan: what `fluxzero estimate` and `gen-config --fit` print),
for the run as the trainer is about to build it: streamed block weights, offloaded optimizer state and
parameters with their pinned buffers, an EMA on the CPU, checkpointed activations on the CPU, and the model load,
for every rank on this machine. The processes themselves are already running, so the model's allowance for their
own footprint is not counted again. On a CPU-only run the accelerator's share is host memory too; it is not
counted here.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

HOST_MEMORY_ENV = "FLUXZERO_HOST_MEMORY_GIB"
KEEP_FREE = 0.10  # of what is available: the page cache, the loader's workers and the allocator's slack


def host_available() -> int | None:
    """Bytes of host memory a new allocation may take now: FLUXZERO_HOST_MEMORY_GIB when set (a share of a
    machine others use, or a limit the kernel does not report); else Linux's MemAvailable, lowered to a cgroup v2
    limit's room (memory.max - memory.current) inside a container that has one; None where unknown. A value of
    FLUXZERO_HOST_MEMORY_GIB that is not a positive number raises ValueError in one sentence."""
    text = os.environ.get(HOST_MEMORY_ENV)
    if text is not None:
        try:
            gib = float(text)
        except ValueError:
            gib = math.nan
        if not gib > 0 or math.isinf(gib):
            raise ValueError(
                f"environment variable {HOST_MEMORY_ENV}={text!r} must be a positive number of GiB (the "
                f"host memory this run may use); fix or unset it"
            )
        return int(gib * 2**30)
    available = _meminfo_available()
    room = _cgroup_room()
    if room is not None:
        available = room if available is None else min(available, room)
    return available


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), None without a limit or where unreadable."""
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
        folder = Path("/sys/fs/cgroup") / line.split("::", 1)[1].lstrip("/") if line.startswith("0::") else None
        if folder is None:
            return None
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((folder / "memory.current").read_text().strip()))
    except (OSError, ValueError, IndexError):
        return None


def within(need: int, available: int | None) -> bool:
    """Whether `need` bytes fit `available` with KEEP_FREE of it left (True where the host is unknown)."""
    return available is None or need <= (1 - KEEP_FREE) * available


def _source(available: int) -> str:
    gib = f"{available / 2**30:.1f} GiB"
    return (
        f"{HOST_MEMORY_ENV} gives {gib}" if os.environ.get(HOST_MEMORY_ENV) else f"{gib} is available on this machine"
    )


def run_host_need(
    model_cfg,
    ds: dict,
    v,
    *,
    world: int,
    local_world: int,
    latent_sizes=(),
    txt_len: int = 512,
    ema=None,
    lora=None,
    weights: bool = False,
):
    """(bytes of host memory the run needs on this machine, [(item, bytes)] of it, largest first) from the memory
    model, for the DeepSpeed config `ds` with its view `v` and the run's data, EMA and LoRA (a LoraConfig)."""
    from fluxzero import plan as memory
    from fluxzero.plan.model_states import PROCESS_ITEM
    from fluxzero.plan.spec import PHASES

    fields = memory.run_options_from_ds_config(ds, world, v)
    height = width = 512
    if latent_sizes:  # the largest bucket, in pixels (VAE /8); a size the model cannot take keeps 512
        h, w = max(latent_sizes, key=lambda s: s[0] * s[1])
        if (8 * h) % 16 == 0 and (8 * w) % 16 == 0:
            height, width = 8 * h, 8 * w
    local = max(1, min(local_world, world))
    spec = memory.RunSpec.from_run(
        model_cfg,
        lora=lora,
        ema=ema,
        weights=weights,
        nodes=max(1, world // local),
        gpus_per_node=local,
        height=height,
        width=width,
        txt_len=txt_len,
        **fields,
    )
    est = memory.estimate(spec)
    # Estimate.host_per_rank's rule (the larger of the model load and what training holds) without the allowance
    # for the running process itself
    host = [i for i in est.items if i.where == "host" and i.name != PROCESS_ITEM and i.bytes > 0]
    load = sum(i.bytes for i in host if i.phase == "load")
    running = sum(i.bytes for i in host if i.phase == "resident") + max(
        sum(i.bytes for i in host if i.phase == p) for p in PHASES
    )
    loading = load > running
    items = sorted(((i.name, i.bytes * local) for i in host if (i.phase == "load") == loading), key=lambda x: -x[1])
    need = max(load, running) * local
    return need, items


def host_problem(need: int, items, available: int | None, fixes: list[str]) -> str | None:
    """The sentence refusing a run that needs `need` bytes of host memory (`items`: what, largest first) where
    `available` are, or None when it fits."""
    if within(need, available):
        return None
    what = ", ".join(f"{name} {n / 2**30:.1f} GiB" for name, n in items[:3])
    gib = max(1, math.floor(available / 2**30))
    fix = ", ".join(fixes + [f"or let `fluxzero gen-config --fit --host-memory {gib}` choose a config for it"])
    return (
        f"this run needs {need / 2**30:.1f} GiB of host memory on this machine ({what}), but "
        f"{_source(available)} and {KEEP_FREE:.0%} of it is kept free: {fix}"
    )


def fixes_for(v, ema) -> list[str]:
    """What lowers the host need of a run with DSView `v` and EMA config `ema`, in the words of its settings."""
    out = []
    if isinstance(v.offload_blocks, int) and v.offload_blocks > 0:
        out.append("lower fluxzero.offload_blocks")
    if v.offload_optimizer != "none" or v.offload_param != "none":
        out.append("offload less (zero_optimization.offload_optimizer / offload_param)")
    if ema is not None and ema.device == "cpu":
        out.append("keep the EMA on the GPU (ema.device: gpu)")
    if v.cpu_checkpointing:
        out.append("turn off fluxzero.activation_checkpointing.cpu_checkpointing")
    return out


def check_run(model_cfg, ds: dict, v, **run) -> str | None:
    """run_host_need(model_cfg, ds, v, **run) against host_available(): the refusing sentence, or None (also
    where the memory model does not cover the run: the check must never stop a run it cannot estimate)."""
    try:
        available = host_available()
    except ValueError as e:
        return str(e)
    if available is None:
        return None
    try:
        need, items = run_host_need(model_cfg, ds, v, **run)
    except ValueError:
        return None
    return host_problem(need, items, available, fixes_for(v, run.get("ema")))
