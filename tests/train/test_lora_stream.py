"""A LoRA whose frozen base blocks are streamed from host memory (fluxzero.offload_blocks K without a fused mode,
fluxzero.train.block_stream): the same losses and adapters as with every block resident, bit for bit on the CPU
(where a streamed block's "device" copy is a second CPU tensor, fetched for the forward and again for the
recompute, then released), at ZeRO-0 (fp32) and ZeRO-2 (bf16: DeepSpeed's cast reaches the adapters inside the
streamed blocks); checkpoint resume and the export; the refusals, one sentence each.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import close_group, enter_training_rank, exit_rank, spawn_ranks, tiny_ds, tiny_weights

DATA = "synthetic:n=4,hw=4x4,txt=4,ctx=64,vec=32"
LORA = {"rank": 4, "alpha": 8, "targets": "all-linear"}
STEPS = 3


def _cfg(tmp, name: str, stage: int, k: int, weights, compiled: bool = False, **kw) -> dict:
    # the resident blocks checkpointed by torch (ZeRO-0) or DeepSpeed's reentrant checkpoint (ZeRO-2); the
    # streamed ones always by the streamer (torch's, non-reentrant)
    impl = "deepspeed" if stage == 2 else "torch"
    fz = {"activation_checkpointing": {"every_k_blocks": 1, "implementation": impl}, "offload_blocks": k}
    if compiled:  # what gen-config --fit writes (blocks compiled), with the CPU's quick backend
        fz["compile"] = {"blocks": True, "backend": "aot_eager"}
    extra = {"bf16": {"enabled": True}} if stage == 2 else {}
    ds = tiny_ds(stage, clipping=0.0, lr=1e-2, weight_decay=0.0, fluxzero=fz, **extra)
    (tmp / f"{name}.json").write_text(json.dumps(ds))
    cfg = {
        "deepspeed": str(tmp / f"{name}.json"),
        "data": DATA,
        "output_dir": str(tmp / name),
        "model": "flux-tiny",
        "weights": str(weights),
        "steps": STEPS,
        "seed": 3,
        "lora": LORA,
        "export": {"format": None},
    }
    return {**cfg, **kw}


def _stepped(cfg) -> dict:
    """Train `cfg` step by step through loop.setup, checking between steps that every streamed block is back in
    its host buffer with no device copy, and that the adapters inside streamed blocks train."""
    from fluxzero.config import TrainConfig
    from fluxzero.train import distributed
    from fluxzero.train.loop import setup

    rank, world, device = distributed.init_distributed()
    run = setup(TrainConfig.from_dict(cfg), rank, world, device)
    losses, home = [], []
    try:
        module = run.engine.module
        # BlockStreamer.attach wraps each streamed block's forward in a partial of its own _forward
        streamer = getattr(getattr(module.single_blocks[-1].forward, "func", None), "__self__", None)
        for _ in range(STEPS):
            losses.append(run.step().loss)
            for block in streamer.blocks if streamer is not None else ():
                base, end = block.host.data_ptr(), block.host.data_ptr() + block.host.numel()
                home.append(block.device_buf is None and all(base <= p.data_ptr() < end for p, _ in block.params))
        adapters = {n: p.detach().float().clone() for n, p in module.named_parameters() if p.requires_grad}
        streamed = [b.name for b in streamer.blocks] if streamer is not None else []
        in_streamed = [n for n in adapters if any(n.startswith(s + ".") for s in streamed)]
        return {
            "losses": losses,
            "adapters": adapters,
            "streamed": streamed,
            "streamed_params": sum(len(b.params) for b in streamer.blocks) if streamer is not None else 0,
            "adapters_in_streamed": len(in_streamed),
            "home": all(home),
        }
    finally:
        run.step.close()
        run.engine.destroy()


def _streamed_vs_resident(tmp, name: str, stage: int, weights, **kw) -> dict:
    """Two blocks streamed against none, step by step: equal losses and adapters, and what _stepped saw."""
    ref = _stepped(_cfg(tmp, f"{name}-k0", stage, 0, weights, **kw))
    got = _stepped(_cfg(tmp, f"{name}-k2", stage, 2, weights, **kw))
    return {
        "losses_equal": got["losses"] == ref["losses"],
        "adapters_equal": set(got["adapters"]) == set(ref["adapters"])
        and all(torch.equal(got["adapters"][n], ref["adapters"][n]) for n in ref["adapters"]),
        "moved": got["losses"][-1] != got["losses"][0],
        **{k: got[k] for k in ("streamed", "streamed_params", "adapters_in_streamed", "home")},
    }


def _worker(rank, world, port, tmp, out_file):
    enter_training_rank(rank, world, port)
    from pathlib import Path

    from safetensors.torch import load_file

    from fluxzero.config import TrainConfig
    from fluxzero.train.loop import train

    tmp = Path(tmp)
    weights = tiny_weights(tmp / "base.safetensors")
    results, done = {}, False
    try:
        for stage in (0, 2):
            results[f"z{stage}"] = _streamed_vs_resident(tmp, f"z{stage}", stage, weights)
        # ZeRO-2: the run through train() with its export, stopped after 2 steps and resumed
        export = {"format": "diffusers"}
        whole = train(TrainConfig.from_dict(_cfg(tmp, "whole", 2, 2, weights, export=export)))["losses"]
        resident = train(TrainConfig.from_dict(_cfg(tmp, "resident", 2, 0, weights, export=export)))["losses"]
        stop = train(TrainConfig.from_dict(_cfg(tmp, "stop", 2, 2, weights, stop_after=2)))["losses"]
        resumed = train(TrainConfig.from_dict(_cfg(tmp, "stop", 2, 2, weights, export=export)))["losses"]
        files = [load_file(tmp / name / "lora.safetensors") for name in ("whole", "resident", "stop")]
        results["train"] = {
            "whole_equals_resident": whole == resident,
            "resumed": len(stop) == 2 and stop + resumed == whole,
            "exports_equal": all(
                set(f) == set(files[0]) and all(torch.equal(f[k], files[0][k]) for k in f) for f in files[1:]
            ),
            "exported": len(files[0]),
        }
        done = True
    finally:
        close_group(done)
    exit_rank(rank, out_file, results)


def _two_rank_worker(rank, world, port, tmp, out_file):
    """ZeRO-2 on two ranks (gloo; the streamed weights broadcast one block at a time, ds_patches.keep_on_host, the
    adapters inside streamed blocks partitioned like the rest): the same losses and export as every block
    resident."""
    enter_training_rank(rank, world, port)
    from pathlib import Path

    from safetensors.torch import load_file

    from fluxzero.config import TrainConfig
    from fluxzero.train.loop import train

    tmp, weights = Path(tmp), Path(tmp) / "base.safetensors"  # written before the ranks start
    results, done = {}, False
    try:
        export = {"format": "diffusers"}
        streamed = train(TrainConfig.from_dict(_cfg(tmp, "w2-k2", 2, 2, weights, export=export)))["losses"]
        resident = train(TrainConfig.from_dict(_cfg(tmp, "w2-k0", 2, 0, weights, export=export)))["losses"]
        if rank == 0:
            a, b = (load_file(tmp / name / "lora.safetensors") for name in ("w2-k2", "w2-k0"))
            results = {
                "losses_equal": streamed == resident,
                "exports_equal": set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a),
            }
        done = True
    finally:
        close_group(done)
    exit_rank(rank, out_file, results)


@pytest.mark.slow
def test_streamed_lora_base_on_two_ranks(tmp_path):
    out = tmp_path / "results.json"
    tiny_weights(tmp_path / "base.safetensors")
    spawn_ranks(_two_rank_worker, 2, str(tmp_path), str(out))
    r = json.loads(out.read_text())
    assert r["losses_equal"] and r["exports_equal"], r


@pytest.mark.slow
def test_streamed_lora_base_trains_as_resident(tmp_path):
    out = tmp_path / "results.json"
    spawn_ranks(_worker, 1, str(tmp_path), str(out))
    results = json.loads(out.read_text())
    for stage in (0, 2):
        r = results[f"z{stage}"]
        assert r["losses_equal"] and r["adapters_equal"] and r["moved"], (stage, r)
        assert r["streamed"] == ["single_blocks.0", "single_blocks.1"] and r["home"], (stage, r)
        # each streamed single block: its base linears, norms and modulation (frozen); the adapters resident
        assert r["streamed_params"] > 0 and r["adapters_in_streamed"] > 0, (stage, r)
    t = results["train"]
    assert t["whole_equals_resident"] and t["resumed"] and t["exports_equal"] and t["exported"] > 0, t


def test_streamed_lora_refusals_are_one_sentence():
    from fluxzero.config import LoraConfig, get_model_config
    from fluxzero.config.deepspeed.check import combination_problems, streaming_problems
    from fluxzero.config.deepspeed.view import view
    from fluxzero.train.distributed import TrainingError
    from fluxzero.train.engine import plan_streaming

    v = view(tiny_ds(2, fluxzero={"offload_blocks": 2}))
    assert combination_problems(v) == [] and streaming_problems(v, LoraConfig(rank=4)) == []
    assert combination_problems(view(tiny_ds(3, fluxzero={"offload_blocks": 2}))) == [
        "fluxzero.offload_blocks 2 streams a LoRA's frozen base blocks from host memory below ZeRO-3 only (ZeRO-3 "
        "partitions those weights itself): set zero_optimization.stage 0, 1 or 2, or set fluxzero.offload_blocks to 0"
    ]
    cases = [
        (None, "streams blocks from host memory, which a full fine-tune does only with a fused optimizer mode"),
        (LoraConfig(rank=4, base_quant="int8"), "streams the bf16 base, and lora.base_quant int8 quantizes it"),
        (LoraConfig(rank=4, type="dora"), "streams the base under a plain LoRA only (lora.type is dora)"),
    ]
    for lora, words in cases:
        with pytest.raises(TrainingError) as e:
            plan_streaming(get_model_config("flux-tiny"), v, torch.device("cpu"), lora)
        assert words in str(e.value) and "\n" not in str(e.value) and str(e.value).count(". ") == 0, str(e.value)


def test_deepspeed_casts_and_moves_the_adapters_of_streamed_blocks_only():
    """deepspeed.initialize's module.to(device) and module.bfloat16() reach a streamed block's adapters (on a GPU
    they were made on the host, beside their base weight) and leave its streamed base weights in their buffers."""
    from fluxzero.config import LoraConfig, get_model_config
    from fluxzero.model import build_model
    from fluxzero.model.lora import apply_lora
    from fluxzero.train import ds_patches
    from fluxzero.train.block_stream import BlockStreamer

    cfg = get_model_config("flux-tiny")
    streamer = BlockStreamer.plan(build_model(cfg, device="meta", dtype=torch.float32), 2, torch.device("cpu"))
    model = build_model(cfg, device="cpu", dtype=torch.float32, finish=streamer.place)
    apply_lora(model, LoraConfig(rank=4, targets="all-linear"))
    streamer.attach(model)
    with ds_patches.keep_on_host(streamer):
        model.bfloat16()
    streamed = [p for b in streamer.blocks for p, _ in b.params]
    assert streamed and all(p.dtype == torch.float32 for p in streamed)
    assert all(p.data_ptr() == v.data_ptr() for b in streamer.blocks for p, v in b.params)
    adapters = [p for m in streamer.modules() for p in m.parameters() if not streamer.streams(p)]
    assert adapters and all(p.requires_grad and p.dtype == torch.bfloat16 for p in adapters)
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if not n.startswith("single_blocks."))


def _compiled_worker(rank, world, port, tmp, out_file):
    enter_training_rank(rank, world, port)
    from pathlib import Path

    tmp = Path(tmp)
    results, done = {}, False
    try:
        results = _streamed_vs_resident(tmp, "c", 0, tiny_weights(tmp / "base.safetensors"), compiled=True)
        done = True
    finally:
        close_group(done)
    exit_rank(rank, out_file, results)


@pytest.mark.slow  # two compiles of the blocks (aot_eager) on the CPU
def test_streamed_lora_base_with_compiled_blocks_trains_as_resident(tmp_path):
    """gen-config --fit chooses a streamed base for a LoRA on a small card, with the blocks compiled: the streamer's
    checkpoint wraps the compiled forward, whose weights are swapped to the device copy each time; the same losses
    and adapters as every block resident, compiled alike."""
    out = tmp_path / "results.json"
    spawn_ranks(_compiled_worker, 1, str(tmp_path), str(out))
    r = json.loads(out.read_text())
    assert r["losses_equal"] and r["adapters_equal"] and r["moved"] and r["home"], r
