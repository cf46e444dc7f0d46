"""Gradient release (optimizer step fused into backward) inside a DeepSpeed engine at ZeRO stage 0.

python benchmarks/archive/grad_release_probe.py [--ranks 2] [--gas 1]
Each parameter gets its own optimizer, stepped by a post-accumulate-grad hook that then frees the grad
(p.grad = None). The engine is built with the same parameters and gradient_clipping 0. Prints, per rank:
how many grads exist, and how many are non-zero, after each engine.backward (DeepSpeed's allreduce re-creates them), the number of hook
steps, and how far the weights are from the ordinary path (engine.backward + engine.step with one optimizer)
and from rank 0. Findings are written up in fluxzero/train/optim/optimizers.py (GRADIENT RELEASE).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine(fused: bool, gas: int, clip: float):
    import deepspeed
    import torch

    from fluxzero.train.optim.optimizers import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }
    hook_steps = [0]
    if fused:
        per_param = {p: build_optimizer([p], "fp32", lr=1e-2) for p in model.parameters()}

        def release(p):
            per_param[p].step()
            p.grad = None  # the point of gradient release: no full set of grads ever exists
            hook_steps[0] += 1

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(release)
        # the engine refuses backward without an optimizer ("must provide optimizer during init in order to
        # use backward"); SGD at lr 0 changes nothing, whatever grads it finds
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
    else:
        opt = build_optimizer(model.parameters(), "fp32", lr=1e-2)
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return eng, hook_steps


def run(rank: int, world: int, port: int, gas: int, clip: float, q):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from fluxzero.train.distributed import init_distributed
    from fluxzero.train.engine import join_deepspeed_comm

    init_distributed()  # the trainer's own: gloo group, quiet DeepSpeed logs
    join_deepspeed_comm()  # deepspeed.comm wraps it; no CPU shm-op build
    torch.set_num_threads(1)
    out = {"rank": rank}
    weights = {}
    for fused in (False, True):
        eng, hook_steps = engine(fused, gas, clip)
        grads_after_backward = []
        for micro in range(4 * gas):
            g = torch.Generator().manual_seed(100 * rank + micro)  # each rank its own data
            x, y = torch.randn(2, 32, generator=g), torch.randn(2, 8, generator=g)
            loss = (eng(x) - y).pow(2).mean()
            eng.backward(loss)
            grads_after_backward.append(
                [
                    sum(p.grad is not None for p in eng.module.parameters()),
                    sum(p.grad is not None and bool(p.grad.any()) for p in eng.module.parameters()),
                ]
            )
            eng.step()
        weights[fused] = torch.cat([p.detach().flatten() for p in eng.module.parameters()])
        out["fused" if fused else "plain"] = {
            "grads_after_backward": grads_after_backward,
            "hook_steps": hook_steps[0],
            "engine_steps": eng.global_steps,
            "optimizer": type(eng.optimizer).__name__,
        }
    out["fused_vs_plain_max_diff"] = (weights[True] - weights[False]).abs().max().item()
    w0 = weights[True].clone()
    dist.broadcast(w0, 0)
    out["fused_vs_rank0_max_diff"] = (weights[True] - w0).abs().max().item()
    w0 = weights[False].clone()
    dist.broadcast(w0, 0)
    out["plain_vs_rank0_max_diff"] = (weights[False] - w0).abs().max().item()
    q.put(out)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--gas", type=int, default=1)
    ap.add_argument("--clip", type=float, default=0.0)
    a = ap.parse_args()
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")  # fork hangs once the parent has run DeepSpeed
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=run, args=(r, a.ranks, port, a.gas, a.clip, q)) for r in range(a.ranks)]
    for p in procs:
        p.start()
    rows = sorted((q.get(timeout=300) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    for r in rows:
        print(json.dumps({"ranks": a.ranks, "gas": a.gas, "clip": a.clip, **r}))


if __name__ == "__main__":
    main()
