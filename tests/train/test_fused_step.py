"""The fused optimizer mode (fluxzero.train.fused_step) and streamed blocks (fluxzero.train.block_stream) through the
trainer's build path (loop.setup: the DeepSpeed engine at ZeRO 0, the real TrainStep), flux-tiny on the CPU.

The reference is adafactor-sr stepped normally after backward by DeepSpeed's engine.step(), with the same keyed
rounding noise (AdafactorSR.noise_seed): the fused mode steps each tensor with the same code, the same gradient and
the same noise key, only earlier, so losses and weights must be bit-identical, with every block resident (K=0),
some streamed, and all streamed. On the CPU a streamed block's "device" copy is a second CPU tensor, fetched,
updated and written back as on a GPU, so a lost write-back would show as a difference.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import close_group, enter_training_rank, exit_rank, spawn_ranks, tiny_ds

DATA = "synthetic:n=16,hw=4x4,txt=4,ctx=64,vec=32"
STEPS, SEED = 3, 3


def _setup(tmp_path, mode: str, k: int | None, every_k: int = 0, micro: int = 2, data: str = DATA):
    from fluxzero.config import TrainConfig
    from fluxzero.train import distributed
    from fluxzero.train.loop import setup

    fz = {"optimizer_mode": mode, "activation_checkpointing": {"every_k_blocks": every_k}}
    if k is not None:
        fz["offload_blocks"] = k
    out = tmp_path / f"{mode}-{k}-{every_k}-{micro}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "ds.json").write_text(json.dumps(tiny_ds(0, clipping=0.0, weight_decay=0.0, lr=1e-2, fluxzero=fz,
                                                    train_micro_batch_size_per_gpu=micro)))
    cfg = TrainConfig.from_dict({"deepspeed": str(out / "ds.json"), "data": data, "output_dir": str(out / "run"),
                                 "steps": STEPS, "seed": SEED})
    rank, world, device = distributed.init_distributed()
    return setup(cfg, rank, world, device)


def _train(run, checks=None) -> tuple[list[float], dict]:
    losses = []
    try:
        for _ in range(STEPS):
            losses.append(run.step().loss)
            if checks is not None:
                checks(run)
        return losses, {n: p.detach().clone() for n, p in run.engine.module.named_parameters()}
    finally:
        run.step.close()
        run.engine.destroy()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = _setup(tmp_path_factory.mktemp("ref"), "adafactor-sr", None)
    run.engine.optimizer.noise_seed = SEED  # the fused mode's keyed noise (client_optimizer passes the run's seed)
    return _train(run)


@pytest.mark.parametrize("k, every_k", [(0, 0), (2, 1), (4, 0)])
def test_fused_step_equals_adafactor_sr_stepped_after_backward(tmp_path, reference, k, every_k):
    run = _setup(tmp_path, "fused-adafactor-sr", k, every_k)
    streamer = run.engine.optimizer._streamer
    assert (streamer is None) == (k == 0) and (k == 0 or len(streamer.blocks) == k)
    grads_after_backward = []
    run.step.on_phase = lambda name: name == "update" and grads_after_backward.append(
        sum(p.grad is not None for p in run.engine.module.parameters()))

    def between_steps(run):  # every streamed weight is back in its host buffer, nothing left on the "device"
        for block in streamer.blocks if streamer else ():
            assert block.device_buf is None
            base, end = block.host.data_ptr(), block.host.data_ptr() + block.host.numel()
            assert all(base <= p.data_ptr() < end for p, _ in block.params)

    losses, weights = _train(run, between_steps)
    ref_losses, ref_weights = reference
    assert losses == ref_losses
    assert all(torch.equal(weights[n], ref_weights[n]) for n in ref_weights), k
    assert grads_after_backward == [0] * STEPS  # no gradient buffer: each was stepped and dropped in backward
    assert run.engine.skipped_steps == 0 and run.engine.enable_backward_allreduce is False


# ---------------------------------------------------------------------------------------------------------
# Slow: 2 ranks (gloo, spawned), each averaging every gradient in its hook before stepping
# ---------------------------------------------------------------------------------------------------------
ALL4 = "synthetic:n=4,hw=4x4,txt=4,ctx=64,vec=32"  # 2 ranks x micro batch 2 = 1 rank x 4: every sample, every step


def _two_rank_worker(rank, world, port, tmp, out_file):
    enter_training_rank(rank, world, port)
    import torch.distributed as dist

    from pathlib import Path

    results, done = {}, False
    try:
        run = _setup(Path(tmp) / "two", "fused-adafactor-sr", 2, micro=2, data=ALL4)
        losses, weights = _train(run)
        flat = torch.cat([w.float().flatten() for w in weights.values()])
        every = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(every, flat)
        results = {"losses": losses, "replicas_equal": all(torch.equal(every[0], f) for f in every),
                   "weights": flat.tolist()}
        done = True
    finally:
        close_group(done)
    exit_rank(rank, out_file, results)


@pytest.mark.slow
def test_two_ranks_stay_identical_and_match_one_rank_with_the_doubled_batch(tmp_path):
    out = tmp_path / "two.json"
    spawn_ranks(_two_rank_worker, 2, str(tmp_path), str(out))
    two = json.loads(out.read_text())
    assert two["replicas_equal"]  # the same averaged gradient and the same noise key on both ranks
    one_losses, one_weights = _train(_setup(tmp_path / "one", "fused-adafactor-sr", 2, micro=4, data=ALL4))
    # the same samples and noise; only the order of the bf16 gradient sums differs (2 halves averaged vs one mean)
    assert two["losses"] == pytest.approx(one_losses, rel=1e-3), (two["losses"], one_losses)
    one = torch.cat([w.float().flatten() for w in one_weights.values()])
    two_w = torch.tensor(two["weights"])
    moved = (one - _initial_weights(tmp_path)).abs().mean()
    assert (two_w - one).abs().mean() < 0.05 * moved  # measured 0.01 of the mean update over 3 steps


def _initial_weights(tmp_path) -> torch.Tensor:
    run = _setup(tmp_path / "init", "fused-adafactor-sr", 2, micro=4, data=ALL4)
    try:
        return torch.cat([p.detach().float().flatten() for p in run.engine.module.parameters()])
    finally:
        run.step.close()
        run.engine.destroy()
