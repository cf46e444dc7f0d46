"""The fused optimizer mode (fluxzero.train.optim.fused_step) and streamed blocks (fluxzero.train.block_stream) through the
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
    (out / "ds.json").write_text(
        json.dumps(
            tiny_ds(0, clipping=0.0, weight_decay=0.0, lr=1e-2, fluxzero=fz, train_micro_batch_size_per_gpu=micro)
        )
    )
    cfg = TrainConfig.from_dict(
        {"deepspeed": str(out / "ds.json"), "data": data, "output_dir": str(out / "run"), "steps": STEPS, "seed": SEED}
    )
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


CASES = [(0, 0), (2, 1), (4, 0)]  # (streamed blocks, every_k_blocks): none, some (others checkpointed), all


def _equivalence_worker(rank, world, port, tmp, out_file):
    """One spawned rank (the trainer's process group stays out of the test process): the reference, then each
    case, compared in place (the weights never leave the process)."""
    enter_training_rank(rank, world, port)
    from pathlib import Path

    results, done = {}, False
    try:
        run = _setup(Path(tmp), "adafactor-sr", None)
        run.engine.optimizer.noise_seed = SEED  # the fused mode's keyed noise (client_optimizer passes the run's seed)
        ref_losses, ref_weights = _train(run)
        for k, every_k in CASES:
            run = _setup(Path(tmp), "fused-adafactor-sr", k, every_k)
            streamer = run.engine.optimizer._streamer
            grads = []
            run.step.on_phase = lambda name, run=run: (
                name == "update" and grads.append(sum(p.grad is not None for p in run.engine.module.parameters()))
            )
            homes = []

            def between_steps(run, streamer=streamer):  # streamed weights back in their host buffers, none on device
                for block in streamer.blocks if streamer else ():
                    base, end = block.host.data_ptr(), block.host.data_ptr() + block.host.numel()
                    homes.append(block.device_buf is None and all(base <= p.data_ptr() < end for p, _ in block.params))

            losses, weights = _train(run, between_steps)
            results[f"{k}-{every_k}"] = {
                "streamed": len(streamer.blocks) if streamer else 0,
                "losses_equal": losses == ref_losses,
                "weights_equal": all(torch.equal(weights[n], ref_weights[n]) for n in ref_weights),
                "grads_after_backward": grads,
                "at_home": all(homes),
                "skipped": run.engine.skipped_steps,
                "engine_allreduce": run.engine.enable_backward_allreduce,
            }
        results["nonfinite"] = _nonfinite_gradient(Path(tmp))
        done = True
    finally:
        close_group(done)
    exit_rank(rank, out_file, results)


def _nonfinite_gradient(tmp) -> dict:
    """A NaN in one streamed tensor's gradient at step 2: that tensor is left as it was, the others step, and
    DeepSpeed counts a skipped step."""
    run = _setup(tmp / "nan", "fused-adafactor-sr", 2)
    try:
        engine = run.engine
        run.step()
        name, p = next((n, p) for n, p in engine.module.named_parameters() if n.startswith("single_blocks.1."))
        before = {n: q.detach().clone() for n, q in engine.module.named_parameters()}
        handle = p.register_hook(lambda g: g * float("nan"))
        r = run.step()
        handle.remove()
        moved = [n for n, q in engine.module.named_parameters() if not torch.equal(q.detach(), before[n])]
        run.step()
        return {
            "kept": name not in moved,
            "others_moved": len(moved),
            "skipped": r.skipped_steps,
            "skipped_tensors": engine.optimizer.skipped_tensors,
            "finite": bool(torch.isfinite(p).all()),
            "after": engine.skipped_steps,
        }
    finally:
        run.step.close()
        run.engine.destroy()


def test_fused_step_equals_adafactor_sr_stepped_after_backward(tmp_path):
    out = tmp_path / "results.json"
    spawn_ranks(_equivalence_worker, 1, str(tmp_path), str(out))
    results = json.loads(out.read_text())
    for k, every_k in CASES:
        r = results[f"{k}-{every_k}"]
        assert r["streamed"] == k and r["losses_equal"] and r["weights_equal"], (k, r)
        assert r["grads_after_backward"] == [0] * STEPS, r  # no gradient buffer: each stepped and dropped in backward
        assert r["at_home"] and r["skipped"] == 0 and r["engine_allreduce"] is False, r
    nan = results["nonfinite"]
    assert nan["kept"] and nan["finite"] and nan["others_moved"] > 10, nan
    assert nan["skipped"] == 1 and nan["skipped_tensors"] == 1 and nan["after"] == 1, nan  # logged as a skipped step


def test_streamed_weights_beyond_the_host_are_refused_in_one_sentence():
    from fluxzero.train.block_stream import host_shortfall
    from fluxzero.train.host_memory import host_available

    assert host_shortfall(10 * 2**30, 20 * 2**30, 44) is None and host_shortfall(1, None, 1) is None
    assert host_shortfall(20 * 2**30, 16 * 2**30, 44) == (
        "fluxzero.offload_blocks 44 keeps 20.0 GiB of block weights in host memory, but 16.0 GiB is available on "
        "this machine: lower offload_blocks, or let `fluxzero gen-config --fit --host-memory GIB` choose it for the "
        "memory this machine has"
    )
    assert host_available() is None or host_available() > 0


# ---------------------------------------------------------------------------------------------------------
# Slow: 2 ranks (gloo, spawned), each averaging every gradient in its hook before stepping
# ---------------------------------------------------------------------------------------------------------
ALL4 = "synthetic:n=4,hw=4x4,txt=4,ctx=64,vec=32"  # 2 ranks x micro batch 2 = 1 rank x 4: every sample, every step


def _two_rank_worker(rank, world, port, tmp, out_file, bucketed=True):
    """`world` spawned ranks of the fused mode (two blocks streamed) on ALL4 with micro batch 4 / world; rank 0 saves
    the losses, the weights and whether every rank holds the same, and (one rank) the initial weights. bucketed:
    a block's gradients averaged in one all_reduce (the default), else one all_reduce per tensor."""
    enter_training_rank(rank, world, port)
    from pathlib import Path

    import torch.distributed as dist

    done = False
    name = f"world{world}" + ("" if bucketed else "-per-tensor")
    try:
        run = _setup(Path(tmp) / name, "fused-adafactor-sr", 2, micro=4 // world, data=ALL4)
        run.engine.optimizer.bucket_grads = bucketed
        buckets = len(run.engine.optimizer._bucket_size)
        init = torch.cat([p.detach().float().flatten() for p in run.engine.module.parameters()])
        losses, weights = _train(run)
        flat = torch.cat([w.float().flatten() for w in weights.values()])
        every = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(every, flat)
        if rank == 0:
            torch.save(
                {
                    "losses": losses,
                    "weights": flat,
                    "init": init,
                    "buckets": buckets,
                    "replicas_equal": all(torch.equal(every[0], f) for f in every),
                },
                Path(tmp) / f"{name}.pt",
            )
        done = True
    finally:
        close_group(done)
    exit_rank(rank, out_file, {})


@pytest.mark.slow
def test_two_ranks_stay_identical_and_match_one_rank_with_the_doubled_batch(tmp_path):
    for world in (2, 1):
        spawn_ranks(_two_rank_worker, world, str(tmp_path), str(tmp_path / f"world{world}.json"))
    two, one = (torch.load(tmp_path / f"world{w}.pt") for w in (2, 1))
    assert two["replicas_equal"]  # the same averaged gradient and the same noise key on both ranks
    # the same samples and noise; only the order of the bf16 gradient sums differs (2 halves averaged vs one mean)
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-3), (two["losses"], one["losses"])
    moved = (one["weights"] - one["init"]).abs().mean()
    assert (two["weights"] - one["weights"]).abs().mean() < 0.05 * moved  # measured 0.01 of the mean update


@pytest.mark.slow
def test_a_blocks_gradients_averaged_in_one_all_reduce_equal_one_all_reduce_per_tensor(tmp_path):
    """2 ranks: the bucketed average (one collective per block) steps exactly the per-tensor one's weights."""
    for bucketed in (True, False):
        spawn_ranks(_two_rank_worker, 2, str(tmp_path), str(tmp_path / f"{bucketed}.json"), bucketed)
    bucketed, per_tensor = (torch.load(tmp_path / f"world2{s}.pt") for s in ("", "-per-tensor"))
    # flux-tiny: 4 blocks, and img_in, txt_in, time_in, vector_in, guidance_in, final_layer
    assert bucketed["buckets"] == 10 and bucketed["replicas_equal"] and per_tensor["replicas_equal"]
    assert bucketed["losses"] == per_tensor["losses"] and torch.equal(bucketed["weights"], per_tensor["weights"])
    assert not torch.equal(bucketed["weights"], bucketed["init"])


def test_a_lora_and_too_many_streamed_blocks_are_refused_before_the_model_is_built():
    from fluxzero.config import get_model_config
    from fluxzero.config.deepspeed.view import view
    from fluxzero.config.lora import LoraConfig
    from fluxzero.train.distributed import TrainingError
    from fluxzero.train.engine import plan_streaming

    cfg = get_model_config("flux-tiny")
    v = view(tiny_ds(0, clipping=0.0, fluxzero={"optimizer_mode": "fused-adafactor-sr", "offload_blocks": 5}))
    with pytest.raises(TrainingError, match="is for full fine-tunes; a LoRA trains few tensors"):
        plan_streaming(cfg, v, torch.device("cpu"), lora=LoraConfig(rank=4))
    with pytest.raises(TrainingError, match="offload_blocks 5 exceeds the 4 transformer blocks of flux-tiny"):
        plan_streaming(cfg, v, torch.device("cpu"), lora=None)


def test_the_compiled_adafactor_step_takes_every_weight_shape(monkeypatch):
    """One compiled graph per weight shape: more shapes than Dynamo's default recompile limit (8; FLUX.1-dev has 13)
    must all run compiled, with the same result as the eager step. With fullgraph=True the 9th shape raised, and the
    trainer stepped every tensor eagerly from there on. Dynamo's eager backend: the limit is Dynamo's, not the
    compiler's."""
    import warnings

    import torch._dynamo

    from fluxzero.train.optim import optimizers as o

    monkeypatch.setattr(o, "_COMPILE_FAILED", False)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    shapes = [(8 + 4 * i, 12 + 8 * (i % 3)) for i in range(12)]
    assert len(set(shapes)) == 12
    scalars = torch.tensor([1e-3, 0.5, 1.0], dtype=torch.float64)
    # the default limit, set with the config's own patch (monkeypatch's undo deletes a config module's entry)
    with torch._dynamo.config.patch(recompile_limit=8), warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed build warns: an error here
        for shape in shapes:
            p = torch.randn(shape, generator=g).to(torch.bfloat16)
            grad = torch.randn(shape, generator=g).to(torch.bfloat16)
            states = (torch.rand(shape[0], 1, generator=g), torch.rand(1, shape[1], generator=g))
            eager_states = tuple(t.clone() for t in states)
            want = o._adafactor_factored(p, grad, *eager_states, scalars, None, 1e-30, 1e-3, 1.0, False)
            got = o._factored_update((p, grad, *states, scalars, None, 1e-30, 1e-3, 1.0, False), backend="eager")
            assert torch.equal(got, want) and all(map(torch.equal, states, eager_states))
    assert not o._COMPILE_FAILED
