"""Host time of one LoRA optimizer step (engine.step()), where compute is negligible: FLUX.1-dev's structure
(19 double + 38 single blocks, all-linear adapters: the same 608 LoRA tensors) at tiny widths.

    PYTHONPATH=. OMP_NUM_THREADS=1 python3 benchmarks/archive/lora_step_host.py --zero 2 --rank 2 --steps 30  # one process, gloo
    ... --deepspeed-loops: DeepSpeed's per-tensor checks as they were (the before); --profile F: cProfile of the steps

On the GPU (the H200 figure: 0.147 s of a 0.783 s step) an AdamW step over 76.6M values is ~1-2 ms of kernels;
the rest is Python and launch overhead that scales with the number of tensors, not their size, so this model
shows it on a CPU: each timed step runs forward + backward on a 16-token input, then times TrainStep's update
part (fluxzero's own norm/reduction, then engine.step()). Median of --steps. On a GPU the same script times
the update from a synchronized start to its last kernel (one process, the same command). Figures: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fluxzero.config import get_model_config
from fluxzero.config.deepspeed.view import view
from fluxzero.config.lora import LoraConfig
from fluxzero.train.distributed import init_distributed

# FLUX.1-dev's block structure and linears, widths divided so that compute disappears
SHAPE = get_model_config("flux-dev").replace(
    name="flux-dev-structure", hidden_size=64, num_heads=4, axes_dim=(4, 6, 6), context_in_dim=64, vec_in_dim=32
)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active; ops they call inside are not counted (the mode is off there),
    so a multi-tensor op such as _foreach_norm counts once, as it launches one or a few kernels on CUDA."""

    def __init__(self):
        super().__init__()
        self.count, self.names, self.inner = 0, collections.Counter(), 0
        self.in_inner_step = False  # inside the inner optimizer's own step (torch AdamW)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.inner += self.in_inner_step
        self.names[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def around(self, step):
        """`step` (the inner optimizer's) with its ops counted apart: on a CPU torch AdamW takes its per-tensor
        path, where CUDA runs one fused kernel, so the wrapper's own ops are the total less these."""

        def counted(*a, **k):
            self.in_inner_step = True
            try:
                return step(*a, **k)
            finally:
                self.in_inner_step = False

        return counted


def ds_config(stage: int, bf16: bool) -> dict:
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        # fused on a GPU, as gen-config writes it there
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "fused": torch.cuda.is_available()}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    if bf16:
        ds["bf16"] = {"enabled": True}
    return ds


def inputs(cfg, dtype):
    g = torch.Generator().manual_seed(0)
    img = torch.randn(1, 16, cfg.in_channels, generator=g, dtype=dtype)
    txt = torch.randn(1, 8, cfg.context_in_dim, generator=g, dtype=dtype)
    return dict(
        img=img,
        img_ids=torch.zeros(1, 16, 3),
        txt=txt,
        txt_ids=torch.zeros(1, 8, 3),
        timesteps=torch.full((1,), 0.5, dtype=dtype),
        y=torch.randn(1, cfg.vec_in_dim, generator=g, dtype=dtype),
        guidance=torch.full((1,), 3.5, dtype=dtype),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--fp32", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--profile")
    ap.add_argument(
        "--count-ops",
        action="store_true",
        help="also count the aten ops one update dispatches (one more update, under a TorchDispatchMode): "
        "a proxy for the kernels it launches on a GPU",
    )
    ap.add_argument(
        "--deepspeed-loops",
        action="store_true",
        help="leave DeepSpeed's per-tensor checks as they are (ds_patches.batch_grad_checks off): the before",
    )
    args = ap.parse_args()
    from fluxzero.train import engine as E
    from fluxzero.train.step import TrainStep

    _, world, device = init_distributed()
    if args.deepspeed_loops:
        from fluxzero.train import ds_patches

        ds_patches.batch_grad_checks = lambda optimizer: []
    ds = ds_config(args.zero, not args.fp32)
    v = view(ds)
    engine = E.build_engine(SHAPE, ds, v, device, seed=0, lora=LoraConfig(rank=args.rank, targets="all-linear"))
    params = [p for p in engine.module.parameters() if p.requires_grad]
    dtype = next(engine.module.parameters()).dtype
    x = {k: v.to(device) for k, v in inputs(SHAPE, dtype).items()}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # time the update's kernels too
    # TrainStep's update part, as it runs after the last backward
    ts = TrainStep.__new__(TrainStep)
    ts.engine, ts.world_size, ts.device = engine, world, device
    ts._own_norm = not hasattr(engine.optimizer, "_global_grad_norm")
    from fluxzero.train.distributed import sum_across_ranks

    def update():
        sq = ts._grad_norm_sq() / world if ts._own_norm else torch.zeros(())
        sum_across_ranks(torch.stack((torch.zeros(()), torch.zeros(()), sq)))
        engine.step()

    times, losses, prof = [], [], cProfile.Profile()
    for i in range(3 + args.steps):
        loss = engine(**x).float().square().mean()
        engine.backward(loss)
        losses.append(loss.item())
        if args.profile and i >= 3:
            prof.enable()
        sync()
        t0 = time.perf_counter()
        update()
        sync()
        dt = time.perf_counter() - t0
        if args.profile and i >= 3:
            prof.disable()
        if i >= 3:
            times.append(dt)
    if args.profile:
        prof.dump_stats(args.profile)
    ops = None
    if args.count_ops:
        engine.backward(engine(**x).float().square().mean())
        counter = OpCounter()
        inner = engine.optimizer.optimizer
        inner.step = counter.around(inner.step)
        with counter:
            update()
        ops = {
            "total": counter.count,
            "outside_inner_step": counter.count - counter.inner,
            "most": dict(counter.names.most_common(8)),
        }
    print(
        json.dumps(
            {
                "zero": args.zero,
                "bf16": not args.fp32,
                "batched_checks": not args.deepspeed_loops,
                "lora_tensors": len(params),
                "lora_values": sum(p.numel() for p in params),
                "step_ms": round(1e3 * statistics.median(times), 2),
                "min_ms": round(1e3 * min(times), 2),
                "aten_ops": ops,
                "losses": losses[-3:],
                "grad_norm": float(engine.get_global_grad_norm() or 0),
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
