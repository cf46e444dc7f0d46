"""The DeepSpeed side of training (the only training module that imports deepspeed).

Distributed init, model construction (partitioned under ZeRO-3), pretrained weight load into the
partitioned model, activation checkpointing applied from outside, checkpoint save / load, export.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import glob
import importlib
import io
import json
import logging
import os
import random
import re
import shutil
import socket
import sys
import warnings
import zipfile
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from fluxzero.config import ds_config
from fluxzero.config import ModelConfig, TrainConfig
from fluxzero.fsutil import atomic_write


class TrainingError(RuntimeError):
    """A user-facing training failure; the message is one sentence that says what to change."""


# ---------------------------------------------------------------------------------------------------------
# Distributed setup
# ---------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or create) the process group; returns (rank, world_size, device).

    Works under the deepspeed launcher, torchrun and a plain `python` start: with no launcher the rank
    variables are set for a one-process group here, so DeepSpeed does not try MPI discovery.
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
    accel = get_accelerator()
    local_rank = int(os.environ["LOCAL_RANK"])
    if accel.device_name() == "cpu":
        # DeepSpeed compiles a shared-memory allreduce op (~60 s) at every CPU start; training uses gloo.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        if "OMP_NUM_THREADS" not in os.environ:  # ranks share the cores: do not oversubscribe them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    else:
        accel.set_device(local_rank)
    if not dist.is_initialized():
        deepspeed.init_distributed(verbose=False)
        atexit.register(_destroy_group_at_exit)
    device = torch.device(accel.device_name(local_rank) if accel.device_name() != "cpu" else "cpu")
    return dist.get_rank(), dist.get_world_size(), device


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
    return (dist.is_initialized() and dist.get_world_size() > 1
            and ((backend_error and isinstance(e, backend_error)) or any(m in str(e) for m in PEER_GONE)))


def barrier():
    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed config
# ---------------------------------------------------------------------------------------------------------
def load_ds_config(path: str, cfg: TrainConfig, world_size: int) -> tuple[dict, dict]:
    """Read the DeepSpeed JSON, check it against the run file, fill batch sizes, split off "fluxzero".

    Returns (deepspeed_dict, fluxzero_section).
    """
    try:
        with open(path) as f:
            ds = json.load(f)
    except FileNotFoundError:
        raise TrainingError(f"DeepSpeed config {path} does not exist; write one with `fluxzero gen-config`") from None
    except json.JSONDecodeError as e:
        raise TrainingError(f"DeepSpeed config {path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise TrainingError(f"DeepSpeed config {path} is not a text file; point deepspeed at the JSON from "
                            f"`fluxzero gen-config`") from None
    except OSError as e:
        raise TrainingError(f"cannot read DeepSpeed config {path} ({e.strerror or e}); point deepspeed at a "
                            f"readable JSON file") from None
    if not isinstance(ds, dict):
        raise TrainingError(f"DeepSpeed config {path} must be a JSON object ({{...}}), got {type(ds).__name__}; "
                            f"write one with `fluxzero gen-config`")
    ours = ds.pop("fluxzero", None)
    ours = {} if ours is None else ours
    if not isinstance(ours, dict):
        raise TrainingError(f"DeepSpeed config {path}: fluxzero must be a JSON object like "
                            f'{{"activation_checkpointing": {{"every_k_blocks": 1}}}}, got {json.dumps(ours)}')
    comp = ours.get("compile", {}) or {}
    if not isinstance(comp, dict) or not isinstance(comp.get("blocks", False), bool):
        raise TrainingError(f"DeepSpeed config {path}: fluxzero.compile must be an object like "
                            f'{{"blocks": true, "mode": "default"}}, got {json.dumps(comp)}')
    if comp.get("mode", "default") not in ds_config.COMPILE_MODES:
        raise TrainingError(f"DeepSpeed config {path}: fluxzero.compile.mode must be one of "
                            f"{', '.join(ds_config.COMPILE_MODES)}, got {comp.get('mode')!r}")
    if comp.get("backend", "inductor") not in ds_config.COMPILE_BACKENDS:
        raise TrainingError(f"DeepSpeed config {path}: fluxzero.compile.backend must be one of "
                            f"{', '.join(ds_config.COMPILE_BACKENDS)}, got {comp.get('backend')!r}")
    _check_ds_config(path, ds, ours)
    try:
        cfg.check_deepspeed(ds, world_size, source=f"DeepSpeed config {path}")
    except ValueError as e:
        raise TrainingError(str(e)) from None
    accel = get_accelerator()
    if (ds.get("fp16") or {}).get("enabled") and not accel.is_fp16_supported():
        raise TrainingError(f"DeepSpeed config {path} trains in fp16, which DeepSpeed's {accel.device_name()} "
                            f"accelerator does not support; use bf16 or fp32 here (`fluxzero gen-config "
                            f"--precision`) and in the run file's precision")
    ds["train_micro_batch_size_per_gpu"] = cfg.micro_batch
    ds["gradient_accumulation_steps"] = cfg.grad_accum
    ds["train_batch_size"] = cfg.global_batch(world_size)
    return ds, ours


def _check_ds_config(path: str, ds: dict, ours: dict) -> None:
    """Refuse what `fluxzero check-config` reports (ds_config.check), with its first finding.

    DeepSpeed accepts some mistakes silently (a misspelled top-level key such as zero_optimisation trains
    at ZeRO-0) and fails on others deep inside, with a traceback. Batch sizes missing here are filled from
    the run file afterwards, so they count as "auto". The world size is left out on purpose: with the batch
    sizes fixed by the run file, every world-size inconsistency is one that TrainConfig.check_deepspeed
    (called next) reports too, and its sentence also says how many ranks would fit.
    gradient_clipping must be set, as check-config says: deepspeed 0.19.8 silently clips at 1.0 without it.
    """
    problems = ds_config.check({**dict.fromkeys(ds_config.BATCH_KEYS, "auto"), **ds, "fluxzero": ours}, None)
    if problems:
        more = f" ({len(problems) - 1} more; run `fluxzero check-config {path}`)" if len(problems) > 1 else ""
        raise TrainingError(f"DeepSpeed config {path}: {problems[0]}{more}")


def zero_stage(ds: dict) -> int:
    return int((ds.get("zero_optimization") or {}).get("stage", 0))


def param_dtype(ds: dict) -> torch.dtype:
    if (ds.get("bf16") or {}).get("enabled"):
        return torch.bfloat16
    if (ds.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


# ---------------------------------------------------------------------------------------------------------
# Model under ZeRO
# ---------------------------------------------------------------------------------------------------------
def build_engine(cfg: TrainConfig, ds: dict, ours: dict, model_cfg: ModelConfig, device: torch.device):
    """Model (partitioned at construction under ZeRO-3), weights, checkpointing -> DeepSpeed engine."""
    from fluxzero.model import build_model

    stage = zero_stage(ds)
    torch.manual_seed(cfg.seed)  # identical random init on every rank (ZeRO-3 then keeps each rank's slice)
    # Under ZeRO-3, zero.Init partitions every parameter as its module is constructed: no rank ever holds
    # the whole model. Below stage 3 each rank holds a full copy anyway.
    with deepspeed.zero.Init(config_dict_or_path=ds, enabled=stage == 3):
        model = build_model(model_cfg, device="cpu" if stage == 3 else device)
    if cfg.weights:
        load_pretrained(model, cfg.weights, model_cfg, partitioned=stage == 3)
    ac = ours.get("activation_checkpointing", {}) or {}
    comp = ours.get("compile", {}) or {}
    if comp.get("blocks", False):  # compile first: checkpointing then wraps the compiled block
        apply_compile(model, comp.get("mode", "default"), comp.get("backend", "inductor"))
        if stage == 3:
            zero3_leaf_blocks(model)
    apply_activation_checkpointing(model, int(ac.get("every_k_blocks", 0)), ac.get("implementation", "torch"), ds)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds)
    return engine


@torch.no_grad()
def load_pretrained(model: torch.nn.Module, path: str, model_cfg: ModelConfig, partitioned: bool) -> None:
    """Copy pretrained weights into `model`; under ZeRO-3 module by module into the partitioned params.

    Partitioned: only rank 0 reads the file, one tensor at a time; each module's own parameters are
    gathered to full shape for the copy (GatheredParameters, modifier_rank=0) and re-partitioned on exit,
    so no rank ever holds more than one module whole.
    """
    from fluxzero.model.weights import iter_weights, load_weights

    if not partitioned:
        model.load_state_dict(load_weights(path, cfg=model_cfg, dtype=torch.float32), strict=True)
        return
    rank = dist.get_rank()
    tensors, error = None, [None]
    if rank == 0:
        try:  # iter_weights checks names and shapes of the whole file before the first read
            tensors = iter_weights(path, cfg=model_cfg, dtype=torch.float32)
            pending = dict([next(tensors)])
        except (ValueError, OSError) as e:
            error = [str(e)]
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise TrainingError(error[0])

    def take(key):
        while key not in pending:
            k, v = next(tensors)
            pending[k] = v
        return pending.pop(key)

    for name, module in model.named_modules():
        local = list(module.named_parameters(recurse=False))
        if not local:
            continue
        with deepspeed.zero.GatheredParameters([p for _, p in local], modifier_rank=0):
            if rank == 0:
                for pname, p in local:
                    p.data.copy_(take(f"{name}.{pname}" if name else pname))


def _checkpointed(checkpoint_fn, forward, *args):
    return checkpoint_fn(forward, *args)


def apply_activation_checkpointing(model, every_k: int, implementation: str, ds: dict) -> int:
    """Recompute every k-th transformer block (double then single) in backward; returns how many.

    Applied from outside: the block's bound forward is wrapped, so parameter names (and checkpoints)
    do not change. Blocks take only positional tensors, which both implementations require.
    """
    if every_k <= 0:
        return 0
    if implementation == "deepspeed":
        ac = ds.get("activation_checkpointing") or {}
        deepspeed.checkpointing.configure(
            None, partition_activations=bool(ac.get("partition_activations", False)),
            checkpoint_in_cpu=bool(ac.get("cpu_checkpointing", False)), synchronize=False, profile=False)
        fn = deepspeed.checkpointing.checkpoint
    else:
        fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    blocks = list(model.double_blocks) + list(model.single_blocks)
    count = 0
    for i, block in enumerate(blocks):
        if i % every_k == 0:
            block.forward = functools.partial(_checkpointed, fn, block.forward)
            count += 1
    return count


def apply_compile(model, mode: str = "default", backend: str = "inductor") -> int:
    """torch.compile every transformer block (double and single); returns how many. Call it before
    apply_activation_checkpointing.

    Applied from outside, like checkpointing: each block's forward is replaced by a compiled callable, so
    parameter names, state dicts and checkpoints do not change and the model stays plain PyTorch. One
    compiled function per block class, with the block as its first argument: all blocks of a class share
    its graphs (Dynamo treats the module and its parameters as inputs), two graphs for the whole model.

    Order with checkpointing: checkpoint(compiled block). torch.utils.checkpoint (non-reentrant) and
    deepspeed.checkpointing then recompute through the compiled code, at every ZeRO stage. Under ZeRO-3 call
    zero3_leaf_blocks too, or DeepSpeed's per-submodule hooks split every block's graph.
    """
    kwargs = {"backend": backend}
    if backend == "inductor":
        kwargs["mode"] = mode
    blocks = list(model.double_blocks) + list(model.single_blocks)
    compiled = {}
    for block in blocks:
        cls = type(block)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, **kwargs)
        block.forward = functools.partial(compiled[cls], block)
    return len(blocks)


def zero3_leaf_blocks(model) -> int:
    """Make every transformer block a ZeRO-3 leaf module (DeepSpeed's `set_z3_leaf_modules`); returns how many.

    DeepSpeed then hooks the block itself, gathering all its parameters before its forward (and before its
    backward, hence before a checkpointed block's recompute), and none of its submodules. Those hooks run in
    the block's `__call__`, outside the compiled forward, so each block class compiles into one graph as at
    stages 0-2. Without it, deepspeed 0.19.8's per-submodule hooks (`torch.compiler.disable`d) break the graph
    at every submodule, and Dynamo's recompile limit (8) sends most of nn.Linear.forward's frames back to
    eager; compile(checkpoint(block)) would compile nothing at all. Costs one whole block gathered at a time
    (FLUX.1-dev: 0.68 GB bf16 for a double block), which ZeRO-3's defaults here (max live parameters 1e9,
    reuse distance 1e9) keep gathered through a block's forward anyway. Call before deepspeed.initialize.
    """
    from deepspeed.utils import set_z3_leaf_modules

    classes = list(dict.fromkeys(type(b) for b in list(model.double_blocks) + list(model.single_blocks)))
    return len(set_z3_leaf_modules(model, classes))


def set_lr(engine, lr: float) -> None:
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


# ---------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------
def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def prune_checkpoints(ckpt_dir: Path, latest: str, keep: int) -> list[str]:
    """Delete step_* folders older than `latest` beyond the newest `keep` (latest counted); returns them.

    Called only after `latest` names a complete checkpoint. A folder that cannot be deleted is reported and
    left: the new checkpoint is saved either way.
    """
    older = [t for t in _step_folders(ckpt_dir) if re.fullmatch(r"step_\d{8}", t) and t < latest]
    doomed = older[:max(0, len(older) - (keep - 1))]
    for tag in doomed:
        try:
            shutil.rmtree(ckpt_dir / tag)
        except OSError as e:
            sys.stderr.write(f"warning: could not delete old checkpoint {ckpt_dir / tag} ({e.strerror or e})\n")
    return doomed


def latest_tag(ckpt_dir: str | Path) -> str | None:
    p = Path(ckpt_dir) / "latest"
    return p.read_text().strip() if p.is_file() else None


def save_checkpoint(engine, ckpt_dir: str | Path, step: int, trainer_state: dict, run_config_text: str,
                    ds: dict, keep: int = 0) -> str:
    """Save step `step` as tag step_XXXXXXXX; `latest` moves to it only after every rank finished.

    A failure while writing (disk full, ...) leaves `latest` on the previous, complete checkpoint. keep > 0:
    once `latest` names the new checkpoint, delete the older ones beyond the newest `keep` (never a newer one).
    """
    ckpt_dir = Path(ckpt_dir)
    rank = dist.get_rank()
    tag = f"step_{step:08d}"
    tag_dir = ckpt_dir / tag
    previous = latest_tag(ckpt_dir)
    if rank == 0:
        if tag_dir.exists() and tag != previous:  # left over from an interrupted save: never the latest
            shutil.rmtree(tag_dir)
        tag_dir.mkdir(parents=True, exist_ok=True)
    barrier()
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step}, save_latest=False)
        buf = _torch_bytes({**trainer_state, "rng": rng_state(), "world_size": dist.get_world_size()})
        atomic_write(tag_dir / f"trainer_state_rank{rank}.pt", buf)
        if rank == 0:
            atomic_write(tag_dir / "run.yaml", run_config_text.encode())
            atomic_write(tag_dir / "ds_config.json", json.dumps(ds, indent=2).encode())
        barrier()
        if rank == 0:
            atomic_write(ckpt_dir / "latest", tag.encode())
            if keep:
                prune_checkpoints(ckpt_dir, tag, keep)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write (disk full) as RuntimeError
        if isinstance(e, RuntimeError) and peer_stopped(e):
            raise  # another rank left mid-save (its barrier broke): not a write failure here
        reason = e.strerror if isinstance(e, OSError) and e.strerror else "a write failed; is the disk full?"
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        raise TrainingError(f"could not save checkpoint {tag} in {ckpt_dir} ({reason}); {kept}, "
                            f"free disk space or change output_dir and resume") from None
    barrier()
    return str(tag_dir)


def _torch_bytes(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load_checkpoint(engine, ckpt_dir: str | Path) -> dict | None:
    """Restore the latest complete checkpoint (model, optimizer, this rank's RNG); returns the trainer state.

    Rank 0 alone reads `latest` and decides what to resume (or that there is nothing to resume), and tells
    the others: a rank that decided by itself could start fresh while the rest resume, and their collectives
    would no longer pair up. Then every rank checks that it sees the files it will read, complete and intact,
    and all ranks stop with the same sentence if any rank found a problem (a rank failing alone inside
    DeepSpeed would leave the others waiting in a collective).
    """
    ckpt_dir = Path(ckpt_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    decision = [None, None]  # [tag to resume or None, error]
    if rank == 0:
        decision = list(_resume_decision(ckpt_dir, world))
    dist.broadcast_object_list(decision, src=0)
    tag, error = decision
    if error:
        raise TrainingError(error)
    if tag is None:
        return None
    problems = [None] * world
    dist.all_gather_object(problems, _rank_checkpoint_problem(engine, ckpt_dir, tag, rank))
    problem = next((p for p in problems if p), None)
    if problem:
        raise TrainingError(problem)
    state = torch.load(ckpt_dir / tag / f"trainer_state_rank{rank}.pt", weights_only=False)
    path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    if path is None:
        raise TrainingError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    set_rng_state(state["rng"])
    return state


def checkpoint_files(stage: int, bf16: bool, rank: int) -> tuple[list[str], list[str]]:
    """(files only `rank` reads, files every rank reads) of a fluxzero checkpoint folder.

    DeepSpeed 0.19.8's names (engine._get_ckpt_name, _get_rank_zero_ckpt_name) without model parallelism
    (mp rank 00): under ZeRO-3 each rank has its own model states, below it all ranks read one file; from
    stage 1 on each rank has its own optimizer partition ("bf16_" prefix in bf16), at stage 0 the optimizer
    lives in the model states file.
    """
    own = [f"trainer_state_rank{rank}.pt"]
    shared = []
    if stage == 3:
        own.append(f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    else:
        shared.append("mp_rank_00_model_states.pt")
    if stage >= 1:
        own.append(f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return own, shared


def _step_folders(ckpt_dir: Path) -> list[str]:
    try:
        return sorted(p.name for p in ckpt_dir.glob("step_*") if p.is_dir())
    except OSError:
        return []


def _resume_advice(ckpt_dir: Path, tag: str | None) -> str:
    """What to do when `latest` cannot be resumed: point it at the newest complete-looking folder before."""
    earlier = [t for t in _step_folders(ckpt_dir) if tag is None or t < tag]
    if earlier:
        return (f"write {earlier[-1]} (the newest checkpoint before it) into {ckpt_dir / 'latest'} to resume "
                f"from there, or choose another output_dir")
    return "no earlier checkpoint is there to fall back on: choose another output_dir to start over"


def _export_advice(ckpt_dir: Path, tag: str | None) -> str:
    folders = _step_folders(ckpt_dir)
    return (f"export one of its checkpoint folders instead, such as {ckpt_dir / folders[-1]}" if folders
            else "export another checkpoint")


def _latest_problem(ckpt_dir: Path, advice=_resume_advice) -> tuple[str | None, str | None]:
    """(tag named by `latest`, None), (None, None) without `latest`, or (None, what is wrong with it)."""
    latest = ckpt_dir / "latest"
    if not latest.is_file():
        return None, None
    try:
        tag = latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"cannot read {latest} ({getattr(e, 'strerror', None) or e}); {advice(ckpt_dir, None)}"
    if not tag:
        return None, f"{latest} is empty; {advice(ckpt_dir, None)}"
    if "/" in tag or "\\" in tag or not (ckpt_dir / tag).is_dir():
        return None, f"{latest} names {tag!r}, which is not a folder in {ckpt_dir}; {advice(ckpt_dir, None)}"
    return tag, None


def _resume_decision(ckpt_dir: Path, world: int) -> tuple[str | None, str | None]:
    """Rank 0: (tag to resume, None), (None, None) for a fresh start, or (None, the sentence to stop with).

    The world size comes first: a run resumed with more ranks would otherwise be told that the extra
    ranks' files are missing.
    """
    tag, error = _latest_problem(ckpt_dir)
    if tag is None:
        return None, error
    tag_dir = ckpt_dir / tag
    state_file = tag_dir / "trainer_state_rank0.pt"
    problem = _file_problem(state_file)
    if problem:
        return None, f"checkpoint {tag_dir} is incomplete or corrupt ({problem}); {_resume_advice(ckpt_dir, tag)}"
    try:
        saved = torch.load(state_file, weights_only=False)["world_size"]
    except Exception:  # intact zip, but not a fluxzero trainer state
        return None, (f"checkpoint {tag_dir} holds no fluxzero trainer state in {state_file.name}; "
                      f"{_resume_advice(ckpt_dir, tag)}")
    if saved != world:
        return None, (f"checkpoint {tag_dir} was saved by {saved} ranks but {world} are running; resume with "
                      f"{saved} ranks (or convert it with DeepSpeed's ds_to_universal)")
    return tag, None


def _rank_checkpoint_problem(engine, ckpt_dir: Path, tag: str, rank: int) -> str | None:
    """This rank's view of the checkpoint rank 0 chose: the folder, then the files it reads, then their CRCs.

    The files every rank reads (the model states below ZeRO-3) are CRC-checked once per node (local rank 0),
    the rest by the rank that reads them. CRC-checking reads the whole file; measured ~0.4 s/GB on one core
    from the page cache (torch.load of the same file: ~0.6 s/GB).
    """
    tag_dir = ckpt_dir / tag
    if not tag_dir.is_dir():
        return (f"rank {rank} (host {socket.gethostname()}) cannot see {tag_dir}, the checkpoint rank 0 resumes "
                f"from; output_dir must be on a filesystem all nodes share (or hold identical copies on every "
                f"node)")
    own, shared = checkpoint_files(engine.zero_optimization_stage(), engine.bfloat16_enabled(), rank)
    if engine.load_universal_checkpoint():  # DeepSpeed reads the universal layout itself
        own, shared = own[:1], []
    mine = own + (shared if int(os.environ.get("LOCAL_RANK", "0")) == 0 else [])
    for name in own + shared:
        problem = _file_problem(tag_dir / name, crc=name in mine)
        if problem:
            return f"checkpoint {tag_dir} is incomplete or corrupt ({problem}); {_resume_advice(ckpt_dir, tag)}"
    return None


def _file_problem(path: Path, crc: bool = True) -> str | None:
    """What makes a torch.save file unusable, in a few words (missing, truncated, overwritten), or None.

    torch.save writes a zip archive with a CRC-32 for every record, which torch.load never checks: a file
    overwritten in place with its size unchanged loads silently. testzip() reads every record and compares.
    """
    if not path.is_file():
        return f"{path.name} is missing"
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip() if crc else None
    except Exception:  # zipfile raises BadZipFile, EOFError, struct.error, ... for damaged archives
        return f"{path.name} is not a complete torch file"
    return f"{path.name} fails its CRC-32 check in {bad}" if bad else None


def _unreadable_files(tag_dir: Path) -> list[str]:
    """Names of the checkpoint folder's torch files that are truncated, overwritten or otherwise damaged."""
    return [f.name for f in sorted(Path(tag_dir).glob("*.pt")) if _file_problem(f)]


# ---------------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------------
def resolve_checkpoint(path: str | Path) -> tuple[Path, str]:
    """A checkpoints folder (uses `latest`), the run's output_dir, or one tag folder -> (checkpoints folder, tag)."""
    path = Path(path)
    for ckpt_dir in (path, path / "checkpoints"):
        if (ckpt_dir / "latest").is_file():
            tag, error = _latest_problem(ckpt_dir, _export_advice)
            if error:
                raise TrainingError(error)
            return ckpt_dir, tag
    if any(path.glob("*model_states.pt")):  # ZeRO-3 folders have one per rank, none named mp_rank_00_...
        return path.parent, path.name
    raise TrainingError(f"{path} is not a fluxzero checkpoint (no 'latest' file and no DeepSpeed model states)")


def consolidated_state_dict(path: str | Path) -> tuple[dict, Path]:
    """Full fp32 weights from a checkpoint of any ZeRO stage: the fp32 master weights wherever training kept
    them (DeepSpeed's own zero_to_fp32 consolidation for stages 1-3).

    Returns (state_dict, tag folder).
    """
    ckpt_dir, tag = resolve_checkpoint(path)
    tag_dir = ckpt_dir / tag
    if not any(tag_dir.glob("*model_states.pt")):
        raise TrainingError(f"checkpoint {tag_dir} is incomplete or corrupt (it has no DeepSpeed model states "
                            f"file); export another checkpoint folder of {ckpt_dir}")
    for f in sorted(tag_dir.glob("*.pt")):  # a damaged file would otherwise export wrong weights silently
        problem = _file_problem(f)
        if problem:
            raise TrainingError(f"checkpoint {tag_dir} is incomplete or corrupt ({problem}); export another "
                                f"checkpoint folder of {ckpt_dir}")
    try:
        if glob.glob(str(tag_dir / "*zero_pp_rank_*optim_states.pt")):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            # it prints five lines of its own bookkeeping per export; its shard progress bar (stderr) stays
            quiet = contextlib.nullcontext() if os.environ.get("FLUXZERO_DEBUG") else \
                contextlib.redirect_stdout(io.StringIO())
            with quiet:
                sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
        else:  # ZeRO stage 0: model and optimizer states in one file
            sd = _stage0_master_weights(torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu",
                                                   weights_only=False))
    except TrainingError:
        raise
    except Exception as e:  # missing shard files: torch and DeepSpeed raise many kinds
        reason = str(e).splitlines()[0].split(". ")[0].rstrip(".") if str(e) else type(e).__name__
        raise TrainingError(f"checkpoint {tag_dir} is incomplete or corrupt ({reason[:200]}); export another "
                            f"checkpoint folder of {ckpt_dir}") from None
    return {k: v.float() for k, v in sd.items()}, tag_dir


def _stage0_master_weights(states: dict) -> dict:
    """The weights of a ZeRO-0 model-states file, taken from the optimizer's fp32 masters where it has them.

    In bf16 or fp16, stage 0 wraps the optimizer in DeepSpeed's FP16 optimizers, which keep fp32 master
    copies and save them into this file: FP16_UnfusedOptimizer (torch and other unfused optimizers) as
    "fp32_groups", one tensor per parameter; FP16_Optimizer (FusedAdam) as "fp32_groups_flat", one flat
    tensor per parameter group. Both follow the order of the parameters fluxzero hands DeepSpeed
    (model.parameters()), which is the module state dict's order without its buffers; each master rounded to
    the module's dtype must equal the saved module weight, which checks the pairing. fp32 runs have no
    wrapper: the module weights are the masters.
    """
    module, opt = states["module"], states.get("optimizer") or {}
    if "fp32_groups" not in opt and "fp32_groups_flat" not in opt:
        return module
    buffers = set(states.get("buffer_names") or ())
    names = [k for k in module if k not in buffers]
    if "fp32_groups" in opt:
        masters = [t for group in opt["fp32_groups"] for t in group]
    else:
        flat = torch.cat([g.reshape(-1) for g in opt["fp32_groups_flat"]])
        sizes = [module[n].numel() for n in names]
        masters = list(flat.split(sizes)) if flat.numel() == sum(sizes) else []
        masters = [m.view(module[n].shape) for m, n in zip(masters, names)]
    if len(masters) != len(names) or not all(
            m.shape == module[n].shape and torch.equal(m.to(module[n].dtype), module[n]) for m, n in zip(masters, names)):
        raise TrainingError("the optimizer's fp32 master weights in this ZeRO-0 checkpoint do not pair up with its "
                            "module weights, so the fluxzero trainer did not write it; consolidate it with "
                            "DeepSpeed's own tools")
    return {**module, **dict(zip(names, masters))}


def export_checkpoint(path: str | Path, out: str | Path, layout: str = "bfl", dtype: str = "bf16") -> str:
    """Consolidate a checkpoint and write safetensors in the BFL, diffusers or ComfyUI layout."""
    import yaml
    from safetensors import SafetensorError

    from fluxzero.config import get_model_config
    from fluxzero.model.weights import WeightsError, save_weights

    sd, tag_dir = consolidated_state_dict(path)
    run = tag_dir / "run.yaml"
    cfg = None
    if run.is_file():
        try:
            cfg = get_model_config(yaml.safe_load(run.read_text())["model"])
        except (yaml.YAMLError, OSError, UnicodeDecodeError, TypeError, KeyError, ValueError) as e:
            raise TrainingError(f"{run} does not name a known model ({str(e).splitlines()[0][:200]}); it records "
                                f"what the checkpoint trained: repair it, or export another checkpoint") from None
    try:
        save_weights(sd, str(out), layout=layout, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype],
                     cfg=cfg)
    except WeightsError as e:  # the weights do not fit the model run.yaml names, or the layout cannot hold them
        raise TrainingError(f"cannot export {tag_dir}: {e}") from None
    except (OSError, SafetensorError) as e:  # safetensors reports a failed write as SafetensorError
        raise TrainingError(f"cannot write the export {out} ({_write_reason(e)}); choose a writable place with "
                            f"free space") from None
    return str(out)


def _write_reason(e: Exception) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
