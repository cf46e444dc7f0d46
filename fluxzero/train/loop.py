"""Training entry: `main(argv)` parses the command line, `train(cfg)` runs the loop.

    python launch/train.py --config launch/tiny.yaml [key=value ...]
    torchrun --nproc_per_node 2 launch/train.py --config launch/tiny.yaml steps=20 flow.shift=none

Setup reads, in this order and without going back: run file -> distributed -> DeepSpeed config -> data ->
resume decision -> model/engine -> checkpoint -> loop.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import math
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from fluxzero.config import TrainConfig, resolve_model
from fluxzero.config.deepspeed.file import load_for_training
from fluxzero.config.deepspeed.view import DSConfigError, DSView
from fluxzero.config.runfile import ConfigError, config_text, load_config, override_key, split_allow
from fluxzero.train import distributed
from fluxzero.train.distributed import Interrupted, TrainingError, write_line

# compiled blocks are saved beside the checkpoints once per start, at its first checkpoint or after this many steps,
# whichever comes first: by then the aspect buckets of a typical mix have all come by
COMPILE_SAVE_STEPS = 50


@dataclass
class Run:
    """What setup built, for the loop."""

    engine: object
    loader: object
    ds: dict  # the DeepSpeed config as the engine got it, saved beside each checkpoint
    view: DSView
    ckpt_dir: Path
    total: int  # optimizer steps of the whole run
    stop: int  # this start stops after this step (stop_after)
    done: int  # optimizer steps done (from the checkpoint on a resume)
    last_ckpt: str | None  # the last complete checkpoint this process knows of (rank 0 chose the resumed one)
    train_flops: object  # (img_tokens, txt_tokens) -> FLOPs of one sample's training step
    dtype: torch.dtype
    step: object = None  # the TrainStep
    ema: object = None  # ShardedEMA, when the run file has an ema: section
    validation: object = None  # evaluate.Validation, when it has validation.data
    previews: object = None  # evaluate.Previews, when it has sample.every
    compiled: bool = False  # the blocks run under torch.compile (they compile in the first step)
    compiled_kept: frozenset = frozenset()  # the entries output_dir/compile_cache.bin held at start (model.compile)
    compiled_saved: bool = False  # this process has saved them (once per process: model.compile.save_artifacts)


def build_loader(cfg: TrainConfig, micro_batch: int, rank: int, world: int, device: torch.device):
    """The trainer's loader of cfg.data: its worker processes (TrainConfig.loader_workers on this machine), pinned
    memory on a GPU. Benchmarks feed their peers with it too."""
    from fluxzero.data import build_dataloader

    workers = cfg.loader_workers(device.type, len(os.sched_getaffinity(0)), distributed.local_world_size())
    return build_dataloader(
        cfg.data,
        micro_batch=micro_batch,
        rank=rank,
        world_size=world,
        seed=cfg.seed,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        # forked workers can hang once DeepSpeed's threads and process group exist
        multiprocessing_context="spawn" if workers else None,
    )


def setup(cfg: TrainConfig, rank: int, world: int, device, allow_config_change: bool = False) -> Run:
    """Everything the loop needs, built as the trainer builds it (benchmarks call this too, then time run.step)."""
    from fluxzero.train import engine as ds_engine
    from fluxzero.train.checkpoint import resume
    from fluxzero.train.checkpoint import store as checkpoint
    from fluxzero.train.step import TrainStep, batches

    try:
        ds, v = load_for_training(cfg.deepspeed, world)
    except DSConfigError as e:
        raise TrainingError(str(e)) from None
    ds_engine.check_supported(v, cfg.deepspeed)
    _check_inputs(cfg)
    from fluxzero.model.math import set_process_sdpa_flags

    # the trainer owns its process: torch's SDPA flags match the model's backend, so attention calls SDPA
    # directly instead of entering sdpa_kernel ~60 times a forward (the model is right either way)
    set_process_sdpa_flags(cfg.attention)
    # nothing in training draws from python's or numpy's generators, but each checkpoint saves their states: seeded,
    # a resumed run saves the same trainer-state bytes as an uninterrupted one (unseeded, each process starts apart)
    random.seed(cfg.seed * 1_000_003 + rank)
    np.random.seed((cfg.seed * 1_000_003 + rank) % 2**32)
    model_cfg = resolve_model(cfg.model)
    loader = build_loader(cfg, v.micro_batch, rank, world, device)
    loader.check_model(model_cfg)
    if rank == 0 and hasattr(loader.source, "summary"):  # several datasets: what an epoch draws from each
        write_line(loader.source.summary())
    total = cfg.total_steps(len(loader), v.grad_accum)
    ckpt_dir = Path(cfg.output_dir) / "checkpoints"
    tag = resume.decide_resume(cfg, v, ckpt_dir, allow_config_change)
    from fluxzero.train.host_memory import check_run

    # before anything large is allocated: a host short of memory would swap or meet the OOM killer mid-run instead
    distributed.all_ranks_ok(
        check_run(
            model_cfg,
            ds,
            v,
            world=world,
            local_world=distributed.local_world_size(),
            latent_sizes=loader.dims["latent_sizes"],
            txt_len=loader.dims.get("t5_len", 512),
            ema=cfg.ema,
            lora=cfg.lora,
            weights=bool(cfg.weights),
        )
    )
    engine = ds_engine.build_engine(
        model_cfg,
        ds,
        v,
        device,
        seed=cfg.seed,
        weights=cfg.weights,
        attention=cfg.attention,
        lora=cfg.lora,
        latent_sizes=loader.dims["latent_sizes"],
    )
    state = checkpoint.load(engine, ckpt_dir, tag) if tag else None
    if state:
        loader.load_state_dict(state["loader"], allow_data_change=allow_config_change)
        if rank == 0:
            write_line(f"resuming from step {state['step']} (checkpoint {ckpt_dir / tag})")
        _apply_config_lr(engine, v, rank)
    start = state["step"] if state else 0
    dtype = ds_engine.model_dtype(v)
    run = Run(
        engine,
        loader,
        ds,
        v,
        ckpt_dir,
        total,
        min(total, cfg.stop_after) if cfg.stop_after else total,
        start,
        str(ckpt_dir / tag) if tag else None,
        functools.partial(model_cfg.train_flops_per_sample, frozen_linears=cfg.lora is not None),
        dtype,
    )
    run.compiled = v.compiles_blocks(device.type, cfg.lora is not None)
    run.step = TrainStep(
        engine,
        batches(loader),
        cfg.flow,
        seed=cfg.seed,
        grad_accum=v.grad_accum,
        guidance_embed=model_cfg.guidance_embed,
        device=device,
        dtype=dtype,
        before_update=lambda loss: _check_finite(loss, run),
        stop_flag=lambda: distributed.stop_requested() is not None,
        position=lambda: {"epoch": loader.epoch, "batches_done": loader.batches_done},
        prefetch=cfg.prefetch_batches,
    )
    _setup_extras(run, cfg, model_cfg, tag, rank, world, device)
    if run.compiled:
        run.compiled_kept = _load_compiled(cfg, rank)
    return run


def _check_inputs(cfg: TrainConfig) -> None:
    """What the run file names must be there before anything is built: the weights, the previews' reference, peft
    for a LoRA."""
    if cfg.weights and not Path(cfg.weights).exists():
        raise TrainingError(
            f"weights: {cfg.weights} (the run file's pretrained weights) does not exist; it is read "
            f"relative to the folder you launch from ({os.getcwd()}): set weights: to the FLUX.1 "
            f"safetensors file or diffusers folder, or remove it to train from random weights"
        )
    if cfg.sample.every and cfg.sample.reference and not Path(cfg.sample.reference).is_file():
        raise TrainingError(
            f"sample.reference {cfg.sample.reference} does not exist; it is read relative to the folder "
            f"you launch from ({os.getcwd()}): set it to the image the previews edit (or a "
            f".safetensors file of its latents)"
        )
    if cfg.lora is not None:
        from fluxzero.model.lora import require_peft
        from fluxzero.model.lora_keys import LoraError

        try:
            require_peft()
        except LoraError as e:
            raise TrainingError(str(e)) from None


def _setup_extras(run: Run, cfg: TrainConfig, model_cfg, tag: str | None, rank: int, world: int, device) -> None:
    """EMA (restored from the checkpoint's shard when it has one), validation set, sample previews."""
    if cfg.ema is not None:
        from fluxzero.train.ema import ShardedEMA

        run.ema = ShardedEMA(run.engine, cfg.ema, seed=cfg.seed)
        if tag:
            _resume_ema(run, tag, rank, world)
    if cfg.validation.data:
        from fluxzero.train.evaluate import Validation

        run.validation = Validation(
            cfg.validation,
            cfg.flow,
            model_cfg,
            micro_batch=run.view.micro_batch,
            rank=rank,
            world=world,
            device=device,
            dtype=run.dtype,
        )
    if cfg.sample.every:
        try:
            from fluxzero.train.evaluate import Previews

            run.previews = Previews(
                cfg.sample,
                model_cfg,
                cfg.output_dir,
                rank=rank,
                stage=run.view.stage,
                device=device,
                dtype=run.dtype,
                validation=run.validation,
            )
        except ImportError as e:
            raise TrainingError(
                f"sample.every needs the sampling packages ({e.name} is missing): pip install -e '.[cache]'"
            ) from None


def _resume_ema(run: Run, tag: str, rank: int, world: int) -> None:
    """Restore this rank's EMA shard, checked (step, rank, world size, checksum) on every rank before any is
    loaded; a checkpoint of a run that had an EMA never resumes with another one without a word."""
    from fluxzero.train.checkpoint import resume
    from fluxzero.train.ema import ShardError, read_shard, shard_name

    tag_dir = run.ckpt_dir / tag
    had = resume.saved_run(tag_dir).get("ema") or any(tag_dir.glob("ema_rank_*.safetensors"))
    problem, note, sd = None, None, None
    if had:
        advice = (
            f"restore it or remove the ema: section to continue without the EMA, otherwise "
            f"{resume.resume_advice(run.ckpt_dir, tag)}"
        )
        try:
            sd, note = read_shard(tag_dir / shard_name(rank), rank=rank, world=world, step=run.done, advice=advice)
            run.ema.load_state_dict(sd)
        except ShardError as e:
            problem = str(e)
        except ValueError:  # the layout: another partitioning (ZeRO stage, model or LoRA targets)
            problem = (
                f"EMA shard {tag_dir / shard_name(rank)} was saved with another partitioning of the trained "
                f"parameters than this run's; {advice}"
            )
    distributed.all_ranks_ok(problem)
    if rank == 0 and (note or not had):
        write_line(note or f"note: {tag_dir} holds no EMA; the EMA starts from the resumed weights")


def _after_step(run: Run, cfg: TrainConfig, step: int, metrics) -> dict:
    """EMA update, validation and previews of optimizer step `step`; returns the values to log with it."""
    extra = {}
    if run.ema is not None:
        run.ema.update(step)
    if run.validation is not None and (
        (cfg.validation.every and step % cfg.validation.every == 0) or step == run.total
    ):
        from fluxzero.train.evaluate import ValidationFailed

        try:
            extra["val_loss"] = run.validation(run.engine)
        except ValidationFailed as e:  # the training is sound: keep it before stopping
            _save(run, cfg, dist.get_rank())
            raise TrainingError(
                f"{e} (training was saved first: {run.last_ckpt} holds step {step}, so the same "
                f"command resumes from it once the data is fixed)"
            ) from None
    if run.previews is not None and (step % cfg.sample.every == 0 or step == run.total):
        swap = run.ema.swap() if cfg.sample.weights == "ema" else contextlib.nullcontext()
        with swap:
            paths, extra["sample_s"] = run.previews(run.engine, step)
        metrics.add_images("samples", paths, step)
    return extra


def _apply_config_lr(engine, v: DSView, rank: int) -> None:
    """Without a scheduler the lr is the DeepSpeed config's: DeepSpeed's checkpoint load restores the optimizer's
    param groups, lr included, so an lr edited for the resume would be dropped without a word."""
    from fluxzero.train import engine as ds_engine

    if v.scheduler is not None or v.lr is None:  # a scheduler's own state sets the lr of every step
        return
    before = ds_engine.set_lr(engine, v.lr)
    if rank == 0 and before is not None and before != v.lr:
        write_line(f"note: lr is {v.lr:g} from the DeepSpeed config (the checkpoint trained at {before:g})")


def _check_finite(loss: float, run: Run) -> None:
    """Stop before a non-finite loss reaches the weights, naming the samples it came from (every rank calls
    this with the same all-reduced loss, so the gather below pairs up)."""
    if math.isfinite(loss):
        return
    mine = run.step.nonfinite_samples()
    every = distributed.gather_objects(mine)
    where = [run.loader.source.describe(i) for i in dict.fromkeys(i for rank in every for i in rank)]
    batch = f" (in the micro batch holding {', '.join(where[:3])}{', ...' if len(where) > 3 else ''})" if where else ""
    raise TrainingError(
        f"loss is {loss} at step {run.done + 1}{batch}; stopped before applying that update and "
        f"without saving (last checkpoint: {run.last_ckpt or 'none'}); lower the lr, raise "
        f"gradient clipping or check the data"
    )


def train(cfg: TrainConfig, allow_config_change: bool = False) -> dict:
    """Train as configured; returns {"losses": [...], "step", "checkpoint", "export"}.

    allow_config_change: resume a checkpoint although data, grad_accum or flow options changed (see
    resume.decide_resume); the new values are saved with the next checkpoint.
    """
    from fluxzero.train.checkpoint import locks
    from fluxzero.train.export import full as export
    from fluxzero.train.metrics import LogWriteError, Metrics

    rank, world, device = distributed.init_distributed()
    try:
        run = setup(cfg, rank, world, device, allow_config_change)
    except BaseException:
        locks.release_output_dir()
        raise
    losses, saved_step, result, metrics = [], run.done if run.last_ckpt else None, {}, None
    if rank == 0:
        write_line(_summary(run, cfg, world))
        if run.compiled and run.done < run.stop:
            write_line(_compile_note(run, cfg))
    try:
        metrics = Metrics(
            cfg.output_dir,
            rank,
            world,
            device,
            run.total,
            run.done,
            run.view.global_batch,
            run.train_flops,
            run.dtype,
        )
        distributed.graceful_stops(True)  # SIGTERM / SIGUSR1 now mean: checkpoint at the next step boundary
        first, save_compiled_after = run.done, _compile_save_step()
        while run.done < run.stop:  # batch -> forward -> loss -> backward -> step -> log -> checkpoint
            metrics.step_started()
            r = run.step()
            metrics.step_finished()
            step = run.done = run.done + 1
            if step - first >= save_compiled_after:  # this start's buckets have mostly come by
                _save_compiled(run, cfg, step, rank)
            losses.append(r.loss)
            extra = _after_step(run, cfg, step, metrics)
            metrics.log(
                step,
                r.loss,
                r.lr,
                r.grad_norm,
                r.skipped_steps,
                img_tokens=r.img_tokens,
                txt_tokens=r.txt_tokens,
                log=step % cfg.log_every == 0 or step == run.stop,
                extra=extra,
            )
            if r.stop_requested or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < run.stop):
                saved_step = _save(run, cfg, rank)
            if r.stop_requested:
                raise distributed.Stopped(
                    f"stopped by {distributed.stop_requested() or 'a stop signal to another rank'} after step "
                    f"{step} of {run.total}; the checkpoint {run.last_ckpt} holds it: run the same command again "
                    f"to resume"
                )
        if saved_step != run.done:
            _save(run, cfg, rank)
        metrics.close()  # the last TensorBoard points reach the disk, or the error says they did not
        result = {"losses": losses, "step": run.done, "checkpoint": run.last_ckpt}
        # every rank is done with collectives: meet once more so that none tears its process group down
        # while another still has messages in flight, then only rank 0 exports (the others leave)
        distributed.barrier()
        if cfg.export.format and run.done >= run.total:
            result["export"], result["exported"] = export.final_export(
                cfg.export, cfg.output_dir, run.ckpt_dir, rank, lora=cfg.lora is not None, base=cfg.weights
            )
    except KeyboardInterrupt:
        distributed.ignore_stop_signals()  # a second Ctrl-C, or the launcher's SIGTERM, must not cut the cleanup short
        raise Interrupted(_interrupted(run)) from None
    except LogWriteError as e:  # rank 0 only: a full disk outside checkpoint saving
        raise TrainingError(_disk_full(cfg, run, e)) from None
    finally:
        distributed.graceful_stops(False)
        run.step.close()
        if metrics is not None:
            metrics.close(strict=False)
        run.engine.destroy()
        locks.release_output_dir()
    if rank == 0:
        write_line(_done(run, result))
    return result


def _summary(run: Run, cfg: TrainConfig, world: int) -> str:
    """One line before the progress bar: what is trained, on what data, how it is split."""
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in run.engine.module.parameters() if p.requires_grad)
    from fluxzero.config.lora import ADAPTER_NAMES

    what = f"{cfg.model} {ADAPTER_NAMES[cfg.lora.type]} rank {cfg.lora.rank}" if cfg.lora is not None else cfg.model
    micro, accum, global_batch = run.view.batch_for(world)
    steps = f"steps {run.done + 1}-{run.stop} of {run.total}" if run.done < run.stop else f"all {run.total} steps done"
    return (
        f"training {what}: {trainable:,} trainable parameters; {run.loader.num_samples} samples in "
        f"{len(run.loader.dims['latent_sizes'])} bucket(s); {world} rank(s), ZeRO-{run.view.stage}, global batch "
        f"{micro} x {accum} accumulation x {world} = {global_batch}; {steps}"
    )


def _compile_note(run: Run, cfg: TrainConfig) -> str:
    """Why the first step takes long when the blocks are compiled, and where the compiled code is kept."""
    from fluxzero.model.compile import compile_cache_dir

    sizes = run.loader.dims["latent_sizes"]
    again = f", and briefly again as new bucket shapes arrive ({len(sizes)} here)" if len(sizes) > 1 else ""
    cache = compile_cache_dir()
    kept = f"; the compiled code is kept in {cache}" if cache else "; the compiled code is kept"
    kept += f" and in {_compiled_file(cfg)}, so a later run or a resume on another machine compiles faster"
    return (
        f"compiling the blocks (torch.compile) during the first step: a minute or more for FLUX.1-dev{again}{kept}"
        + unaligned_buckets_note(sizes, images=2 if run.loader.dims.get("reference") else 1)
    )


def unaligned_buckets_note(latent_sizes: list[tuple[int, int]], images: int = 1) -> str:
    """A hint where the buckets' token counts are multiples of 8 for some buckets and not for others: Inductor's
    alignment guard on attention is a yes/no on that, so the two kinds compile apart (16 px bucket sides; measured:
    3 recompiles over 200 steps, 26 s of 164, benchmarks/RESULTS.md), which buckets with 64 px sides, `fluxzero
    cache`'s default, avoid. `images`: latents of the bucket's size in a sample's image tokens (2 for a FLUX.1
    Kontext pair: the target and its reference)."""
    tokens = {images * (h // 2) * (w // 2) for h, w in latent_sizes}  # 2x2 patches
    odd = sorted(t for t in tokens if t % 8)
    if not odd or len(odd) == len(tokens):  # one kind only: one graph serves them all
        return ""
    return (
        f"; {len(odd)} of the {len(tokens)} bucket token counts are not multiples of 8 (e.g. {odd[0]}), which the "
        "compiled blocks compile apart: data cached by `fluxzero cache --bucket-step 64` (its default) avoids that"
    )


def _done(run: Run, result: dict) -> str:
    return (
        f"done: step {run.done}/{run.total}, checkpoint {result['checkpoint']}"
        + (f", export {result['export']}" if "export" in result else "")
        + ("" if result.get("exported", True) else " (up to date: not written again)")
    )


def _save(run: Run, cfg: TrainConfig, rank: int) -> int:
    """Checkpoint step run.done (never non-finite weights: a diverged update must not replace or prune a good
    checkpoint); returns the step saved."""
    from fluxzero.train.checkpoint import store as checkpoint

    step = run.done
    if not checkpoint.weights_finite(run.engine):
        raise TrainingError(
            f"the weights after step {step} are not finite (the update diverged: lower the lr "
            f"or raise gradient clipping); not saved, the last complete checkpoint "
            f"{run.last_ckpt or '(none)'} is kept"
        )
    try:
        run.last_ckpt = checkpoint.save(
            run.engine,
            run.ckpt_dir,
            step,
            {"step": step, "loader": _loader_state(run)},
            config_text(cfg),
            run.ds,
            keep=cfg.checkpoint.keep,
            rank_files=_ema_files(run, rank),
        )
    except KeyboardInterrupt:  # Ctrl-C after `latest` moved (in the last barrier or the pruning): say so
        if checkpoint.latest_tag(run.ckpt_dir) == f"step_{step:08d}":
            run.last_ckpt = str(run.ckpt_dir / f"step_{step:08d}")
        raise
    _save_compiled(run, cfg, step, rank)  # unless this start saved them already
    return step


def _compile_save_step() -> int:
    """After how many steps of this start the compiled blocks are saved (if no checkpoint came first):
    COMPILE_SAVE_STEPS, or FLUXZERO_COMPILE_SAVE_STEP where set (benchmarks and tests)."""
    value = os.environ.get("FLUXZERO_COMPILE_SAVE_STEP", "")
    return int(value) if value.isdigit() and int(value) > 0 else COMPILE_SAVE_STEPS


def _compiled_file(cfg: TrainConfig) -> Path:
    from fluxzero.model.compile import ARTIFACTS_FILE

    return Path(cfg.output_dir) / ARTIFACTS_FILE


def _load_compiled(cfg: TrainConfig, rank: int) -> frozenset:
    """Hot-load the compiled blocks an earlier run in this output_dir saved (on any machine): a resume on a fresh
    machine, or the ranks of a node without the first one's compile cache, skip most of the first step's compile.
    Returns the entries loaded. A file that cannot be read costs a warning, never the run."""
    from fluxzero.model.compile import load_artifacts

    path = _compiled_file(cfg)
    try:
        loaded = load_artifacts(path)
    except Exception as e:  # noqa: BLE001 - a stale or broken cache file must not stop training
        if rank == 0:
            write_line(f"warning: could not load {path} ({e}); the blocks compile from scratch")
        return frozenset()
    if not loaded:
        return frozenset()
    size, keys = loaded
    if rank == 0:
        write_line(
            f"loaded the compiled blocks of an earlier run ({path}, {size / 2**20:.1f} MiB, {len(keys)} entries)"
        )
    return keys


def _save_compiled(run: Run, cfg: TrainConfig, step: int, rank: int) -> None:
    """Rank 0, once per start (at its first checkpoint or after COMPILE_SAVE_STEPS steps, whichever comes first; torch
    can serialize a process's compile only once, model.compile.save_artifacts): what it compiled, to
    output_dir/compile_cache.bin. Nothing for eager blocks. A failure (a full disk) is one warning line: the
    training and its checkpoints are unaffected."""
    from fluxzero.model.compile import save_artifacts

    if not run.compiled or rank != 0 or run.compiled_saved:
        return
    run.compiled_saved = True
    path = _compiled_file(cfg)
    try:
        kept = save_artifacts(path, run.compiled_kept)
    except Exception as e:  # noqa: BLE001 - a cache file must never cost the run
        write_line(f"warning: could not save the compiled blocks to {path} ({type(e).__name__}: {e})")
        return
    if kept is not None:
        write_line(f"compiled blocks kept in {path} after step {step} ({path.stat().st_size / 2**20:.1f} MiB)")


def _loader_state(run: Run) -> dict:
    """The loader position of the batches the steps consumed (the prefetch thread reads ahead of them)."""
    return {**run.loader.state_dict(), **(run.step.position or {})}


def _interrupted(run: Run) -> str:
    return f"interrupted at step {run.done} of {run.total}; " + (
        f"the last complete checkpoint is {run.last_ckpt}: run the same command again to resume from it"
        if run.last_ckpt
        else "no checkpoint was saved: run the same command again to start over"
    )


def _disk_full(cfg: TrainConfig, run: Run, e: Exception) -> str:
    return f"{e}: the disk holding {cfg.output_dir} is probably full; training stopped at step {run.done} and " + (
        f"the last complete checkpoint {run.last_ckpt} is intact: free disk space there and run the same command "
        f"again to resume from it"
        if run.last_ckpt
        else "no checkpoint was saved: free disk space there and run the same command again"
    )


def _ema_files(run: Run, rank: int) -> dict[str, bytes]:
    """This rank's EMA shard for the checkpoint folder (tensors only: safetensors, with its step and checksum)."""
    if run.ema is None:
        return {}
    from fluxzero.train.ema import shard_file, shard_name

    return {shard_name(rank): shard_file(run.ema, run.done)}


# ---------------------------------------------------------------------------------------------------------
# Entry
# ---------------------------------------------------------------------------------------------------------
OOM_HINT = (
    "out of GPU memory; lower train_micro_batch_size_per_gpu (raise gradient_accumulation_steps to keep "
    "the batch), checkpoint more blocks (fluxzero.activation_checkpointing.every_k_blocks: 1), use ZeRO-3 "
    "or CPU offload, and check the plan with `fluxzero estimate`"
)
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch.OutOfMemoryError: 2.5+


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        if os.environ.get("RANK", "0") != "0":  # every rank has the same command line: rank 0 says what is wrong
            self.exit(2)
        super().error(message)


def parse_args(argv):
    p = _Parser(prog="launch/train.py", description="Fine-tune FLUX.1 with DeepSpeed.")
    p.add_argument("--config", required=True, help="YAML run file (see launch/tiny.yaml)")
    p.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        default=None,
        help="set by the deepspeed launcher; ignored (LOCAL_RANK is read from the environment)",
    )
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="run-file overrides, e.g. steps=50 flow.shift=none"
    )
    args, unknown = p.parse_known_args(argv)
    flags = [a for a in unknown if a.startswith("--")]
    if flags:  # `--steps 50`: say how run-file settings are overridden
        p.error(f"unrecognized argument {flags[0]}; run-file settings are overridden as {override_key(flags[0])}=VALUE")
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


_calls = itertools.count()  # main() calls of this process, the same count on every rank


def main(argv=None) -> int:  # noqa: C901
    args = parse_args(sys.argv[1:] if argv is None else argv)
    distributed.quiet_other_ranks()  # before DeepSpeed's import, which already warns
    from fluxzero.data import DataError
    from fluxzero.model.layouts import WeightsError

    owns_group = not dist.is_initialized()  # leave a caller's process group alone
    call = next(_calls)
    debug = bool(os.environ.get("FLUXZERO_DEBUG"))
    # SIGTERM (launchers, Kubernetes, Slurm before a kill) and SIGUSR1 (Slurm's --signal): during the loop,
    # checkpoint at the next step boundary and leave; before it, stop as on Ctrl-C (nothing to save yet).
    old_handlers = distributed.install_stop_handlers()
    try:
        distributed.init_distributed()  # first: an error of the run file is then reported once, not per rank
        overrides, allow = split_allow(args.overrides)
        train(load_config(args.config, overrides), allow_config_change=allow)
        return 0
    except distributed.Stopped as e:
        if distributed.current_rank() == 0:  # every rank stopped at the same step: one line
            distributed.write_error(f"stopped: {e}")
        return 143  # 128 + SIGTERM, as a process ended by it: a scheduler's requeue logic expects that
    except Interrupted as e:
        if debug:
            raise
        if distributed.current_rank() == 0:  # every rank got the Ctrl-C: one line, not one per rank
            distributed.write_error(f"error: {e}")
        return 130
    except KeyboardInterrupt:
        distributed.ignore_stop_signals()
        if debug:
            raise
        if distributed.current_rank() == 0:
            distributed.write_error("error: interrupted before training started; nothing was saved")
        return 130
    except (TrainingError, DataError, WeightsError, ConfigError) as e:
        if debug:
            raise
        distributed.report(str(e), call)
    except OUT_OF_MEMORY:
        distributed.report(OOM_HINT, call)
    except RuntimeError as e:
        if debug or not distributed.peer_stopped(e):
            raise
        if distributed.current_rank() == 0:  # the rank that stopped printed why (before it exited)
            distributed.write_error(
                "error: another rank stopped (its error is above; if there is none, it was killed: see the "
                "launcher's output and the system log for out-of-memory kills)"
            )
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
        distributed.restore_handlers(old_handlers)
    return 1
