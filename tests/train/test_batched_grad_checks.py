"""ds_patches.batch_grad_checks: DeepSpeed's per-tensor overflow check and grad norm in one call each change nothing.
The runs with DeepSpeed's own loops set FLUXZERO_DEEPSPEED_LOOPS, the benchmarks' switch for the before.

Two ranks (gloo), a flux-tiny all-linear LoRA in bf16 at ZeRO 0, 1 and 2: the same run with DeepSpeed's own loops
and with the batched checks gives bit-identical losses, grad norms and adapters (on CPU torch._foreach_norm calls
the same per-tensor norm, so equality is exact, not a tolerance); clipping is active (a small gradient_clipping),
so the norm reaches the weights. A NaN put into one adapter's gradient on one rank at step 2 is caught by both as
an overflow: the step is skipped on both ranks and the adapters stay equal. At ZeRO-1/2 the parameters' re-pointing
after each step is skipped while nothing moved (the adapters still train: the losses change every step) and done
when the flat buffer moves. At ZeRO-0 the whole FP16_UnfusedOptimizer step is batched: bit-identical in bf16 and in
fp16 with a loss scale, and the ops it dispatches around the inner AdamW are counted (a few dozen, not ~20 per
adapter tensor).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import close_group, enter_training_rank, exit_rank, spawn_ranks, tiny_ds

STAGES = (0, 1, 2)
STEPS = 4
NAN_STEP = 2


def _inputs(cfg, rank, step, dtype):
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own batch, as data parallelism has
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return dict(
        img=r(1, 16, cfg.in_channels),
        img_ids=torch.zeros(1, 16, 3),
        txt=r(1, 8, cfg.context_in_dim),
        txt_ids=torch.zeros(1, 8, 3),
        timesteps=torch.full((1,), 0.5).to(dtype),
        y=r(1, cfg.vec_in_dim),
        guidance=torch.full((1,), 3.5).to(dtype),
    )


def _run(stage: int, batched: bool, nan: bool, fp16: bool = False) -> dict:
    import torch
    import torch.distributed as dist

    from fluxzero.config import get_model_config
    from fluxzero.config.deepspeed.view import view
    from fluxzero.config.lora import LoraConfig
    from fluxzero.train import ds_patches as P
    from fluxzero.train import engine as E

    cfg = get_model_config("flux-tiny")
    precision = {"fp16": {"enabled": True, "initial_scale_power": 8}} if fp16 else {"bf16": {"enabled": True}}
    ds = tiny_ds(stage, clipping=1e-3, lr=1e-2, train_micro_batch_size_per_gpu=1, **precision)
    dtype = torch.float16 if fp16 else torch.bfloat16
    plain, replaced = P.batch_grad_checks, []
    P.batch_grad_checks = lambda optimizer: replaced.extend(plain(optimizer))
    if not batched:  # the before: the benchmarks' switch leaves DeepSpeed's loops in place
        os.environ[E.DEEPSPEED_LOOPS_ENV] = "1"
    try:
        engine = E.build_engine(
            cfg,
            ds,
            view(ds),
            torch.device("cpu"),
            seed=5,
            lora=LoraConfig(rank=4, targets="all-linear", init="gaussian"),
        )
    finally:
        P.batch_grad_checks = plain
        os.environ.pop(E.DEEPSPEED_LOOPS_ENV, None)
    adapters = [p for p in engine.module.parameters() if p.requires_grad]
    losses, norms, checks = [], [], []
    for step in range(STEPS):
        hook = None
        if nan and step == NAN_STEP and dist.get_rank() == 1:
            hook = adapters[len(adapters) // 2].register_hook(lambda g: g * float("nan"))
        loss = engine(**_inputs(cfg, dist.get_rank(), step, dtype)).float().square().mean()
        engine.backward(loss)
        checks.append(_local_overflow(engine.optimizer, adapters))
        engine.step()
        if hook is not None:
            hook.remove()
        losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    step_ops = _update_ops(engine, cfg, dtype) if stage == 0 and not nan else None
    weights = torch.cat([p.detach().float().flatten() for p in adapters])
    repointed = None
    if hasattr(engine.optimizer, "bit16_groups_flat"):  # ZeRO-1/2: a moved flat buffer is re-pointed, not skipped
        flat = engine.optimizer.bit16_groups_flat[0]
        flat.data = flat.data.clone()  # as DeepSpeed's offload_states / reload_states move it
        engine.optimizer._update_model_bit16_weights(0)
        lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
        repointed = all(lo <= p.data_ptr() < hi for p in engine.optimizer.bit16_groups[0])
    out = {
        "losses": losses,
        "norms": norms,
        "checks": checks,
        "skipped": int(engine.skipped_steps),
        "replaced": replaced,
        "optimizer": type(engine.optimizer).__name__,
        "weights": weights.tolist(),
        "finite": bool(torch.isfinite(weights).all()),
        "repointed": repointed,
        "step_ops": step_ops,
        "tensors": len(adapters),
    }
    engine.destroy()
    return out


METADATA_OPS = {"detach", "view", "empty_like", "empty", "alias", "_unsafe_view", "t", "as_strided", "split"}


def _update_ops(engine, cfg, dtype) -> int:
    """Aten ops (metadata-only ones left out) one more engine.step() dispatches around the inner AdamW, which is
    stubbed out for this count: what the ZeRO-0 wrapper itself launches (the weights are not compared after it)."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in METADATA_OPS:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    engine.backward(engine(**_inputs(cfg, dist.get_rank(), STEPS, dtype)).float().square().mean())
    engine.optimizer.optimizer.step = lambda *a, **k: None
    with Count():
        engine.step()
    return Count.n


def _local_overflow(optimizer, adapters) -> list[bool]:
    """This rank's overflow answer before the update: [the method the optimizer calls, DeepSpeed's own]."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if isinstance(optimizer, FP16_UnfusedOptimizer):
        checker = optimizer.overflow_checker
        params = [p for g in optimizer.fp16_groups for p in g]
        return [bool(checker.has_overflow_serial(params)), bool(type(checker).has_overflow_serial(checker, params))]
    return [
        bool(optimizer.has_overflow_partitioned_grads_serial()),
        bool(type(optimizer).has_overflow_partitioned_grads_serial(optimizer)),
    ]


def _worker(rank, world, port, out_file):
    enter_training_rank(rank, world, port)
    import torch.distributed as dist

    from fluxzero.train.distributed import init_distributed

    init_distributed()
    results, done = {}, False
    try:
        for stage in STAGES:
            for batched in (False, True):
                for nan in (False, True):
                    out = _run(stage, batched, nan)
                    every = [None] * world
                    dist.all_gather_object(every, out["checks"])  # each rank checks its own partition
                    out["checks"] = every
                    results[f"{stage}/{batched}/{nan}"] = out
        for batched in (False, True):  # fp16 with a loss scale through the same ZeRO-0 optimizer
            results[f"fp16/{batched}"] = _run(0, batched, False, fp16=True)
        done = True
    finally:
        close_group(done)
    exit_rank(rank, out_file, results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("batched") / "runs.json"
    spawn_ranks(_worker, 2, str(out))
    return json.loads(out.read_text())


@pytest.mark.parametrize("stage", STAGES)
def test_batched_checks_change_nothing(runs, stage):
    before, after = runs[f"{stage}/False/False"], runs[f"{stage}/True/False"]
    assert after["replaced"], f"ZeRO-{stage} ({after['optimizer']}): nothing was replaced"
    assert before["replaced"] == [], f"FLUXZERO_DEEPSPEED_LOOPS set, yet {before['replaced']} replaced"
    assert before["skipped"] == after["skipped"] == 0
    assert after["losses"] == before["losses"]
    assert after["norms"] == before["norms"]
    assert after["weights"] == before["weights"]
    assert len(set(after["losses"])) == STEPS  # the adapters moved
    assert not any(a or b for rank in after["checks"] for a, b in rank)
    assert min(after["norms"]) > 10 * 1e-3  # gradient_clipping 1e-3 scaled every update: the norm reached the weights
    assert after["repointed"] is (None if stage == 0 else True) and before["repointed"] == after["repointed"]
    if stage == 0:  # FP16_UnfusedOptimizer.step: its per-tensor loops (norm, fp32 copy, unscale, copy back) batched
        assert "step" in after["replaced"]
        assert before["step_ops"] > 4 * before["tensors"], before["step_ops"]
        assert after["step_ops"] < 40, after["step_ops"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_nan_gradient_is_still_skipped(runs, stage):
    before, after = runs[f"{stage}/False/True"], runs[f"{stage}/True/True"]
    assert before["skipped"] == after["skipped"] == 1
    # each rank's own answer before the update, [batched, DeepSpeed's]: the NaN put into rank 1's gradient reaches
    # the rank(s) holding that adapter's reduced gradient (ZeRO-0: both; ZeRO-1/2: its partition's owner)
    for got in (before["checks"], after["checks"]):
        assert all(a == b for rank in got for a, b in rank)
        assert [any(rank[step][0] for rank in got) for step in range(STEPS)] == [s == NAN_STEP for s in range(STEPS)]
    assert after["finite"] and after["weights"] == before["weights"]
    assert after["losses"] == before["losses"]


def test_fp16_at_zero0_changes_nothing_either(runs):
    """FP16_UnfusedOptimizer with a dynamic loss scale (2^8): the batched step unscales by the same factor."""
    before, after = runs["fp16/False"], runs["fp16/True"]
    assert after["optimizer"] == "FP16_UnfusedOptimizer" and "step" in after["replaced"]
    assert after["losses"] == before["losses"] and after["norms"] == before["norms"]
    assert after["weights"] == before["weights"] and after["skipped"] == before["skipped"]
    assert len(set(after["losses"])) == STEPS and after["finite"]
