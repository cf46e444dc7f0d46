"""Real 2-rank DeepSpeed training on CPU (gloo), one spawned launch for the whole matrix.

Every run trains flux-tiny from the same weights file on a synthetic set of 4 samples with global batch
4, so each step sees every sample in every layout and the per-sample noise (fluxzero.train.flow.draw_noise) is
the same: all layouts compute the same numbers up to float summation order. The reference is plain
PyTorch (no DeepSpeed) in this process.
"""

import hashlib
import json
import os
import shutil

import pytest
import torch

from tests.helpers import close_group, enter_rank, plain_losses, spawn_ranks, tiny_weights

pytestmark = pytest.mark.slow

DATA4 = "synthetic:n=4,hw=8x8,txt=4,ctx=64,vec=32"
DATA12 = "synthetic:n=12,hw=8x8,txt=4,ctx=64,vec=32"
STEPS = 3
LR, WD = 1e-3, 0.01


def ds_config(stage, micro=2, accum=1, world=2, offload_optimizer=False, offload_param=False, ckpt=(0, "torch")):
    zero = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world,
        "gradient_clipping": 0.0,  # clipping would hide small gradient differences between layouts
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "fluxzero": {"activation_checkpointing": {"every_k_blocks": ckpt[0], "implementation": ckpt[1]}},
    }


def run_config(tmp, name, ds, weights, **kw):
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(ds))
    cfg = {
        "deepspeed": str(path),
        "data": DATA4,
        "output_dir": str(tmp / name),
        "model": "flux-tiny",
        "weights": str(weights),
        "steps": STEPS,
        "seed": 3,
        "export": {"format": None},
    }  # batch: in `ds`
    cfg.update(kw)
    return name, cfg


def _worker(rank, world, port, jobs, out_file):
    import faulthandler

    # a rank stuck in a collective its peer never joins fails the test (with stacks) instead of hanging CI
    faulthandler.dump_traceback_later(600, exit=True)
    enter_rank(rank, world, port, FLUXZERO_NO_PROGRESS="1")
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    from fluxzero.config import TrainConfig
    from fluxzero.train.loop import train

    results, done = {}, False
    try:
        for name, cfg in jobs:
            results[name] = train(TrainConfig.from_dict(cfg))["losses"]
        results["z3_partition"] = _partition_probe(TrainConfig.from_dict(dict(jobs)["z3"]))
        results["checkpoint_checks"] = _checkpoint_checks_probe(TrainConfig.from_dict(dict(jobs)["resumed2"]))
        done = True
    finally:
        close_group(done)  # neither rank tears its process group down while the other still talks
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(results, f)
    # Leave without interpreter teardown: a gloo group's threads can abort a finished rank there
    # ("terminate called without an active exception"); see fluxzero.train.distributed._destroy_group_at_exit.
    os._exit(0)


def _partition_probe(cfg):
    """Per rank: elements held locally vs the model's total, right after the ZeRO-3 build and weight load."""
    import torch.distributed as dist

    from fluxzero.config import get_model_config
    from fluxzero.config.deepspeed.file import load_for_training
    from fluxzero.train import engine as ds_engine

    ds, v = load_for_training(cfg.deepspeed, dist.get_world_size())
    engine = ds_engine.build_engine(
        get_model_config(cfg.model), ds, v, torch.device("cpu"), seed=cfg.seed, weights=cfg.weights
    )
    params = list(engine.module.parameters())
    local = sum(p.ds_tensor.numel() for p in params)
    placeholders = sum(p.numel() for p in params)  # what a rank sees outside a gather: empty tensors
    total = sum(p.ds_numel for p in params)
    engine.destroy()
    out = torch.tensor([local, placeholders, total])
    every = [torch.zeros_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(every, out)
    return [t.tolist() for t in every]


def _damage(ckpt, case):
    """A copy of checkpoint folder `ckpt` (step_00000008 of a 2-rank ZeRO-2 run) broken as `case` says."""
    out = ckpt.parent.parent / f"damaged_{case}" / "checkpoints"
    (out / "step_00000005").mkdir(parents=True)  # an earlier checkpoint to point `latest` at
    (out / "latest").write_text({"empty_latest": "", "missing_tag": "step_00000099"}.get(case, "step_00000008"))
    if case in ("empty_latest", "missing_tag"):
        return out
    shutil.copytree(ckpt / "step_00000008", out / "step_00000008")
    if case == "no_model_states":
        (out / "step_00000008" / "mp_rank_00_model_states.pt").unlink()
    elif case == "overwritten":  # rank 1's own optimizer file, same size: only rank 1 reads it
        victim = out / "step_00000008" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 2000] = bytes(2000)
        victim.write_bytes(bytes(data))
    return out


def _tree_digest(folder):
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


CHECKPOINT_CASES = ("empty_latest", "missing_tag", "no_model_states", "overwritten", "not_shared")


def _checkpoint_checks_probe(cfg):
    """Resume from damaged copies of a 2-rank ZeRO-2 checkpoint: per case, each rank's error and the copy's
    file digests before and after (resume must never change a checkpoint)."""
    from pathlib import Path

    import torch.distributed as dist

    from fluxzero.config import get_model_config
    from fluxzero.config.deepspeed.file import load_for_training
    from fluxzero.train import engine as ds_engine
    from fluxzero.train.checkpoint import resume
    from fluxzero.train.checkpoint import store as checkpoint

    rank = dist.get_rank()
    ckpt = Path(cfg.output_dir) / "checkpoints"
    if rank == 0:
        for case in CHECKPOINT_CASES:
            _damage(ckpt, case)  # not_shared: rank 0 sees an intact copy
        (ckpt.parent.parent / "damaged_not_shared" / "other_node" / "checkpoints").mkdir(parents=True)
    dist.barrier()
    ds, v = load_for_training(cfg.deepspeed, dist.get_world_size())
    engine = ds_engine.build_engine(get_model_config(cfg.model), ds, v, torch.device("cpu"), seed=cfg.seed)
    out = {}
    for case in CHECKPOINT_CASES:
        folder = ckpt.parent.parent / f"damaged_{case}" / "checkpoints"
        if case == "not_shared" and rank == 1:  # what a node without the shared output_dir sees: nothing
            folder = folder.parent / "other_node" / "checkpoints"
        before = _tree_digest(folder) if rank == 0 else None
        try:
            tag = resume.decide_resume(cfg, v, folder)
            if tag:
                checkpoint.load(engine, folder, tag)
            error = None
        except Exception as e:  # noqa: BLE001 - the test asserts on what each rank got
            error = f"{type(e).__name__}: {e}"
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        out[case] = {"errors": errors, "unchanged": before == _tree_digest(folder) if rank == 0 else None}
    engine.destroy()
    # the output_dir check before building: rank 0 sees this run's checkpoints, rank 1 an empty folder (a node
    # without the shared disk) and resume is off: both must stop, with rank 0's sentence
    import dataclasses

    out_dir = Path(cfg.output_dir) if rank == 0 else ckpt.parent.parent / "damaged_not_shared" / "other_node"
    try:
        resume.decide_resume(
            dataclasses.replace(
                cfg, output_dir=str(out_dir), checkpoint=dataclasses.replace(cfg.checkpoint, resume=False)
            ),
            v,
            out_dir / "checkpoints",
        )
        error = None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    out["output_dir_check"] = {"errors": errors}
    return out


def launch(world, jobs, tmp):
    out = tmp / f"results_{world}.json"
    spawn_ranks(_worker, world, jobs, str(out))
    return json.loads(out.read_text())


def reference_losses(weights, steps=STEPS, seed=3):
    """Plain PyTorch: same weights, data, noise and AdamW, whole 4-sample set per step."""
    from fluxzero.model.weights import load_model

    model = load_model(weights, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    return plain_losses(model, opt, DATA4, steps, seed), model.state_dict()


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    weights = tiny_weights(tmp / "init.safetensors")
    jobs = [run_config(tmp, f"z{s}", ds_config(s), weights) for s in (0, 1, 2, 3)]
    # bf16 at ZeRO-0: the fp32 master weights live in DeepSpeed's FP16 optimizer wrapper, not in the module
    jobs.append(run_config(tmp, "z0_bf16", {**ds_config(0), "bf16": {"enabled": True}}, weights))
    jobs += [
        run_config(tmp, "z2_offload", ds_config(2, offload_optimizer=True), weights),
        run_config(tmp, "z3_offload", ds_config(3, offload_optimizer=True, offload_param=True), weights),
        run_config(tmp, "z2_accum", ds_config(2, micro=1, accum=2), weights),
    ]
    # activation checkpointing under ZeRO-3, with and without CPU parameter offload
    for impl in ("torch", "deepspeed"):
        jobs.append(run_config(tmp, f"z3_ckpt_{impl}", ds_config(3, ckpt=(1, impl)), weights))
        jobs.append(
            run_config(
                tmp,
                f"z3_offload_ckpt_{impl}",
                ds_config(3, offload_optimizer=True, offload_param=True, ckpt=(1, impl)),
                weights,
            )
        )
    # resume: 12 samples, 6 batches per epoch, 8 steps with warmup + cosine; stopped after 5 (mid-epoch)
    for s in (2, 3):
        # the schedule is DeepSpeed's (its state is in the checkpoint): 2 linear warmup steps, cosine to 0.1 x lr
        ds = {
            **ds_config(s, micro=1),
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {
                    "total_num_steps": 8,
                    "warmup_num_steps": 2,
                    "warmup_min_ratio": 0.0,
                    "cos_min_ratio": 0.1,
                    "warmup_type": "linear",
                },
            },
        }
        common = dict(data=DATA12, steps=8)
        jobs.append(run_config(tmp, f"full{s}", ds, weights, **common))
        jobs.append(run_config(tmp, f"stop{s}", ds, weights, checkpoint={"every": 2}, stop_after=5, **common))
        jobs.append(
            run_config(
                tmp, f"resumed{s}", ds, weights, checkpoint={"every": 2}, output_dir=str(tmp / f"stop{s}"), **common
            )
        )
    # resume in bf16 (ZeRO-2): fp32 master weights and optimizer states come back from the checkpoint
    ds = {**ds_config(2, micro=1), "bf16": {"enabled": True}}
    common = dict(data=DATA12, steps=6)
    jobs.append(run_config(tmp, "full_bf16", ds, weights, **common))
    jobs.append(run_config(tmp, "stop_bf16", ds, weights, stop_after=4, **common))
    jobs.append(run_config(tmp, "resumed_bf16", ds, weights, output_dir=str(tmp / "stop_bf16"), **common))
    results = launch(2, jobs, tmp)
    return {"tmp": tmp, "weights": weights, "results": results, "reference": reference_losses(weights)}


# Tolerances. fp32 on CPU; layouts differ only in summation order (gradient all-reduce across ranks,
# micro-batch means vs one batch mean), ~1e-7 relative per step, grown a little by Adam over 3 steps.
LOSS_RTOL = 1e-5


@pytest.mark.parametrize("name", ["z0", "z1", "z2", "z3", "z2_offload", "z3_offload"])
def test_every_zero_stage_matches_single_process(matrix, name):
    ref, _ = matrix["reference"]
    got = matrix["results"][name]
    assert len(got) == STEPS
    assert got == pytest.approx(ref, rel=LOSS_RTOL)
    assert got[-1] < got[0]  # it trains


def test_accumulation_equals_bigger_micro_batch(matrix):
    r = matrix["results"]
    assert r["z2_accum"] == pytest.approx(r["z2"], rel=LOSS_RTOL)


@pytest.mark.parametrize("impl", ["torch", "deepspeed"])
@pytest.mark.parametrize("offload", [False, True])
def test_activation_checkpointing_under_zero3(matrix, impl, offload):
    r = matrix["results"]
    base = "z3_offload" if offload else "z3"
    # recomputation repeats the same kernels on the same inputs: same numbers up to summation order
    assert r[f"{base}_ckpt_{impl}"] == pytest.approx(r[base], rel=LOSS_RTOL)


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_reproduces_uninterrupted_run_bit_exactly(matrix, stage):
    r = matrix["results"]
    assert len(r[f"stop{stage}"]) == 5 and len(r[f"resumed{stage}"]) == 3
    assert r[f"stop{stage}"] + r[f"resumed{stage}"] == r[f"full{stage}"]  # exact: fp32 on CPU
    ck = matrix["tmp"] / f"stop{stage}" / "checkpoints"
    assert (ck / "latest").read_text() == "step_00000008"
    for tag in ("step_00000002", "step_00000004", "step_00000005", "step_00000008"):
        assert (ck / tag / "run.yaml").is_file() and (ck / tag / "ds_config.json").is_file()


def test_export_round_trip_from_zero3_shards(matrix, tmp_path):
    from diffusers import FluxTransformer2DModel

    from fluxzero.model.weights import load_weights
    from fluxzero.train.export.full import export_checkpoint

    ckpt = matrix["tmp"] / "z3" / "checkpoints"
    # ground truth: the same training at ZeRO-0, whose checkpoint holds the whole model unpartitioned
    z0 = torch.load(
        matrix["tmp"] / "z0" / "checkpoints" / "step_00000003" / "mp_rank_00_model_states.pt", weights_only=False
    )["module"]
    trained = {k: v.float() for k, v in z0.items()}
    init = load_weights(matrix["weights"])
    assert len(list((ckpt / "step_00000003").glob("zero_pp_rank_*_optim_states.pt"))) == 2  # really sharded
    for layout in ("bfl", "comfyui", "diffusers"):
        out = tmp_path / (layout if layout == "diffusers" else f"{layout}.safetensors")
        export_checkpoint(ckpt, out, layout, "fp32")
        back = load_weights(out)
        assert set(back) == set(trained)
        # ZeRO-3 reduce-scatters where ZeRO-0 all-reduces: a few elements land ~3e-6 apart after 3 Adam
        # steps (observed); training itself moved weights by ~3e-3 and a mis-assembled shard by ~0.1.
        for k, v in trained.items():
            torch.testing.assert_close(back[k], v, rtol=0, atol=2e-5, msg=k)
        assert max((back[k] - init[k]).abs().max() for k in init) > 1e-3  # trained weights, not the init
    # one ZeRO-3 checkpoint folder named directly (it has per-rank model states, no mp_rank_00 file)
    export_checkpoint(ckpt / "step_00000003", tmp_path / "tag.safetensors", "bfl", "fp32")
    assert all(torch.equal(v, back[k]) for k, v in load_weights(tmp_path / "tag.safetensors").items())
    # ZeRO-1/2 consolidation of the same run is bit-identical to ZeRO-0 (2 ranks: one addition per element);
    # ZeRO-0 itself is exported from its module states
    for stage in (0, 1, 2):
        export_checkpoint(
            matrix["tmp"] / f"z{stage}" / "checkpoints", tmp_path / f"z{stage}.safetensors", "bfl", "fp32"
        )
        got = load_weights(tmp_path / f"z{stage}.safetensors")
        assert all(torch.equal(got[k], trained[k]) for k in trained), stage
    diff = FluxTransformer2DModel.from_pretrained(tmp_path / "diffusers")
    assert diff.config.num_layers == 2 and diff.config.guidance_embeds
    torch.testing.assert_close(diff.x_embedder.weight, trained["img_in.weight"], rtol=0, atol=2e-5)
    # bf16 export: the same weights rounded
    export_checkpoint(ckpt, tmp_path / "bf16.safetensors", "bfl", "bf16")
    b16 = load_weights(tmp_path / "bf16.safetensors")
    k = "double_blocks.0.img_attn.qkv.weight"
    assert b16[k].dtype == torch.bfloat16 and torch.equal(b16[k], back[k].bfloat16())


def test_resume_in_bf16(matrix):
    r = matrix["results"]
    # Exact on CPU too: the fp32 master weights and Adam moments come back bit for bit and the bf16 copy is
    # derived from them. (On GPUs, kernels may choose other algorithms after a restart: allow bf16 noise there.)
    assert r["stop_bf16"] + r["resumed_bf16"] == r["full_bf16"]


def test_zero3_ranks_hold_only_their_partition(matrix):
    from fluxzero.config import get_model_config

    total = get_model_config("flux-tiny").num_params()
    probe = matrix["results"]["z3_partition"]
    assert [row[2] for row in probe] == [total, total]
    assert all(row[1] == 0 for row in probe)  # no rank materialises the model
    assert sum(row[0] for row in probe) >= total and all(row[0] <= total // 2 + 64 for row in probe)


@pytest.mark.parametrize(
    "case, expected",
    [
        (
            "empty_latest",
            "damaged_empty_latest/checkpoints/latest is empty; write step_00000005 (the newest checkpoint "
            "before it) into",
        ),
        ("missing_tag", "latest names 'step_00000099', which is not a folder in "),
        (
            "no_model_states",
            "step_00000008 is incomplete or corrupt (mp_rank_00_model_states.pt is missing); write step_00000005",
        ),
        (
            "overwritten",
            "step_00000008 is incomplete or corrupt (zero_pp_rank_1_mp_rank_00_optim_states.pt fails its CRC-32 check",
        ),
        ("not_shared", "rank 1 (host "),
    ],
)
def test_resume_refuses_damaged_checkpoints_on_every_rank(matrix, case, expected):
    got = matrix["results"]["checkpoint_checks"][case]
    first, second = got["errors"]
    assert first == second, got  # both ranks stop with the same sentence, none waits in a collective
    assert first.startswith("TrainingError: ") and expected in first, first
    assert "\n" not in first
    if case == "not_shared":
        assert "output_dir must be on a filesystem all nodes share" in first
    assert got["unchanged"]  # the user's checkpoint files are never modified or deleted


def test_output_dir_is_judged_by_rank_0_for_every_rank(matrix):
    first, second = matrix["results"]["checkpoint_checks"]["output_dir_check"]["errors"]
    assert first == second and first.startswith("TrainingError: ") and "resume is off" in first, (first, second)


def test_checkpoint_file_names_match_deepspeed(matrix):
    from fluxzero.train.checkpoint.integrity import checkpoint_files

    for name, stage, bf16 in [
        ("z0", 0, False),
        ("z1", 1, False),
        ("z2", 2, False),
        ("z3", 3, False),
        ("z0_bf16", 0, True),
        ("full_bf16", 2, True),
    ]:
        tag_dir = matrix["tmp"] / name / "checkpoints" / (matrix["tmp"] / name / "checkpoints" / "latest").read_text()
        expected = set()
        for rank in (0, 1):
            own, shared = checkpoint_files(stage, bf16, rank)
            expected |= set(own) | set(shared)
        assert expected == {f.name for f in tag_dir.glob("*.pt")}, name


def test_fp32_export_of_bf16_runs_is_the_fp32_master_weights(matrix, tmp_path):
    from fluxzero.model.weights import load_weights
    from fluxzero.train.export.full import export_checkpoint

    # ZeRO-0: the masters are the optimizer wrapper's fp32_groups, in module parameter order
    tag_dir = matrix["tmp"] / "z0_bf16" / "checkpoints" / "step_00000003"
    states = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    module = states["module"]
    masters = [t for group in states["optimizer"]["fp32_groups"] for t in group]
    assert len(masters) == len(module) and not states["buffer_names"]
    export_checkpoint(tag_dir, tmp_path / "z0.safetensors", "bfl", "fp32")
    got = load_weights(tmp_path / "z0.safetensors")
    for (k, _v), master in zip(module.items(), masters):
        assert got[k].dtype == torch.float32 and torch.equal(got[k], master), k
    # ZeRO-2 (zero_to_fp32 reads the fp32 partitions): the same properties, checked without DeepSpeed's names
    for run, tag_dir in [
        ("z0_bf16", tag_dir),
        ("full_bf16", matrix["tmp"] / "full_bf16" / "checkpoints" / "step_00000006"),
    ]:
        export_checkpoint(tag_dir, tmp_path / f"{run}.safetensors", "bfl", "fp32")
        got = load_weights(tmp_path / f"{run}.safetensors")
        module = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
        # the bf16 weights are the masters rounded; after a few Adam steps many masters lie between bf16 values
        assert all(torch.equal(got[k].bfloat16(), v) for k, v in module.items()), run
        assert sum(int((got[k] != v.float()).sum()) for k, v in module.items()) > 1000, run
