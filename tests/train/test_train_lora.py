"""LoRA in the trainer: the run file's lora section, the adapter count for the memory model, bad input through
launch/train.py, `fluxzero sample --lora`, and (slow) real 2-rank training under ZeRO-2 and ZeRO-3: parity
with plain PyTorch, exact resume, adapter-only checkpoints, continuing from a LoRA file, and the export that
diffusers loads.

DeepSpeed never runs in the pytest process for training (forked workers could hang): the trainer runs in a
child process (launch/train.py) or in spawned ranks.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fluxzero.config import LoraConfig, TrainConfig, get_model_config, lora_param_count
from fluxzero.config.lora import TARGET_PRESETS
from tests.helpers import (
    TRAINER_CHILD,
    close_group,
    enter_training_rank,
    exit_rank,
    plain_losses,
    spawn_ranks,
    tiny_ds,
    tiny_weights,
)

ROOT = Path(__file__).resolve().parents[2]
DATA4 = "synthetic:n=4,hw=8x8,txt=4,ctx=64,vec=32"
LR = 1e-2  # larger than a full fine-tune's: B starts at 0 and must move visibly in 4 steps
LORA = {"rank": 4, "alpha": 8, "targets": "all-linear"}
# fp32 on CPU; ranks and ZeRO stages differ from one process only in summation order (~1e-7 per step),
# grown a little by Adam over 4 steps: the same bound as tests/train/test_train_distributed.py
LOSS_RTOL = 1e-5
# exported LoRA in diffusers vs our LoRA model, fp32: the same math in another op order (test_lora.py says why)
OUT_RTOL = 1e-5


# ---------------------------------------------------------------------------------------------------------
# Pure: adapter count, run file
# ---------------------------------------------------------------------------------------------------------
# flux-dev on meta: ~3 s per PEFT injection over 12B parameters, so two of its cases
@pytest.mark.parametrize(
    "name, targets",
    [("flux-tiny", t) for t in (*TARGET_PRESETS, ["*"])]
    + [("flux-dev", "attention+mlp"), ("flux-dev", ["*"]), ("flux-tiny", ["double_blocks.0.*", "final_layer.linear"])],
)
def test_lora_param_count_equals_apply_lora(name, targets):
    from fluxzero.model import build_model
    from fluxzero.model.lora import apply_lora

    lcfg = LoraConfig(rank=8, targets=targets)
    model = build_model(name, device="meta")  # flux-dev: 12B parameters that never exist
    apply_lora(model, lcfg)
    real = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_param_count(get_model_config(name), lcfg) == real
    if name == "flux-dev" and targets == "attention+mlp":
        assert real == 8 * (
            19 * 2 * (3072 * 4 + 3072 * 2 + 2 * (3072 + 12288)) + 38 * (3072 * 4 + 12288 + 3072 * 2 + 12288)
        )


def test_lora_param_count_imports_no_torch():
    from tests.pure_python import run_without_torch

    r = run_without_torch(
        "from fluxzero.config import LoraConfig, get_model_config, lora_param_count; "
        "print(lora_param_count(get_model_config('flux-dev'), LoraConfig(rank=16)))"
    )
    assert r.returncode == 0 and int(r.stdout) > 0, r.stderr


def test_run_file_lora_section(tmp_path):
    from fluxzero.config.runfile import ConfigError, config_text, load_config

    run = tmp_path / "run.yaml"
    run.write_text("deepspeed: ds.json\ndata: d\noutput_dir: o\nweights: base.safetensors\nlora:\n  rank: 8\n")
    cfg = load_config(str(run), ["lora.targets=[single_blocks.*.linear1]", "export.merged=true"])
    assert cfg.lora == LoraConfig(rank=8, targets=["single_blocks.*.linear1"]) and cfg.lora.alpha == 8.0
    assert TrainConfig.from_dict(yaml.safe_load(config_text(cfg))) == cfg  # what a checkpoint's run.yaml holds
    assert load_config(str(run), ["lora=null"]).lora is None
    for over, words in [
        (["lora.rank=0"], "lora.rank must be a whole number of at least 1, got 0"),
        (["lora.rnak=4"], "unknown lora keys ['rnak']"),
        (["lora=4"], "lora must be a mapping of LoRA options"),
        (["lora=null", "export.merged=true"], "export.merged merges a LoRA into its base weights"),
        (["weights=null", "export.merged=true"], "export.merged needs the base weights"),
        # `lora` is the nearest run-file key to `lr`: the sentence must point at the DeepSpeed config
        (["lr=1e-4"], "lr is set in the DeepSpeed config now (optimizer.params.lr in ds.json)"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(str(run), over)
        assert words in str(e.value) and "\n" not in str(e.value), over


# ---------------------------------------------------------------------------------------------------------
# Files: the weights loader, `fluxzero sample --lora`
# ---------------------------------------------------------------------------------------------------------
def _lora_model(lcfg, seed=0, name="flux-tiny"):
    """(our Flux with a random base, a LoRA with random non-zero B applied, the base's state dict)."""
    from fluxzero.model import build_model
    from fluxzero.model import lora as L

    torch.manual_seed(seed)
    model = build_model(name)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    L.apply_lora(model, lcfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:  # B starts at 0 (no change); make the adapters move the output
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval(), base


def test_weights_loader_names_a_lora_file(tmp_path):
    from fluxzero.model import lora as L
    from fluxzero.model.layouts import WeightsError
    from fluxzero.model.lora_formats import save_lora
    from fluxzero.model.weights import load_weights

    lcfg = LoraConfig(rank=2)
    model, _ = _lora_model(lcfg)
    for layout in ("diffusers", "kohya"):
        save_lora(tmp_path / f"{layout}.safetensors", L.lora_state_dict(model), lcfg, layout=layout)
        with pytest.raises(WeightsError) as e:
            load_weights(tmp_path / f"{layout}.safetensors")
        assert str(e.value).endswith(
            f"{layout}.safetensors is a LoRA file (adapters only), not full model weights; "
            "give the base model's weights here and the LoRA to lora.weights in the run "
            "file (or `fluxzero sample --lora`)"
        ), str(e.value)


def test_sample_lora_merges_into_the_weights(tmp_path):
    import click

    from fluxzero.commands.sample import _apply_adapters
    from fluxzero.model import lora as L
    from fluxzero.model.lora_formats import save_lora
    from fluxzero.model.weights import load_model, save_weights
    from tests.model.test_model import make_inputs

    lcfg = LoraConfig(rank=4, alpha=2, targets="all-linear")  # scale 0.5: the file's alpha must be used
    model, base = _lora_model(lcfg)
    save_weights(base, tmp_path / "base.safetensors")
    x = make_inputs(model.config, batch=1, h=2, w=3, txt_len=4, seed=3)
    with torch.no_grad():
        want = model(**x)
        plain = load_model(tmp_path / "base.safetensors", dtype=torch.float32)(**x)
    assert ((plain - want).norm() / want.norm()) > 0.03  # the LoRA moves the output far beyond the tolerance
    for layout in ("diffusers", "kohya"):
        path = tmp_path / f"{layout}.safetensors"
        save_lora(path, L.lora_state_dict(model), lcfg, layout=layout)
        merged, record = _apply_adapters(load_model(tmp_path / "base.safetensors", dtype=torch.float32), path)
        assert record == {"path": str(path.resolve()), "layout": layout, "scale": 1.0, "rank": 4, "alpha": 2.0}
        with torch.no_grad():
            got = merged(**x)
        # fp32: W + s B A rounded once per weight vs the two-branch LoRA forward, ~1e-7 relative
        assert ((got - want).norm() / want.norm()) <= OUT_RTOL, layout
    from fluxzero.model import build_model

    wide = build_model(get_model_config("flux-tiny").replace(hidden_size=96, num_heads=4, axes_dim=(8, 8, 8)))
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    for target, bad, words in [
        (
            wide,
            tmp_path / "kohya.safetensors",
            "makes a (64, 64) update but double_blocks.0.img_attn.proj.weight "
            "is (96, 96); the LoRA was made for another model shape",
        ),
        (merged, tmp_path / "base.safetensors", "base.safetensors is a full model weights file, not a LoRA"),
    ]:
        with pytest.raises(click.BadParameter) as e:
            _apply_adapters(target, bad)
        assert words in e.value.message and "\n" not in e.value.message, e.value.message
    assert all(torch.equal(v, before[k]) for k, v in wide.state_dict().items())  # refused before any change


# ---------------------------------------------------------------------------------------------------------
# Bad input through launch/train.py: one sentence each, exit 1
# ---------------------------------------------------------------------------------------------------------
def _ds(stage=2, **kw):
    return tiny_ds(stage, clipping=0.0, lr=LR, weight_decay=0.0, **kw)


# launch/train.py is `sys.exit(main())`: one child process calls main() once per case, sharing the imports
_CHILD = (
    TRAINER_CHILD
    + """
import contextlib, io
results = {}
for name, argv in json.load(open(sys.argv[1])):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    results[name] = [code, err.getvalue()]
json.dump(results, open(sys.argv[2], "w"))
"""
)


def test_bad_lora_input_through_the_trainer(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from fluxzero.model import lora as L
    from fluxzero.model.lora_formats import save_lora
    from fluxzero.sampling.embeddings import FORMAT, VERSION, PromptEmbeddings, save_embeddings

    lcfg = LoraConfig(rank=4)
    model, base = _lora_model(lcfg)
    lora_file = tmp_path / "rank4.safetensors"
    save_lora(lora_file, L.lora_state_dict(model), lcfg, layout="kohya")
    with safe_open(str(lora_file), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file(tensors, str(tmp_path / "rank_text.safetensors"), metadata={**meta, "fluxzero.rank": "four"})
    up = next(k for k in sorted(tensors) if k.endswith(".lora_up.weight"))
    save_file({**tensors, up: torch.full_like(tensors[up], float("nan"))}, str(tmp_path / "nan.safetensors"), meta)
    # preview prompts: another T5 width (flux-tiny's is 64), NaN T5 values (written raw: the writer refuses them)
    from diffusers import AutoencoderKL

    AutoencoderKL(
        latent_channels=16,
        block_out_channels=(8,),
        norm_num_groups=8,
        layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
    ).save_pretrained(tmp_path / "vae")
    save_embeddings(
        tmp_path / "wide.safetensors", PromptEmbeddings(["a cat"], torch.randn(1, 4, 128), torch.randn(1, 32))
    )
    save_file(
        {"t5": torch.full((1, 4, 64), float("nan")), "clip_pooled": torch.randn(1, 32)},
        str(tmp_path / "emb_nan.safetensors"),
        {"format": FORMAT, "version": VERSION, "prompts": '["a cat"]'},
    )
    previews = ["sample.every=1", f"sample.vae={tmp_path / 'vae'}", "sample.size=16x16", "sample.steps=1"]
    from fluxzero.model.weights import save_weights

    save_weights(base, tmp_path / "base.safetensors")  # another base than the run's (random init)
    (tmp_path / "ds.json").write_text(json.dumps(_ds()))
    (tmp_path / "ds3c.json").write_text(json.dumps(_ds(3, fluxzero={"compile": {"blocks": True, "backend": "eager"}})))
    run = {
        "deepspeed": str(tmp_path / "ds.json"),
        "data": DATA4,
        "steps": 1,
        "export": {"format": None},
        "lora": {"rank": 4},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    cases = {  # name: (overrides, output_dir, start of the one error line; None: trains)
        "rank": (["lora.rank=0"], "rank", "lora.rank must be a whole number of at least 1, got 0; set e.g. rank: 16"),
        "pattern": (
            ["lora.targets=[double_blocks.*.img_attn.qvk]"],
            "pattern",
            "lora.targets pattern 'double_blocks.*.img_attn.qvk' matches no linear layer of flux-tiny; "
            "patterns are fnmatch globs over whole module names such as double_blocks.*.img_attn.qkv or "
            "single_blocks.*.linear1",
        ),
        "shape": (
            ["lora.rank=8", f"lora.weights={lora_file}"],
            "shape",
            f"{lora_file}: LoRA tensor double_blocks.0.img_attn.qkv.lora_A.weight has shape (4, 64) in the file "
            f"but (8, 64) in the model; the file was made for another model shape or rank",
        ),
        "compile_zero3": (
            [f"deepspeed={tmp_path / 'ds3c.json'}"],
            "compile_zero3",
            "compiled blocks (fluxzero.compile.blocks) with LoRA under ZeRO-3 fail in DeepSpeed 0.19.8's backward pass",
        ),
        "header": (
            [f"lora.weights={tmp_path / 'rank_text.safetensors'}"],
            "header",
            f"{tmp_path / 'rank_text.safetensors'}: header entry fluxzero.rank is 'four', not a whole number",
        ),
        "nan": (
            [f"lora.weights={tmp_path / 'nan.safetensors'}"],
            "nan",
            f"{tmp_path / 'nan.safetensors'}: {up} holds NaN or infinite values",
        ),
        "prompts_width": (
            [*previews, f"sample.prompts={tmp_path / 'wide.safetensors'}"],
            "prompts_width",
            f"sample.prompts {tmp_path / 'wide.safetensors'}: the prompt embeddings are T5 128 / CLIP "
            "32 wide but model 'flux-tiny' takes 64 / 32",
        ),
        "prompts_nan": (
            [*previews, f"sample.prompts={tmp_path / 'emb_nan.safetensors'}"],
            "prompts_nan",
            f"sample.prompts {tmp_path / 'emb_nan.safetensors'}: t5 holds NaN or infinite values",
        ),
        "trains": ([f"lora.weights={lora_file}"], "run", None),
        "resume_without_lora": (
            ["lora=null"],
            "run",
            "is a checkpoint of a LoRA but the run file trains the full "
            "model (no lora section); add its lora section back, or choose another output_dir",
        ),
        "resume_other_rank": (
            ["lora.rank=8", "steps=2"],
            "run",
            "was trained with lora.rank=4, lora.alpha=4.0 but "
            "this run has lora.rank=8, lora.alpha=8.0; resume with the checkpoint's values",
        ),
        "resume_other_base": (
            [f"weights={tmp_path / 'base.safetensors'}", "steps=2"],
            "run",
            "is a LoRA trained on weights=None but this run has weights=",
        ),
    }
    todo = [
        [name, ["--config", str(tmp_path / "run.yaml"), f"output_dir={tmp_path / out}", *over]]
        for name, (over, out, _) in cases.items()
    ]
    (tmp_path / "cases.json").write_text(json.dumps(todo))
    subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "cases.json"), str(tmp_path / "results.json")],
        cwd=ROOT,
        check=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    results = json.loads((tmp_path / "results.json").read_text())
    for name, (_, _out, words) in cases.items():
        code, err = results[name]
        if words is None:
            assert code == 0, err
            continue
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 1 and len(lines) == 1 and "Traceback" not in err, (name, err[-2000:])
        assert words in lines[0], (name, lines[0])
    refused_at_start = ("rank", "pattern", "shape", "compile_zero3", "header", "nan", "prompts_width", "prompts_nan")
    assert not any((tmp_path / n / "checkpoints").exists() for n in refused_at_start)
    assert not any((tmp_path / n / "samples").exists() for n in refused_at_start)  # before the first step's preview
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step_00000001"  # refusals changed nothing


# ---------------------------------------------------------------------------------------------------------
# Slow: 2 ranks, ZeRO-2 and ZeRO-3, one spawned launch for every run
# ---------------------------------------------------------------------------------------------------------
def _worker(rank, world, port, jobs, probe, out_file):
    enter_training_rank(rank, world, port)
    from fluxzero.train.loop import train

    results, done = {}, False
    try:
        for name, cfg in jobs:
            results[name] = train(TrainConfig.from_dict(cfg))["losses"]
        results["probe"] = _continue_probe(TrainConfig.from_dict(probe))
        done = True
    finally:
        close_group(done)
    exit_rank(rank, out_file, results)


def _continue_probe(cfg):
    """ZeRO-3 engine built from a LoRA file (lora.weights): are the adapters ZeRO parameters, how much of them
    does each rank hold, and do they equal the file once gathered?"""
    import deepspeed
    import torch.distributed as dist

    from fluxzero.config.deepspeed.file import load_for_training
    from fluxzero.model import lora as L
    from fluxzero.model.lora_formats import read_lora
    from fluxzero.train import engine as ds_engine

    ds, v = load_for_training(cfg.deepspeed, dist.get_world_size())
    engine = ds_engine.build_engine(
        get_model_config(cfg.model), ds, v, torch.device("cpu"), seed=cfg.seed, weights=cfg.weights, lora=cfg.lora
    )
    adapters = [p for p in engine.module.parameters() if p.requires_grad]
    out = {
        "zero_params": all(hasattr(p, "ds_id") for p in adapters),
        "held": sum(p.ds_tensor.numel() for p in adapters),
        "total": sum(p.ds_numel for p in adapters),
        "dtype": str(adapters[0].ds_tensor.dtype),
    }
    with deepspeed.zero.GatheredParameters(adapters):
        got = {k: t.clone() for k, t in L.lora_state_dict(engine.module).items()}
    want, _ = read_lora(cfg.lora.weights, scale=cfg.lora.scale)
    out["equal_to_file"] = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    engine.destroy()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, out)
    return every


def _reference_losses(weights, steps, seed=3):
    """Plain PyTorch and PEFT: the base loaded, adapters drawn as build_engine draws them, AdamW on the adapters
    only, the whole 4-sample set per step (2 ranks x micro batch 2 in the trainer)."""
    from fluxzero.model import build_model
    from fluxzero.model.lora import apply_lora
    from fluxzero.model.weights import load_weights

    torch.manual_seed(seed)  # build_engine's order: seed, build (random init), load the weights, apply_lora
    model = build_model("flux-tiny")
    model.load_state_dict(load_weights(weights, dtype=torch.float32))
    apply_lora(model, LoraConfig(**LORA))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    return plain_losses(model, opt, DATA4, steps, seed)


STEPS = 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_dist")
    weights = tiny_weights(tmp / "base.safetensors")
    ckpt = {
        "torch": {"every_k_blocks": 1, "implementation": "torch"},
        "deepspeed": {"every_k_blocks": 1, "implementation": "deepspeed"},
    }
    configs = {  # persistence threshold 0: the adapters are partitioned too (they are below the default 1e5)
        "z2": _ds(2, fluxzero={"activation_checkpointing": ckpt["torch"]}),
        "z3": _ds(
            3,
            zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0},
            fluxzero={"activation_checkpointing": ckpt["deepspeed"]},
        ),
        "z2_bf16": _ds(2, bf16={"enabled": True}, fluxzero={"activation_checkpointing": ckpt["deepspeed"]}),
        "z3_bf16": _ds(3, bf16={"enabled": True}),
    }
    for name, ds in configs.items():
        (tmp / f"{name}.json").write_text(json.dumps(ds))

    def job(name, ds, **kw):
        cfg = {
            "deepspeed": str(tmp / f"{ds}.json"),
            "data": DATA4,
            "output_dir": str(tmp / name),
            "model": "flux-tiny",
            "weights": str(weights),
            "steps": STEPS,
            "seed": 3,
            "lora": LORA,
            "export": {"format": None},
        }
        return name, {**cfg, **kw}

    jobs = [
        job("z2", "z2", export={"format": "diffusers", "dtype": "fp32", "merged": True}),
        job("stop2", "z2", stop_after=2),
        job("resumed2", "z2", output_dir=str(tmp / "stop2"), export={"format": "comfyui"}),
        job("z3", "z3", export={"format": "comfyui", "dtype": "fp32"}),
        job("stop3", "z3", stop_after=2),
        job("resumed3", "z3", output_dir=str(tmp / "stop3"), export={"format": "diffusers", "dtype": "fp32"}),
        job("z2_bf16", "z2_bf16", steps=3),
        job("z3_bf16", "z3_bf16", steps=3),  # here the adapters stay fp32 (engine.apply_adapters says why)
    ]
    # continue from z2's exported LoRA file under ZeRO-3: the file's adapters, partitioned across the ranks
    probe = job("probe", "z3", lora={**LORA, "weights": str(tmp / "z2" / "lora.safetensors")})[1]
    out = tmp / "results.json"
    spawn_ranks(_worker, 2, jobs, probe, str(out))
    result = {
        "tmp": tmp,
        "weights": weights,
        "results": json.loads(out.read_text()),
        "reference": _reference_losses(weights, STEPS),
    }
    if os.environ.get("FLUXZERO_DEBUG"):
        print(json.dumps({k: v for k, v in result.items() if k != "tmp" and k != "weights"}))
    return result


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z2", "z3"])
def test_lora_training_matches_plain_torch(trained, name):
    # z2 checkpoints with torch's non-reentrant checkpoint, z3 with DeepSpeed's reentrant one: a block
    # whose adapters got no gradient would train differently from the reference from step 2 on
    got, ref = trained["results"][name], trained["reference"]
    assert got == pytest.approx(ref, rel=LOSS_RTOL) and got[-1] < got[0], (got, ref)
    # bf16 base (and, at ZeRO-2, bf16 adapters with fp32 masters in the optimizer): measured <= 1e-4 relative
    # from the fp32 reference over 3 steps; adapters that did not train are 1.7e-3 / 3.2e-3 off at steps 2 / 3
    for bf16 in ("z2_bf16", "z3_bf16"):
        assert trained["results"][bf16] == pytest.approx(ref[:3], rel=5e-4), (bf16, trained["results"][bf16], ref)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_lora_resume_is_exact(trained, stage):
    r = trained["results"]
    assert len(r[f"stop{stage}"]) == 2 and r[f"stop{stage}"] + r[f"resumed{stage}"] == r[f"z{stage}"]


@pytest.mark.slow
def test_lora_checkpoints_hold_the_adapters_only(trained):
    from fluxzero.train.checkpoint.integrity import checkpoint_files

    tmp = trained["tmp"]
    full_bytes = trained["weights"].stat().st_size  # the fp32 base: 2.0 MB for flux-tiny
    adapter_numel = lora_param_count(get_model_config("flux-tiny"), LoraConfig(**LORA))
    for name, stage, bf16 in [("z2", 2, False), ("z3", 3, False), ("z2_bf16", 2, True), ("z3_bf16", 3, True)]:
        tag_dir = tmp / name / "checkpoints" / (tmp / name / "checkpoints" / "latest").read_text()
        expected = set()
        for rank in (0, 1):
            own, shared = checkpoint_files(stage, bf16, rank)
            expected |= set(own) | set(shared)
        assert expected == {f.name for f in tag_dir.glob("*.pt")}, name
        size = sum(f.stat().st_size for f in tag_dir.glob("*.pt"))
        # fp32 master + two Adam moments of each adapter (+ the module copy), and no base
        assert size < 5 * 4 * adapter_numel + 200_000 < full_bytes, (name, size, full_bytes)
        if stage == 2:
            module = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)["module"]
            assert module and all(".lora_" in k for k in module), name
            assert {v.dtype for v in module.values()} == {torch.bfloat16 if bf16 else torch.float32}
            assert all(v.abs().max() > 0 for k, v in module.items() if ".lora_B." in k), name  # B moved off 0


@pytest.mark.slow
def test_continue_from_a_lora_file_under_zero3(trained):
    probe = trained["results"]["probe"]
    total = lora_param_count(get_model_config("flux-tiny"), LoraConfig(**LORA))
    for row in probe:
        assert row["zero_params"] and row["equal_to_file"] and row["total"] == total, row
        assert row["held"] <= total // 2 + 2 * 64, row  # each rank holds about half of every adapter
        assert row["dtype"] == "torch.float32"


def _trained_model(trained, name):
    """Our Flux with the base and the trained adapters of run `name` (its checkpoint, consolidated)."""
    from fluxzero.model import build_model
    from fluxzero.model.lora import apply_lora, load_lora_state_dict
    from fluxzero.model.weights import load_weights
    from fluxzero.train.export.consolidate import consolidated_state_dict
    from fluxzero.train.export.lora import canonical_lora

    model = build_model("flux-tiny")
    model.load_state_dict(load_weights(trained["weights"], dtype=torch.float32))
    apply_lora(model, LoraConfig(**LORA))
    sd, _ = consolidated_state_dict(trained["tmp"] / name)
    load_lora_state_dict(model, canonical_lora(sd))
    return model.eval()


def _inputs():
    from tests.model.test_model import make_inputs

    return make_inputs(get_model_config("flux-tiny"), batch=2, h=3, w=4, txt_len=5, seed=7)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z2", "stop3"])  # ZeRO-2, and ZeRO-3 stopped and resumed
def test_exported_lora_loads_in_diffusers_and_reproduces_the_trained_model(trained, name, tmp_path):
    diffusers = pytest.importorskip("diffusers")
    from diffusers.loaders import FluxLoraLoaderMixin

    from fluxzero.model.weights import save_weights
    from tests.model.test_model_parity import run_theirs

    tmp = trained["tmp"]
    x = _inputs()
    ours = _trained_model(trained, name)
    with torch.no_grad():
        want = ours(**x)
    save_weights(_base(trained), tmp_path / "base", layout="diffusers")
    theirs = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "base").eval()
    with torch.no_grad():
        before = run_theirs(theirs, x)
    assert _rel(before, want) > 1e-2, _rel(before, want)  # the 4 steps moved the output (measured 6.6e-2)
    lora = tmp / name / "lora.safetensors"  # export.format diffusers: the diffusers/PEFT layout
    sd, metadata = FluxLoraLoaderMixin.lora_state_dict(str(lora), return_lora_metadata=True)
    theirs.load_lora_adapter(sd, prefix="transformer", metadata=metadata)
    with torch.no_grad():
        err = _rel(run_theirs(theirs, x), want)
    if os.environ.get("FLUXZERO_DEBUG"):
        print(f"{name}: exported LoRA in diffusers vs ours {err:.2e}, base vs trained {_rel(before, want):.2e}")
    assert err <= OUT_RTOL, err
    meta = _header(lora)
    assert meta["fluxzero.base_model"] == "flux-tiny" and meta["fluxzero.rank"] == "4"
    assert meta["fluxzero.format"] == "diffusers"


@pytest.mark.slow
def test_kohya_export_holds_the_trained_adapters(trained):
    # diffusers' kohya converter hard-codes FLUX.1's widths for single_blocks.N.linear1 (test_lora.py checks the
    # layout against it at full width); here: the run's kohya file holds exactly the consolidated fp32 adapters
    from fluxzero.model.lora_formats import read_lora
    from fluxzero.train.export.consolidate import consolidated_state_dict
    from fluxzero.train.export.lora import canonical_lora

    got, info = read_lora(trained["tmp"] / "z3" / "lora.safetensors")  # export.format comfyui, fp32
    want = canonical_lora(consolidated_state_dict(trained["tmp"] / "z3")[0])
    assert info.layout == "kohya" and (info.rank, info.alpha) == (4, 8.0) and set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert _header(trained["tmp"] / "z3" / "lora.safetensors")["ss_network_dim"] == "4"


def _base(trained):
    from fluxzero.model.weights import load_weights

    return load_weights(trained["weights"], dtype=torch.float32)


def _header(path):
    with open(path, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]


@pytest.mark.slow
def test_merged_export_and_the_export_command(trained, tmp_path):
    from click.testing import CliRunner

    from fluxzero.cli import main as cli
    from fluxzero.model.lora_formats import read_lora
    from fluxzero.model.weights import load_model

    tmp = trained["tmp"]
    x = _inputs()
    with torch.no_grad():
        want = _trained_model(trained, "z2")(**x)
        merged = load_model(tmp / "z2" / "export", dtype=torch.float32)(**x)  # export.merged: the diffusers folder
    assert _rel(merged, want) <= OUT_RTOL
    runner = CliRunner()
    dead = int(
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    )  # what exports killed while writing left
    for name in ("k", "m"):
        (tmp_path / f".{name}.safetensors.tmp-{dead}").write_bytes(b"half an export")
    r = runner.invoke(
        cli, ["export", str(tmp / "z3"), str(tmp_path / "k.safetensors"), "--format", "comfyui", "--dtype", "fp32"]
    )
    assert r.exit_code == 0, r.output
    assert "(LoRA, kohya layout for comfyui, fp32, live weights)" in r.output, r.output
    # what the run wrote at its end: the same file, byte for byte (the header in a fixed order)
    assert (tmp_path / "k.safetensors").read_bytes() == (tmp / "z3" / "lora.safetensors").read_bytes()
    got, info = read_lora(tmp_path / "k.safetensors")
    want_sd, _ = read_lora(tmp / "z3" / "lora.safetensors")
    assert info.layout == "kohya" and all(torch.equal(got[k], want_sd[k]) for k in want_sd)
    (tmp_path / "k.safetensors").chmod(0o604)  # a user's chmod survives --overwrite
    r = runner.invoke(
        cli,
        [
            "export",
            str(tmp / "z3"),
            str(tmp_path / "k.safetensors"),
            "--format",
            "comfyui",
            "--dtype",
            "fp32",
            "--overwrite",
        ],
    )
    assert r.exit_code == 0 and oct((tmp_path / "k.safetensors").stat().st_mode & 0o777) == oct(0o604), r.output
    r = runner.invoke(cli, ["export", str(tmp / "z3"), str(tmp_path / "m.safetensors"), "--merge", "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    assert "(full weights with the LoRA merged in, bfl, fp32, live weights)" in r.output, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.safetensors", "m.safetensors"]  # the temps are gone
    with torch.no_grad():
        z3 = _trained_model(trained, "z3")(**x)
        assert _rel(load_model(tmp_path / "m.safetensors", dtype=torch.float32)(**x), z3) <= OUT_RTOL
    r = runner.invoke(
        cli,
        [
            "export",
            str(tmp / "z3"),
            str(tmp_path / "b.safetensors"),
            "--merge",
            "--base",
            str(tmp / "z2" / "lora.safetensors"),
        ],
    )
    assert r.exit_code != 0 and "is a LoRA file (adapters only), not full model weights" in r.output, r.output


_STAGES = (
    TRAINER_CHILD
    + """
from fluxzero.config import TrainConfig
from fluxzero.model.lora_formats import read_lora
results = {}
for name, cfg in json.load(open(sys.argv[1])):
    losses = train(TrainConfig.from_dict(cfg))["losses"]
    file = "/lora_ema.safetensors" if cfg["export"].get("weights") == "ema" else "/lora.safetensors"
    results[name] = [losses, sorted(read_lora(cfg["output_dir"] + file)[0])]
json.dump(results, open(sys.argv[2], "w"))
"""
)


@pytest.mark.slow
def test_lora_at_zero_0_with_offload_and_ema(tmp_path):
    # one rank: the other stages and DeepSpeed's CPU offload (optimizer at ZeRO-2, parameters too at ZeRO-3)
    # train the same LoRA (fp32: the same numbers) and export it; ZeRO-0 bf16 through the FP16 wrapper's masters
    configs = {
        "z0": {"stage": 0},
        "z2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "z3_offload": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
        "z0_bf16": {"stage": 0},
        "z2_ema": {"stage": 2},
    }
    jobs = []
    for name, zero in configs.items():
        ds = _ds(train_micro_batch_size_per_gpu=4, zero_optimization=zero, zero_force_ds_cpu_optimizer=False)
        if name.endswith("bf16"):
            ds["bf16"] = {"enabled": True}
        (tmp_path / f"{name}.json").write_text(json.dumps(ds))
        jobs.append(
            [
                name,
                {
                    "deepspeed": str(tmp_path / f"{name}.json"),
                    "data": DATA4,
                    "steps": 3,
                    "seed": 3,
                    "output_dir": str(tmp_path / name),
                    "lora": LORA,
                    "export": {"format": "diffusers"},
                },
            ]
        )
    jobs[-1][1].update(
        ema={"decay": 0.5}, export={"format": "diffusers", "weights": "ema", "dtype": "fp32"}
    )  # z2_ema: lora_ema.safetensors
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    subprocess.run(
        [sys.executable, "-c", _STAGES, str(tmp_path / "jobs.json"), str(tmp_path / "out.json")],
        cwd=ROOT,
        check=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    r = json.loads((tmp_path / "out.json").read_text())
    for name in configs:  # 26 adapted linears of flux-tiny's all-linear, A and B each, all exported
        assert len(r[name][1]) == 2 * 26 and r[name][1] == r["z0"][1], name
    for name in ("z2_offload", "z3_offload"):
        assert r[name][0] == pytest.approx(r["z0"][0], rel=LOSS_RTOL), name
    assert r["z0_bf16"][0] == pytest.approx(r["z0"][0], rel=5e-3)  # measured 1.3e-3 at step 3
    # export.weights: ema writes the adapters' EMA (the EMA shards hold the trainable parameters only)
    from fluxzero.model.lora_formats import read_lora
    from fluxzero.train.export.consolidate import consolidated_state_dict, ema_state_dict
    from fluxzero.train.export.lora import canonical_lora

    got, _ = read_lora(tmp_path / "z2_ema" / "lora_ema.safetensors")
    tag_dir = consolidated_state_dict(tmp_path / "z2_ema")[1]
    ema, live = canonical_lora(ema_state_dict(tag_dir)), canonical_lora(consolidated_state_dict(tag_dir)[0])
    assert set(got) == set(ema) and all(torch.equal(got[k], ema[k]) for k in ema)
    assert any(not torch.equal(ema[k], live[k]) for k in live)  # decay 0.5: the EMA lags the trained adapters
    assert not (tmp_path / "z2_ema" / "lora.safetensors").exists()
    from click.testing import CliRunner

    from fluxzero.cli import main as cli

    r = CliRunner().invoke(
        cli,
        [
            "export",
            str(tmp_path / "z2_ema"),
            str(tmp_path / "cli_ema.safetensors"),
            "--weights",
            "ema",
            "--format",
            "diffusers",
            "--dtype",
            "fp32",
        ],
    )
    assert r.exit_code == 0, r.output
    again, _ = read_lora(tmp_path / "cli_ema.safetensors")  # `fluxzero export --weights ema` writes the same EMA
    assert all(torch.equal(again[k], ema[k]) for k in ema)
