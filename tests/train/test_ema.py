"""EMA of the weights (fluxzero.config.ema, fluxzero.train.ema).

The multi-rank test trains a tiny module with real deepspeed.initialize on 2 gloo ranks (one spawned launch
for the whole matrix of ZeRO stage x precision) and, after every optimizer step, also keeps a plain-PyTorch
reference EMA of the FULL fp32 master weights (read with DeepSpeed's public safe_get_full_fp32_param, or the
parameters / the fp32 copies at ZeRO-0). The sharded EMA applies the same elementwise lerp to the same fp32
values, only split over ranks, so in fp32 it must equal the reference exactly (tolerance 0).
"""

import os
import re
import time

import pytest
import torch

from fluxzero.config.ema import EmaConfig
from tests.helpers import ONE_RANK, close_group, enter_rank, spawn_ranks
from tests.pure_python import run_without_torch

STEPS, SWITCH = 6, 3  # optimizer steps; the resumed EMA takes over after step SWITCH
DECAY = 0.8  # far from 1 so that 6 steps move the EMA well away from both the start and the weights

# name: (zero stage, bf16, grad_accum_dtype, ema dtype, LoRA, CPU offload); the optimizer wrapper in KINDS
MATRIX = {
    "z0_fp32": (0, False, None, "fp32", False, False),  # torch AdamW, the params are the masters
    "z0_bf16": (0, True, None, "fp32", False, False),  # FP16_UnfusedOptimizer(bf16): fp32 copies on every rank
    "z1_bf16_fp32acc": (1, True, "fp32", "fp32", False, False),  # BF16_Optimizer: partitioned fp32 masters
    "z2_fp32": (2, False, None, "fp32", False, False),
    "z2_bf16": (2, True, None, "fp32", False, False),
    "z2_bf16_lora": (2, True, None, "fp32", True, False),  # PEFT LoRA: only the adapter is averaged
    "z3_fp32": (3, False, None, "fp32", False, False),
    "z3_bf16": (3, True, None, "fp32", False, False),
    "z3_bf16_offload": (3, True, None, "fp32", False, True),  # optimizer and params offloaded to the CPU
    "z3_bf16_ema_bf16": (3, True, None, "bf16", False, False),
}
# zero_to_fp32 reads ZeRO-1/2/3 checkpoints; BF16_Optimizer's (z1_bf16_fp32acc) it refuses as "not a zero checkpoint"
ZERO_TO_FP32 = ("z2_bf16_lora", "z3_bf16_offload")  # ZeRO-2 with frozen params, ZeRO-3 offloaded
KINDS = {
    "z0_fp32": "params",
    "z0_bf16": "fp16_unfused",
    "z1_bf16_fp32acc": "bf16_optimizer",
    "z2_fp32": "zero1_2",
    "z2_bf16": "zero1_2",
    "z2_bf16_lora": "zero1_2",
    "z3_fp32": "zero3",
    "z3_bf16": "zero3",
    "z3_bf16_offload": "zero3",
    "z3_bf16_ema_bf16": "zero3",
}


class Tiny(torch.nn.Module):
    """Odd parameter sizes (91, 13, 39, 3 elements): ZeRO splits them mid-tensor and pads the last rank."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.frozen = torch.nn.Linear(7, 13), torch.nn.Linear(13, 3), torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)  # not trained, so not averaged (as LoRA's frozen base)

    def forward(self, x):
        return self.frozen(torch.tanh(self.b(torch.tanh(self.a(x)))))


def ds_config(stage, bf16, acc, offload=False):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 8,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "zero_force_ds_cpu_optimizer": False,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    if stage == 3:  # biases (<= 20 elements) stay gathered, weights are released: swap() handles both
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 20
        if not bf16:  # several ZeRO-3 sub groups, each its own fp32 partition
            cfg["zero_optimization"]["sub_group_size"] = 40
    if offload:
        cfg["zero_optimization"].update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if acc:
        cfg["data_types"] = {"grad_accum_dtype": acc}
    return cfg


def _full_masters(engine, params):
    """name -> full fp32 master weights, the reference's input (collective under ZeRO-1/2/3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    opt = engine.optimizer
    if hasattr(opt, "fp32_groups") and not hasattr(opt, "fp32_groups_flat_partition"):  # bf16 ZeRO-0 copies
        lp = [p for g in opt.fp16_groups for p in g]
        hp = [t for g in opt.fp32_groups for t in g]
        by_id = {id(p): t for p, t in zip(lp, hp)}
        return {n: by_id[id(p)].detach().float().cpu().clone() for n, p in params.items()}
    out = {}
    for n, p in params.items():
        full = safe_get_full_fp32_param(p)
        out[n] = (p.detach() if full is None else full).float().cpu().clone().view(getattr(p, "ds_shape", p.shape))
    return out


def _gathered(engine):
    """name -> full weights as the model computes with them (gathered under ZeRO-3)."""
    import deepspeed

    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=hasattr(params[0][1], "ds_id")):
        return {n: p.detach().cpu().clone() for n, p in params}


def _run_one(name, tmp, rank):
    import deepspeed

    from fluxzero.train.ema import ShardedEMA

    stage, bf16, acc, ema_dtype, lora, offload = MATRIX[name]
    ds = ds_config(stage, bf16, acc, offload)
    torch.manual_seed(0)  # the same initial weights on every rank
    with deepspeed.zero.Init(config_dict_or_path=ds, enabled=stage == 3):
        model = Tiny()
    if lora:
        import peft

        model = peft.inject_adapter_in_model(peft.LoraConfig(r=2, lora_alpha=4, target_modules=["a", "b"]), model)
    trained = [p for p in model.parameters() if p.requires_grad]
    if name == "z2_fp32":  # two param groups (no decay on biases): two flat partitions per rank
        trained = [
            {"params": [p for p in trained if p.ndim > 1]},
            {"params": [p for p in trained if p.ndim == 1], "weight_decay": 0.0},
        ]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trained, config=ds)
    dtype = torch.bfloat16 if bf16 else torch.float32
    params = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    cfg = EmaConfig(decay=DECAY, warmup=True, every=1, device="cpu" if stage == 2 else "gpu", dtype=ema_dtype)
    ema = ShardedEMA(engine, cfg, seed=5)
    ref = _full_masters(engine, params)
    gen = torch.Generator().manual_seed(100 + rank)  # each data-parallel rank trains on its own batch
    resumed = resumed_full = None
    times = {"step": 0.0, "update": 0.0}
    for step in range(1, STEPS + 1):
        x = torch.randn(4, 7, generator=gen).to(dtype)
        t0 = time.perf_counter()
        loss = (engine(x).float() - 1.0).pow(2).mean()
        engine.backward(loss)
        engine.step()
        t1 = time.perf_counter()
        assert ema.update(step)
        t2 = time.perf_counter()
        assert not ema.update(step)  # a second call for the same optimizer step (e.g. per micro-step) is a no-op
        times["step"] += t1 - t0
        times["update"] += t2 - t1
        if resumed is not None:
            resumed.update(step)
            resumed_full.update(step)
        w = 1.0 - cfg.decay_at(step)
        for n, full in _full_masters(engine, params).items():
            ref[n].lerp_(full, w)
        if step == SWITCH:  # save this rank's shard the two ways the trainer may, and resume from one
            sd = ema.state_dict()
            from safetensors.torch import save_file

            save_file(sd, str(tmp / f"{name}_mid_rank{rank}.safetensors"))
            torch.save(sd, tmp / f"{name}_mid_rank{rank}.pt")
            resumed = ShardedEMA(engine, cfg, seed=5)  # starts from the weights at step 3: wrong until loaded
            resumed.load_state_dict(torch.load(tmp / f"{name}_mid_rank{rank}.pt", weights_only=True))
            # the path for another world size: every rank consolidates all shards and takes its pieces
            import torch.distributed as dist

            from fluxzero.train.ema import consolidate

            dist.barrier()  # both ranks' files are written
            resumed_full = ShardedEMA(engine, cfg, seed=5)
            resumed_full.load_full_state_dict(
                consolidate([tmp / f"{name}_mid_rank{r}.safetensors" for r in range(2)]), step=SWITCH
            )
    full = ema.full_state_dict()
    full_resumed = resumed.full_state_dict()
    full_resumed_full = resumed_full.full_state_dict()
    from safetensors.torch import save_file

    save_file(ema.state_dict(), str(tmp / f"{name}_rank{rank}.safetensors"))

    # The layout against DeepSpeed's own offline reader (zero_to_fp32: param_shapes, padding, sub groups):
    # a fresh EMA equals the fp32 masters, which zero_to_fp32 rebuilds from a checkpoint of this engine.
    from_zero_to_fp32 = fresh = None
    if name in ZERO_TO_FP32:
        import torch.distributed as dist
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        fresh = ShardedEMA(engine, EmaConfig(decay=DECAY)).full_state_dict()
        engine.save_checkpoint(str(tmp / f"{name}_ckpt"), tag="t")
        dist.barrier()
        if rank == 0:
            from_zero_to_fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp / f"{name}_ckpt"), tag="t")

    # swap: inside, the model computes with the EMA; outside again with the trained weights, bit for bit
    probe = torch.randn(5, 7, generator=torch.Generator().manual_seed(7)).to(dtype)
    before = _gathered(engine)
    with torch.no_grad():
        out_before = engine(probe).float()
    with ema.swap():
        inside = _gathered(engine)
        with torch.no_grad():
            out_inside = engine(probe).float()
    after = _gathered(engine)
    with torch.no_grad():
        out_after = engine(probe).float()
    x = torch.randn(4, 7, generator=gen).to(dtype)  # and training goes on from the restored weights
    engine.backward((engine(x).float() - 1.0).pow(2).mean())
    engine.step()
    result = {
        "kind": ema.kind,
        "ref": ref,
        "full": full,
        "full_resumed": full_resumed,
        "nbytes": ema.nbytes,
        "full_resumed_full": full_resumed_full,
        "buffers": len(ema.layout()["buffers"]),
        "numel": ema.numel,
        "before": before,
        "inside": inside,
        "after": after,
        "out_before": out_before,
        "out_inside": out_inside,
        "out_after": out_after,
        "times": times,
        "lp_dtype": str(dtype),
        "fresh": fresh,
        "zero_to_fp32": from_zero_to_fp32,
    }
    engine.destroy()
    return result


def _worker(rank, world, port, tmp):
    import faulthandler
    import importlib
    import warnings
    from pathlib import Path

    faulthandler.dump_traceback_later(300, exit=True)  # a rank stuck in a collective fails, with stacks
    enter_rank(rank, world, port)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # unused C++ op, ~60 s to build
    deepspeed.init_distributed(dist_backend="gloo")
    tmp, results, done = Path(tmp), {}, False
    try:
        for name in MATRIX:
            results[name] = _run_one(name, tmp, rank)
        done = True
    finally:
        close_group(done)
    torch.save(results, tmp / f"results_rank{rank}.pt")
    os._exit(0)  # skip interpreter teardown, where gloo threads can abort a finished rank


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ema")
    t0 = time.perf_counter()
    spawn_ranks(_worker, 2, str(tmp))
    print(f"2-rank EMA matrix: {time.perf_counter() - t0:.1f} s")
    ranks = [torch.load(tmp / f"results_rank{r}.pt", weights_only=False) for r in range(2)]
    for name, res in ranks[0].items():  # a sanity figure only: 2-core CPU timings of a 146-parameter model
        t = res["times"]
        print(
            f"  {name}: {STEPS} steps {t['step'] * 1e3:.1f} ms, EMA updates {t['update'] * 1e3:.2f} ms, "
            f"EMA elements per rank {[r[name]['numel'] for r in ranks]} ({res['nbytes']} B on rank 0)"
        )
    return tmp, ranks


# ----- multi-rank: real DeepSpeed engines ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in MATRIX if MATRIX[n][3] == "fp32"])
def test_consolidated_ema_equals_full_weight_reference(matrix, name):
    tmp, (r0, r1) = matrix
    res = r0[name]
    assert res["kind"] == KINDS[name]
    assert r1[name]["full"] == {}  # only rank 0 receives the consolidated EMA
    if MATRIX[name][4]:  # LoRA: the adapter only
        assert set(res["full"]) == {f"{m}.lora_{ab}.default.weight" for m in "ab" for ab in "AB"}
    else:  # frozen.* is not averaged
        assert set(res["full"]) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    for n, want in res["ref"].items():
        # exact: the same fp32 lerp on the same fp32 values, split over ranks
        assert torch.equal(res["full"][n], want), n
        assert not torch.equal(want, res["before"][n].float()), n  # the EMA is not simply the weights
    offline = __import__("fluxzero.train.ema", fromlist=["consolidate"]).consolidate(
        [tmp / f"{name}_rank{r}.safetensors" for r in range(2)]
    )
    for n, want in res["ref"].items():
        assert torch.equal(offline[n], want), n


@pytest.mark.slow
@pytest.mark.parametrize("name", ZERO_TO_FP32)
def test_layout_agrees_with_deepspeeds_zero_to_fp32(matrix, name):
    _, (r0, _) = matrix
    fresh, ref = r0[name]["fresh"], r0[name]["zero_to_fp32"]
    assert fresh and set(fresh) <= set(ref)
    for n, t in fresh.items():
        assert torch.equal(t, ref[n].float()), n  # exact: both are copies of the same fp32 masters


@pytest.mark.slow
def test_bf16_ema_tracks_the_reference_within_bf16_rounding(matrix):
    _, (r0, _) = matrix
    res = r0["z3_bf16_ema_bf16"]
    for n, want in res["ref"].items():
        # each update rounds stochastically to bf16 (error < 1 ulp = 2^-7 relative, unbiased) and later
        # updates shrink earlier errors by the decay: a few ulps bound the sum
        torch.testing.assert_close(res["full"][n], want, rtol=2**-6, atol=2**-8)
    fp32 = r0["z3_bf16"]
    assert res["nbytes"] * 2 == fp32["nbytes"]  # 2 B vs 4 B per element


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MATRIX))
def test_state_dict_round_trip_continues_exactly(matrix, name):
    _, (r0, _) = matrix
    res = r0[name]
    assert res["full"]
    for n in res["full"]:
        assert torch.equal(res["full_resumed"][n], res["full"][n]), n  # own shard back, same world size
        assert torch.equal(res["full_resumed_full"][n], res["full"][n]), n  # via consolidate + load_full


@pytest.mark.slow
def test_several_groups_and_sub_groups(matrix):
    _, (r0, _) = matrix
    assert r0["z2_fp32"]["buffers"] == 2  # one flat fp32 partition per optimizer param group
    # sub_group_size 40 over a rank's 46 + 7 + 20 + 2 partition elements: [a.weight], [a.bias, b.*]
    assert r0["z3_fp32"]["buffers"] == 2 and r0["z3_bf16"]["buffers"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MATRIX))
def test_swap_puts_ema_into_the_model_and_restores_it_exactly(matrix, name):
    _, ranks = matrix
    for r in ranks:
        res = r[name]
        lp = torch.bfloat16 if res["lp_dtype"] == "torch.bfloat16" else torch.float32
        for n, p in res["before"].items():
            assert torch.equal(res["after"][n], p), n  # restored bit for bit
            if n in r[name]["ref"]:
                want = ranks[0][name]["full"][n].to(lp)  # the EMA as the model's dtype
                assert torch.equal(res["inside"][n], want), n
            else:
                assert torch.equal(res["inside"][n], p), n  # frozen params untouched
        assert torch.equal(res["out_after"], res["out_before"])
        assert not torch.equal(res["out_inside"], res["out_before"])


@pytest.mark.slow
def test_partitioned_ema_holds_half_per_rank(matrix):
    _, (r0, r1) = matrix
    trained = 91 + 13 + 39 + 3
    for name in ("z2_fp32", "z3_fp32", "z1_bf16_fp32acc"):
        # 4 B x P / N plus partition padding (at most a few elements per rank)
        assert r0[name]["numel"] + r1[name]["numel"] <= trained + 16, name
        assert abs(r0[name]["numel"] - trained / 2) <= 8, name
    for name in ("z0_fp32", "z0_bf16"):
        assert r0[name]["numel"] == r1[name]["numel"] == trained


@pytest.mark.slow
def test_shards_of_a_different_partitioning_are_refused_in_one_sentence(matrix):
    from fluxzero.train.ema import consolidate, load_shard

    tmp, _ = matrix
    with pytest.raises(ValueError, match=r"ranks \[1\] of 2 are missing") as e:
        consolidate([tmp / "z2_fp32_rank0.safetensors"])
    assert "\n" not in str(e.value)
    mid = consolidate([tmp / f"z3_bf16_mid_rank{r}.safetensors" for r in range(2)])  # any stage, offline
    assert set(mid) == {"a.weight", "a.bias", "b.weight", "b.bias"} and mid["a.weight"].shape == (13, 7)
    assert load_shard(tmp / "z3_bf16_mid_rank0.pt")["step"].item() == SWITCH


# ----- one rank: the bf16 optimizer modes at ZeRO-0 -------------------------------------------------------
_BF16_WEIGHTS = (
    ONE_RANK
    + r"""
import json
from fluxzero.config.ema import EmaConfig
from fluxzero.train.ema import ShardedEMA
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3)).to(torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
       "steps_per_print": 10**9, "zero_optimization": {"stage": 0}}
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
ema = ShardedEMA(engine, EmaConfig(decay=0.8), seed=0)
ref = [p.detach().float().clone() for p in engine.module.parameters()]
for step in range(1, 4):
    engine.backward(engine(torch.randn(4, 7, dtype=torch.bfloat16)).float().pow(2).mean())
    engine.step()
    ema.update(step)
    for r, p in zip(ref, engine.module.parameters()):
        r.lerp_(p.detach().float(), 0.2)
diff = max((e - r.reshape(-1)).abs().max().item() for e, r in zip(ema._ema, ref))
moved = max((e - p.detach().float().reshape(-1)).abs().max().item() for e, p in zip(ema._ema, engine.module.parameters()))
print(json.dumps({"kind": ema.kind, "dtype": str(ema._ema[0].dtype), "diff": diff, "moved": moved}))
torch.distributed.destroy_process_group()
"""
)


def test_fp32_ema_of_bf16_weights_at_zero0():
    """The bf16 optimizer modes at ZeRO-0 (what `gen-config --fit` picks for a full FLUX.1-dev fine-tune on one
    H200) step the bf16 weights themselves: the fp32 EMA averages them (lerp_ refused the mixed dtypes before)."""
    import json
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _BF16_WEIGHTS], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["kind"] == "params" and r["dtype"] == "torch.float32"
    assert r["diff"] == 0.0  # the same elementwise lerp of the same fp32 values as the reference
    assert r["moved"] > 1e-3  # the weights moved away from their average: the comparison means something


# ----- single process ---------------------------------------------------------------------------------
def test_stochastic_rounding_keeps_increments_that_round_to_nearest_loses():
    from fluxzero.train.optim.optimizers import stochastic_round_bf16

    target = torch.full((20000,), 1.0 + 2**-7)  # one bf16 ulp above 1
    sr = torch.ones(20000, dtype=torch.bfloat16)
    rtn = sr.clone()
    ref = torch.ones(20000)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):  # each increment is 0.01 x 2^-7: far below half an ulp
        rtn = rtn.float().lerp_(target, 0.01).to(torch.bfloat16)
        sr = stochastic_round_bf16(sr.float().lerp_(target, 0.01), gen)
        ref.lerp_(target, 0.01)
    assert torch.all(rtn == 1.0)  # round-to-nearest never moved
    # the mean over 20000 elements has a standard error ~ 2^-7 / sqrt(20000) / 2 = 3e-5
    assert abs(sr.float().mean().item() - ref[0].item()) < 2e-4
    assert ref[0].item() - 1.0 > 0.9 * 2**-7


@pytest.mark.parametrize("decay", [0.0, 1.0, 1.5, -0.1, True, "0.99"])
def test_bad_decay_is_one_sentence(decay):
    with pytest.raises(ValueError, match=r"^ema\.decay must be .*between 0 and 1") as e:
        EmaConfig(decay=decay)
    assert "\n" not in str(e.value) and not re.search(r"[.;]\s+[A-Z]", str(e.value))  # one sentence


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("every", 0, "ema.every"),
        ("every", 1.5, "ema.every"),
        ("device", "cuda", "'gpu' or 'cpu'"),
        ("dtype", "fp16", "'fp32' or 'bf16'"),
        ("warmup", "yes", "true or false"),
    ],
)
def test_other_bad_values_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        EmaConfig(**{field: value})


def test_run_file_section_and_schedule():
    cfg = EmaConfig.from_dict({"decay": 0.999, "warmup": True, "every": 4})
    assert [cfg.updates_at(s) for s in range(0, 9)] == [False, False, False, False, True, False, False, False, True]
    assert cfg.decay_at(4) == pytest.approx(5 / 14) and cfg.decay_at(10**6) == 0.999
    assert EmaConfig(decay=0.9).decay_at(1) == 0.9
    with pytest.raises(ValueError, match="did you mean 'decay' for 'decya'"):
        EmaConfig.from_dict({"decya": 0.9})
    assert EmaConfig.from_dict(cfg.to_dict()) == cfg


def test_bytes_per_param_for_the_memory_model():
    assert EmaConfig().bytes_per_param(8, partitioned=True) == 0.5  # 4 B x P / N
    assert EmaConfig().bytes_per_param(8, partitioned=False) == 4
    assert EmaConfig(dtype="bf16").bytes_per_param(4, partitioned=True) == 0.5
    p = 11.9e9  # FLUX.1 [dev] transformer: a full fp32 EMA on one rank is ~48 GB, ~6 GB per rank at 8 ranks
    assert round(p * EmaConfig().bytes_per_param(1, True) / 1e9) == 48


def test_config_module_imports_without_torch():
    proc = run_without_torch("from fluxzero.config.ema import EmaConfig; print(EmaConfig(decay=0.99).every)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1"
