"""What a ZeRO stage-1 rank holds for gradients, with and without overlap_comm (real DeepSpeed, CPU, gloo).

Two ranks (spawned), bf16, a stack of linears of P parameters, reduce_bucket_size well below P. After a
first full step (so fp32 masters and Adam states exist), the second step is observed: every live tensor
storage reachable from Python (params' .grad, the ZeRO optimizer's buffers) is summed, deduplicated by
storage, at three moments -- before forward; inside backward after each layer's gradients exist and after
each bucket's reduction, in backward or in its epilogue (the largest sample is kept); and after
engine.backward() returns (before engine.step()). Gradient bytes =
those sums minus the before-forward baseline, expressed in units of b P (b = 2 bytes, bf16): 1.0 means a
whole gradient copy, 1/N a partition.

    python benchmarks/archive/zero1_grad_probe.py [--out DIR]

The memory model (fluxzero/plan/model_states.py, stage-1 gradient items) and docs/memory.md's stage table state
what this measures; tests/plan/test_memory_deepspeed.py runs it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's fluxzero, run without installing

WIDTH, LAYERS, BUCKET = 1024, 8, 500_000


def live_bytes(torch) -> int:
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
                continue
            tensors = [obj] + ([obj.grad] if obj.grad is not None else [])
        except Exception:  # objects half torn down by gc
            continue
        for t in tensors:
            s = t.untyped_storage()
            if s.data_ptr() and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def worker(rank: int, world: int, port: int, overlap: bool, q) -> None:
    import warnings

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    warnings.filterwarnings("ignore")
    import deepspeed
    import torch

    from fluxzero.train.distributed import init_distributed
    from fluxzero.train.engine import join_deepspeed_comm

    init_distributed()  # the trainer's own: gloo group, quiet DeepSpeed logs
    join_deepspeed_comm()  # deepspeed.comm wraps it; no CPU shm-op build
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    P = sum(p.numel() for p in model.parameters())
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 1,
            "overlap_comm": overlap,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": BUCKET,
            "allgather_bucket_size": BUCKET,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    }
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randn(4, WIDTH, dtype=torch.bfloat16)

    opt = eng.optimizer
    reduce_ipg = opt.reduce_ipg_grads
    reduced: list[int] = []  # live bytes after each bucket's reduction (in backward or in its epilogue)

    def sampled_reduce(*a, **k):
        out = reduce_ipg(*a, **k)
        reduced.append(live_bytes(torch))
        return out

    def step(observe: bool):
        samples = []
        hooks = []
        if observe:
            reduced.clear()
            opt.reduce_ipg_grads = sampled_reduce
            for m in model:
                hooks.append(m.register_full_backward_hook(lambda *a: samples.append(live_bytes(torch))))
        loss = eng(x).float().pow(2).mean()
        eng.backward(loss)
        after = live_bytes(torch)
        for h in hooks:
            h.remove()
        opt.reduce_ipg_grads = reduce_ipg
        eng.step()
        return samples + reduced, after

    step(False)
    gc.collect()
    base = live_bytes(torch)
    samples, after = step(True)
    unit = 2 * P
    q.put(
        {
            "rank": rank,
            "overlap_comm": overlap,
            "params": P,
            "bucket": BUCKET,
            "in_backward_max_bP": (max(samples) - base) / unit,
            "after_backward_bP": (after - base) / unit,
            "bucket_bP": 2 * BUCKET / unit,
            "in_backward_bP": [round((v - base) / unit, 3) for v in samples],
        }
    )


def run(overlap: bool, world: int = 2) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, overlap, q)) for r in range(world)]
    for p in procs:
        p.start()
    rows = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = run(True) + run(False)
    for r in rows:
        print(
            f"overlap_comm={r['overlap_comm']!s:<5} rank {r['rank']}: in backward (largest) "
            f"{r['in_backward_max_bP']:.3f} b P, after backward {r['after_backward_bP']:.3f} b P "
            f"(one bucket = {r['bucket_bP']:.3f} b P)"
        )
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "zero1_grad_probe.json"), "w") as f:
            json.dump(rows, f, indent=1)
    json.dump(rows, sys.stdout)
    print()


if __name__ == "__main__":
    main()
