"""Which activation-checkpointing implementation works under ZeRO-3, with and without CPU parameter offload.

    PYTHONPATH=. python3 benchmarks/ckpt_zero3.py                       # flux-tiny, all visible GPUs
    PYTHONPATH=. python3 benchmarks/ckpt_zero3.py --model flux-dev-lite --res 512 --steps 4

For each of ZeRO-3 and ZeRO-3 + CPU parameter/optimizer offload, trains the same steps (same init, data and
noise) with no checkpointing and with every block checkpointed by `torch` (torch.utils.checkpoint, non-reentrant)
and `deepspeed` (deepspeed.checkpointing). A variant "works" when it runs and its losses match the
no-checkpointing run of the same stage (recomputation repeats the forward kernels, so only backward nondeterminism
separates them). Each case is the trainer's own run: `fluxzero.train.loop.setup` builds the loader, engine and
TrainStep as train() does, and every step is `run.step()`. Reports status, max relative loss difference, median
step time and peak GPU memory; writes $OUT/ckpt_zero3.json (or --out; its "meta" holds the start time in UTC and
the versions of Python, torch, deepspeed, CUDA and the code). One fresh process group per case (spawn).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # provenance, also when this file is loaded by path

import provenance  # noqa: E402 - needs the line above

CASES = [(off, impl) for off in (False, True) for impl in ("none", "torch", "deepspeed")]


def ds_config(offload: bool, impl: str, world: int, precision: str) -> dict:
    import torch

    zero = {"stage": 3}
    if offload:
        pin = torch.cuda.is_available()  # page-locked memory only matters for GPU transfers
        zero.update(offload_param={"device": "cpu", "pin_memory": pin},
                    offload_optimizer={"device": "cpu", "pin_memory": pin})
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
          "gradient_clipping": 1.0, "steps_per_print": 10**9, "zero_force_ds_cpu_optimizer": False,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0, "torch_adam": True}},
          "zero_optimization": zero,
          "fluxzero": {"activation_checkpointing": {"every_k_blocks": 0 if impl == "none" else 1,
                                                    "implementation": "torch" if impl == "none" else impl}}}
    if precision == "bf16":
        ds["bf16"] = {"enabled": True}
    return ds


def worker(rank, world, port, args, offload, impl, result_path):
    """One rank of one case: the trainer's loop.setup (DeepSpeed config view, loader, engine, TrainStep) and
    `args.steps` calls of run.step(), each timed between synchronisations."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from fluxzero.config import TrainConfig, get_model_config
    from fluxzero.train import distributed, locks, loop

    mc = get_model_config(args.model)
    hw = args.res // 8
    tmp = tempfile.mkdtemp(prefix="ckptz3-")
    ds_path = Path(tmp) / "ds.json"
    ds_path.write_text(json.dumps(ds_config(offload, impl, world, args.precision)))
    cfg = TrainConfig(deepspeed=str(ds_path), data=f"synthetic:n={world * args.steps},hw={hw}x{hw},txt={args.txt},"
                      f"ctx={mc.context_in_dim},vec={mc.vec_in_dim}", output_dir=str(Path(tmp) / "run"),
                      model=args.model, steps=args.steps, checkpoint={"resume": False},
                      export={"format": None})  # precision is the DeepSpeed config's (ds_config above)
    rec = {"offload": offload, "impl": impl, "status": "ok", "losses": [], "step_s": []}
    try:
        rank, world, device = distributed.init_distributed()
        run = loop.setup(cfg, rank, world, device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.steps):
            sync()
            t0 = time.perf_counter()
            r = run.step()  # its loss: the mean over ranks
            sync()
            rec["step_s"].append(time.perf_counter() - t0)
            rec["losses"].append(r.loss)
        if device.type == "cuda":
            rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except Exception as e:  # a failing variant is a result, not a crash of the benchmark
        rec.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    finally:
        locks.release_output_dir()
    if rank == 0:
        Path(result_path).write_text(json.dumps(rec))
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="flux-tiny")
    p.add_argument("--res", type=int, default=512, help="image side in pixels (latent side = res / 8)")
    p.add_argument("--txt", type=int, default=64, help="T5 tokens")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="fp32")
    p.add_argument("--gpus", type=int, default=0, help="ranks (default: all visible GPUs, or 2 CPU ranks)")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/ckpt_zero3.json)")
    p.add_argument("--cases", default="", help="subset, e.g. 'offload:none,offload:torch' (plain|offload:none|torch|deepspeed)")
    args = p.parse_args(argv)
    started = provenance.stamp()
    import torch
    import torch.multiprocessing as mp

    world = args.gpus or (torch.cuda.device_count() or 2)
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "ckpt_zero3.json")
    rows = []
    wanted = {tuple(c.split(":")) for c in args.cases.split(",") if c}
    cases = [(o, i) for o, i in CASES if not wanted or ("offload" if o else "plain", i) in wanted]
    for offload, impl in cases:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        res = Path(tempfile.mkdtemp()) / "r.json"
        try:
            mp.spawn(worker, args=(world, port, args, offload, impl, str(res)), nprocs=world, join=True)
            rec = json.loads(res.read_text())
        except Exception as e:
            rec = {"offload": offload, "impl": impl, "status": "crashed", "error": str(e)[:300], "losses": []}
        rows.append(rec)
        print(f"  done: offload={offload} impl={impl} status={rec['status']}", flush=True)
    for rec in rows:
        base = next((r for r in rows if r["offload"] == rec["offload"] and r["impl"] == "none"), {"status": "-"})
        if rec["status"] == "ok" and base["status"] == "ok" and rec["impl"] != "none":
            rec["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(rec["losses"], base["losses"]))
    meta = {"model": args.model, "res": args.res, "txt": args.txt, "steps": args.steps, "precision": args.precision,
            "world": world, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "date": started,
            "versions": {**provenance.versions("torch", "deepspeed"), "cuda": torch.version.cuda}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\n{meta}\n| ZeRO-3 | checkpointing | status | max rel loss diff | median step s | peak GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        med = statistics.median(r["step_s"][1:] or r["step_s"]) if r.get("step_s") else float("nan")
        print(f"| {'param+opt offload' if r['offload'] else 'plain'} | {r['impl']} | {r['status']} "
              f"{r.get('error', '')} | {r.get('max_rel_loss_diff', '-')} | {med:.3f} | {r.get('peak_gib', '-')} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
