"""Training entry: `main(argv)` parses the run file and overrides, `train(cfg)` runs the loop.

    python launch/train.py --config launch/tiny.yaml [key=value ...]
    torchrun --nproc_per_node 2 launch/train.py --config launch/tiny.yaml steps=20 flow.shift=none
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import signal
import sys
import time
import warnings
from pathlib import Path


def _quiet_other_ranks() -> None:
    """Ranks other than 0 print errors only: DeepSpeed warns once per rank ("Setting accelerator to CPU", ...)
    and every rank would repeat rank 0's Python warnings. FLUXZERO_DEBUG=1 keeps them talking. Before
    DeepSpeed's import, which already warns."""
    if os.environ.get("RANK", "0") != "0" and not os.environ.get("FLUXZERO_DEBUG"):
        logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
        warnings.filterwarnings("ignore")


_quiet_other_ranks()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import yaml  # noqa: E402

from fluxzero.train import engine as ds_engine  # noqa: E402
from fluxzero.train import flow  # noqa: E402
from fluxzero.config import TrainConfig, get_model_config  # noqa: E402
from fluxzero.data import DataError, build_dataloader  # noqa: E402
from fluxzero.train.metrics import LogWriteError, Metrics  # noqa: E402
from fluxzero.model.math import set_attention_backend  # noqa: E402


# ---------------------------------------------------------------------------------------------------------
# Run file
# ---------------------------------------------------------------------------------------------------------
def _parse_value(text: str):
    return yaml.safe_load(text) if text.strip() else ""


class ConfigError(ValueError):
    """The run file or its overrides are invalid; the message names the key and the fix."""


class Interrupted(ds_engine.TrainingError):
    """Ctrl-C (SIGINT) during training; the message names the checkpoint a rerun resumes from."""


def load_config(path: str | None, overrides: list[str] = ()) -> TrainConfig:
    """YAML run file + `key=value` overrides (dotted keys for sections, e.g. flow.shift=none)."""
    try:
        return _load_config(path, overrides)
    except ConfigError:
        raise
    except ValueError as e:  # TrainConfig / FlowConfig validation
        raise ConfigError(str(e)) from None


def _load_config(path, overrides) -> TrainConfig:
    data = {}
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"run file {path} does not exist") from None
        except UnicodeDecodeError:
            raise ConfigError(f"run file {path} is not a text file; pass a YAML run file such as "
                              f"launch/tiny.yaml") from None
        except OSError as e:
            raise ConfigError(f"cannot read run file {path} ({e.strerror or e}); pass a YAML run file such as "
                              f"launch/tiny.yaml") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"run file {path} is not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"run file {path} must be a mapping of settings")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like key=value")
        *parents, leaf = key.strip().split(".")
        node = data
        for i, p in enumerate(parents):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parents[:i + 1])} is a value, not a section; "
                                  f"write {'.'.join(parents[:i + 1])}=VALUE")
        node[leaf] = _parse_value(value)
    return TrainConfig.from_dict(data)


def config_text(cfg: TrainConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


# ---------------------------------------------------------------------------------------------------------
# Loop
# ---------------------------------------------------------------------------------------------------------
def _batches(loader):
    """(epoch, batch) forever, continuing from the loader's (possibly restored) position."""
    epoch = loader.epoch
    while True:
        loader.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch
        epoch += 1


def _mean_across_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def train(cfg: TrainConfig, allow_config_change: bool = False) -> dict:
    """Train as configured; returns {"losses": [...], "step", "checkpoint", "export"}.

    allow_config_change: resume a checkpoint although data, grad_accum or flow options changed (see
    _check_output_dir); the new values are saved with the next checkpoint.
    """
    rank, world, device = ds_engine.init_distributed()
    set_attention_backend(cfg.attention)
    ds, ours = ds_engine.load_ds_config(cfg.deepspeed, cfg, world)
    model_cfg = get_model_config(cfg.model)
    loader = build_dataloader(cfg.data, micro_batch=cfg.micro_batch, rank=rank, world_size=world, seed=cfg.seed,
                              num_workers=cfg.num_workers, pin_memory=device.type == "cuda",
                              # forked workers can hang once DeepSpeed's threads and process group exist
                              multiprocessing_context="spawn" if cfg.num_workers else None)
    loader.check_model(model_cfg)
    total = cfg.total_steps(len(loader))
    stop = min(total, cfg.stop_after) if cfg.stop_after else total
    ckpt_dir = Path(cfg.output_dir) / "checkpoints"
    _check_output_dir_all_ranks(cfg, ckpt_dir, ds, allow_config_change)
    engine = ds_engine.build_engine(cfg, ds, ours, model_cfg, device)
    state = ds_engine.load_checkpoint(engine, ckpt_dir) if cfg.resume else None
    if state:
        loader.load_state_dict(state["loader"], allow_data_change=allow_config_change)
    step = state["step"] if state else 0
    # the last complete checkpoint, as this process knows it (rank 0 chose the resumed one for every rank;
    # re-reading `latest` here could see another node's disk)
    last_ckpt = str(ckpt_dir / f"step_{step:08d}") if state else None
    own_schedule = "scheduler" not in ds  # otherwise DeepSpeed's scheduler drives the lr
    base_lr = ds["optimizer"].get("params", {}).get("lr", 1e-3)
    dtype = ds_engine.param_dtype(ds)
    batches = _batches(loader)

    def save():
        nonlocal last_ckpt
        last_ckpt = ds_engine.save_checkpoint(engine, ckpt_dir, step, {"step": step, "loader": loader.state_dict()},
                                              config_text(cfg), {**ds, "fluxzero": ours},
                                              keep=cfg.keep_checkpoints)

    losses, saved_step, result, metrics = [], step if state else None, {}, None
    try:
        metrics = Metrics(cfg.output_dir, rank, world, device, total, step, cfg.global_batch(world),
                          model_cfg.flops_per_sample, dtype)
        while step < stop:  # lr -> batch -> forward -> loss -> backward -> step -> log -> checkpoint
            metrics.step_started()
            if own_schedule:
                ds_engine.set_lr(engine, base_lr * cfg.lr_factor(step, total))
            lr = engine.get_lr()[0]  # the lr of this step (DeepSpeed's scheduler moves on in engine.step)
            loss, inputs = _forward_backward(engine, batches, cfg, model_cfg.guidance_embed, device, dtype)
            if not math.isfinite(loss):
                raise ds_engine.TrainingError(
                    f"loss is {loss} at step {step + 1}; stopped before applying that update and without "
                    f"saving (last checkpoint: {last_ckpt or 'none'}); lower the lr, "
                    f"raise gradient clipping or check the data")
            engine.step()
            step += 1
            losses.append(loss)
            norm = engine.get_global_grad_norm()
            metrics.log(step, loss, lr, None if norm is None else float(norm), engine.skipped_steps,
                        img_tokens=inputs["img"].shape[1], txt_tokens=inputs["txt"].shape[1],
                        log=step % cfg.log_every == 0 or step == stop)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < stop:
                save()
                saved_step = step
        if saved_step != step:
            save()
        metrics.close()  # the last TensorBoard points reach the disk, or the error says they did not
        result = {"losses": losses, "step": step, "checkpoint": last_ckpt}
        # every rank is done with collectives: meet once more so that none tears its process group down
        # while another still has messages in flight, then only rank 0 exports (the others leave)
        ds_engine.barrier()
        if cfg.export_format and step >= total:
            result["export"], result["exported"] = _export(cfg, ckpt_dir, rank)
    except KeyboardInterrupt:
        _ignore_stop_signals()  # a second Ctrl-C, or the launcher's SIGTERM, must not cut the cleanup short
        raise Interrupted(f"interrupted at step {step} of {total}; " + (
            f"the last complete checkpoint is {last_ckpt}: run the same command again to resume from it"
            if last_ckpt else "no checkpoint was saved: run the same command again to start over")) from None
    except LogWriteError as e:  # rank 0 only: a full disk outside checkpoint saving
        raise ds_engine.TrainingError(
            f"{e}: the disk holding {cfg.output_dir} is probably full; training stopped at step {step} and " + (
                f"the last complete checkpoint {last_ckpt} is intact: free disk space there and run the "
                f"same command again to resume from it" if last_ckpt else
                "no checkpoint was saved: free disk space there and run the same command again")) from None
    finally:
        if metrics is not None:
            metrics.close(strict=False)
        engine.destroy()
    if rank == 0:
        _write_line(f"done: step {step}/{total}, checkpoint {result['checkpoint']}"
                    + (f", export {result['export']}" if "export" in result else "")
                    + ("" if result.get("exported", True) else " (up to date: not written again)"))
    return result


# Settings a resume must keep, because they change what the next steps compute. Others (steps, epochs,
# stop_after, the lr schedule, logging, checkpointing, export, attention kernel, workers) may change: extending
# a run or logging more often is common.
FIXED_ON_RESUME = ("micro_batch", "seed")  # the loader's saved position means other samples under others
SAME_ON_RESUME = ("data", "grad_accum") + tuple(f"flow.{f}" for f in (
    "timestep_sampling", "logit_mean", "logit_std", "shift", "shift_value", "guidance"))


def _check_output_dir_all_ranks(cfg: TrainConfig, ckpt_dir: Path, ds: dict | None = None,
                                allow_config_change: bool = False) -> None:
    """Every rank checks it can write output_dir; rank 0 alone judges the checkpoints there (`latest` as
    another node sees it could differ) and every rank stops with the same sentence when any check failed."""
    def problem(check) -> str | None:
        try:
            check()
        except ds_engine.TrainingError as e:
            return str(e)
        return None

    mine = problem(lambda: _check_writable(Path(cfg.output_dir)))
    if mine is None and dist.get_rank() == 0:
        mine = problem(lambda: _check_output_dir(cfg, ckpt_dir, ds, allow_config_change))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    first = next((p for p in every if p), None)
    if first:
        raise ds_engine.TrainingError(first)


def _check_writable(out: Path) -> None:
    try:  # fail here, in one sentence, rather than deep inside TensorBoard or DeepSpeed's save
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".fluxzero-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ds_engine.TrainingError(f"cannot write to output_dir {out} ({e.strerror or e}); choose a writable "
                                      f"output_dir") from None


def _check_output_dir(cfg: TrainConfig, ckpt_dir: Path, ds: dict | None = None,
                      allow_config_change: bool = False) -> None:
    """Never train over someone else's checkpoints: resume only a run of the same model and training
    settings, never overwrite."""
    tag = ds_engine.latest_tag(ckpt_dir)
    if tag is None:
        return
    if not cfg.resume:
        raise ds_engine.TrainingError(f"{ckpt_dir} already holds checkpoints (latest {tag}) and resume is off; "
                                      f"choose another output_dir or set resume: true")
    saved = _saved_run(ckpt_dir / tag / "run.yaml")
    model = saved.get("model")
    if model and model != cfg.model:
        raise ds_engine.TrainingError(f"{ckpt_dir / tag} is a checkpoint of {model} but the run file trains "
                                      f"{cfg.model}; choose another output_dir")
    _check_same_training(cfg, saved, ckpt_dir / tag, allow_config_change)
    saved_ds = ckpt_dir / tag / "ds_config.json"
    if ds is not None and saved_ds.is_file() and cfg.resume:
        try:
            old = json.loads(saved_ds.read_text())
            stage, dtype = ds_engine.zero_stage(old), ds_engine.param_dtype(old)
        except (ValueError, TypeError, AttributeError):
            stage = dtype = None
        if stage is not None and stage != ds_engine.zero_stage(ds):
            # DeepSpeed's loader fails with a bare assertion deep inside when the partitioning differs
            raise ds_engine.TrainingError(
                f"{ckpt_dir / tag} was written under ZeRO stage {stage} but {cfg.deepspeed} uses stage "
                f"{ds_engine.zero_stage(ds)}; resume with a stage-{stage} DeepSpeed config, or choose another "
                f"output_dir (DeepSpeed's ds_to_universal converts between layouts)")
        if dtype is not None and dtype != ds_engine.param_dtype(ds):  # DeepSpeed names its files per precision
            names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
            raise ds_engine.TrainingError(
                f"{ckpt_dir / tag} was written in {names[dtype]} but {cfg.deepspeed} trains in "
                f"{names[ds_engine.param_dtype(ds)]}; resume in {names[dtype]}, or choose another output_dir")


def _saved_run(path: Path) -> dict:
    """The run.yaml saved beside a checkpoint ({} when there is none)."""
    fix = "it records the settings the checkpoint was trained with: repair it, or choose another output_dir"
    try:
        saved = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return {}
    except yaml.YAMLError as e:
        raise ds_engine.TrainingError(f"{path} is not valid YAML ({str(e).splitlines()[0]}); {fix}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ds_engine.TrainingError(f"cannot read {path} ({getattr(e, 'strerror', None) or e}); {fix}") from None
    if not isinstance(saved, dict):
        raise ds_engine.TrainingError(f"{path} is not a mapping of settings; {fix}")
    return saved


def _setting(d: dict, key: str):
    """A dotted key of a run-file dict (flow.shift), or None when absent."""
    *parents, leaf = key.split(".")
    for p in parents:
        d = d.get(p) if isinstance(d.get(p), dict) else {}
    return d.get(leaf)


def _check_same_training(cfg: TrainConfig, saved: dict, ckpt: Path, allow_config_change: bool) -> None:
    """Refuse to continue a checkpoint under settings that change what is trained, in one sentence naming
    each field with both values; data, grad_accum and flow options may change with allow_config_change."""
    now = cfg.to_dict()

    def changed(keys):
        return [k for k in keys if _setting(saved, k) is not None  # an older run.yaml may lack a key
                and _setting(saved, k) != _setting(now, k)
                and not (k == "data" and _same_path(_setting(saved, k), _setting(now, k)))]

    for keys, fix in ((FIXED_ON_RESUME, "resume with the checkpoint's values, or choose another output_dir"),
                      (() if allow_config_change else SAME_ON_RESUME,
                       "resume with the checkpoint's values, choose another output_dir, or add "
                       "allow_config_change=true to the command line to continue this checkpoint with the new ones")):
        if diff := changed(keys):
            raise ds_engine.TrainingError(
                f"{ckpt} was trained with {', '.join(f'{k}={_setting(saved, k)}' for k in diff)} but this run "
                f"has {', '.join(f'{k}={_setting(now, k)}' for k in diff)}; {fix}")


def _same_path(a, b) -> bool:
    """Two spellings of one shard folder (relative and absolute, or through a link)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, TypeError, ValueError):
        return False


def _forward_backward(engine, batches, cfg: TrainConfig, guidance_embed: bool, device, dtype) -> tuple[float, dict]:
    """batch -> forward -> loss -> backward for each micro batch of one optimizer step, but the last
    engine.step(): the caller applies the update only once the loss (mean over ranks and micro batches)
    is known to be finite. Returns (that loss, the last inputs)."""
    loss_sum = torch.zeros((), device=device)
    for micro in range(cfg.grad_accum):
        epoch, batch = next(batches)
        inputs, target = flow.prepare_batch(batch, cfg.flow, cfg.seed, epoch, guidance_embed=guidance_embed,
                                            device=device, dtype=dtype)
        pred = engine(**inputs)  # (B, L_img, 64)
        loss = flow.loss(pred, target)
        engine.backward(loss)
        loss_sum += loss.detach()
        if micro < cfg.grad_accum - 1:
            engine.step()  # inside accumulation: DeepSpeed only counts the micro step
    return _mean_across_ranks(loss_sum) / cfg.grad_accum, inputs


def _export(cfg: TrainConfig, ckpt_dir: Path, rank: int) -> tuple[str, bool]:
    """Export the final checkpoint on rank 0; returns (path, whether it was written): an export newer than
    the checkpoint, in the same layout and dtype, is left as it is (a rerun of a finished run does nothing)."""
    out = Path(cfg.output_dir) / ("export" if cfg.export_format == "diffusers" else "export.safetensors")
    # The other ranks do not wait for it: an export of FLUX.1-dev can outlast the collectives' timeout
    # (DeepSpeed's default is 10 minutes), and they have nothing left to do. The caller met them at a barrier.
    if rank != 0:
        return str(out), False
    try:
        if _export_is_current(out, ckpt_dir / "latest", cfg.export_format, cfg.export_dtype):
            return str(out), False
        ds_engine.export_checkpoint(ckpt_dir, out, cfg.export_format, cfg.export_dtype)
    except ds_engine.TrainingError as e:
        raise ds_engine.TrainingError(f"{e} (training finished and is saved: `fluxzero export {cfg.output_dir} "
                                      f"OUT` writes it again)") from None
    return str(out), True


def _diffusers_files(folder: Path) -> list[Path]:
    """The weight files of a complete diffusers export, [] when it is incomplete: the index is written last,
    so shards without it are an export that stopped midway."""
    from fluxzero.model.weights import DIFFUSERS_INDEX, DIFFUSERS_WEIGHTS

    index = folder / DIFFUSERS_INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
        return files if files and all(f.is_file() for f in files) else []
    single = folder / DIFFUSERS_WEIGHTS
    return [single] if single.is_file() and not list(folder.glob("diffusion_pytorch_model-*")) else []


def _export_is_current(out: Path, latest: Path, layout: str, dtype: str) -> bool:
    """`out` was written after the checkpoint `latest` names, in this layout and dtype (read from the
    safetensors header: tensor dtypes, and ComfyUI's key prefix; diffusers is the folder)."""
    from fluxzero.model.weights import COMFY_PREFIX

    try:
        files = _diffusers_files(out) if layout == "diffusers" else [out]
        if not files or any(f.stat().st_mtime < latest.stat().st_mtime for f in files):
            return False
        with open(files[0], "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
        comfy = any(k.startswith(COMFY_PREFIX) for k in header)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):  # missing, a folder, not safetensors
        return False
    want = {"bf16": "BF16", "fp32": "F32"}[dtype]
    return dtypes == {want} and comfy == (layout == "comfyui")


# ---------------------------------------------------------------------------------------------------------
# Entry
# ---------------------------------------------------------------------------------------------------------
OOM_HINT = ("out of GPU memory; lower micro_batch (raise grad_accum to keep the batch), checkpoint more "
            "blocks (fluxzero.activation_checkpointing.every_k_blocks: 1), use ZeRO-3 or CPU offload, and "
            "check the plan with `fluxzero estimate`")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        if os.environ.get("RANK", "0") != "0":  # every rank has the same command line: rank 0 says what is wrong
            self.exit(2)
        super().error(message)


def parse_args(argv):
    p = _Parser(prog="launch/train.py", description="Fine-tune FLUX.1 with DeepSpeed.")
    p.add_argument("--config", required=True, help="YAML run file (see launch/tiny.yaml)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help="set by the deepspeed launcher; ignored (LOCAL_RANK is read from the environment)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="run-file overrides, e.g. steps=50 flow.shift=none")
    args, unknown = p.parse_known_args(argv)
    flags = [a for a in unknown if a.startswith("--")]
    if flags:  # `--steps 50`: say how run-file settings are overridden
        name = flags[0].lstrip("-").split("=")[0].replace("-", "_")
        p.error(f"unrecognized argument {flags[0]}; run-file settings are overridden as {name}=VALUE")
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _split_allow(overrides: list[str]) -> tuple[list[str], bool]:
    """allow_config_change=true|false is a switch for this one start, not a run-file setting: it is never
    saved with a checkpoint, so the next resume checks against the new values again."""
    rest, allow = [], False
    for item in overrides:
        key, sep, value = item.partition("=")
        if key.strip() != "allow_config_change" or not sep:
            rest.append(item)
            continue
        allow = _parse_value(value)
        if not isinstance(allow, bool):
            raise ConfigError(f"allow_config_change must be true or false, got {value!r}")
    return rest, allow


_calls = itertools.count()  # main() calls of this process, the same count on every rank


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from fluxzero.model.weights import WeightsError

    owns_group = not dist.is_initialized()  # leave a caller's process group alone
    call = next(_calls)
    debug = bool(os.environ.get("FLUXZERO_DEBUG"))
    # Launchers answer Ctrl-C by sending SIGTERM to every rank (DeepSpeed's launch.py, torchrun): stop the
    # same way as on Ctrl-C (cleanly, with the checkpoint to resume from) instead of dying mid-line.
    old_term = _on_sigterm(_raise_interrupt)
    try:
        ds_engine.init_distributed()  # first: an error of the run file is then reported once, not per rank
        overrides, allow = _split_allow(args.overrides)
        train(load_config(args.config, overrides), allow_config_change=allow)
        return 0
    except Interrupted as e:
        if debug:
            raise
        if _rank() == 0:  # every rank got the Ctrl-C: one line, not one per rank
            _write_line(f"error: {e}")
        return 130
    except KeyboardInterrupt:
        _ignore_stop_signals()
        if debug:
            raise
        if _rank() == 0:
            _write_line("error: interrupted before training started; nothing was saved")
        return 130
    except (ds_engine.TrainingError, DataError, WeightsError, ConfigError) as e:
        if debug:
            raise
        _report(str(e), call)
    except OUT_OF_MEMORY:
        _report(OOM_HINT, call)
    except RuntimeError as e:
        if debug or not ds_engine.peer_stopped(e):
            raise
        if _rank() == 0:  # the rank that stopped printed why (before it exited, which broke this collective)
            _write_line("error: another rank stopped (see its error above)")
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
        _on_sigterm(old_term)
    return 1


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _on_sigterm(handler):
    """Install a SIGTERM handler (main thread only; elsewhere signals cannot be set); returns the old one."""
    import threading

    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)


def _ignore_stop_signals() -> None:
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


# ---------------------------------------------------------------------------------------------------------
# Errors: one line each, once
# ---------------------------------------------------------------------------------------------------------
ERROR_WAIT_S = 5.0  # how long ranks compare their errors before printing (and exiting)
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch.OutOfMemoryError: 2.5+


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _write_line(text: str) -> None:
    """One write call per message, newline included: lines of ranks sharing a terminal never run together."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _report(msg: str, call: int) -> None:
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
    rank = _rank()
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or not dist.is_initialized():
        _write_line(f"\n[rank {rank}] error: {msg}" if rank else f"error: {msg}")
        return
    if rank == 0:
        _write_line(f"error: {msg}")
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
        _write_line(f"\n[rank {rank}] error: {msg}")


def _posted(store, keys: list[str]) -> bool:
    """Whether all `keys` appear in the store within ERROR_WAIT_S (polled: store.wait logs its timeouts)."""
    deadline = time.monotonic() + ERROR_WAIT_S
    while not store.check(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
