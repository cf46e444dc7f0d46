"""benchmarks/kontext_lora.py's pieces that need no GPU: a Kontext case's run file trains on pairs, the fit JSON
decides the case, the diffusers + PEFT baseline's LoRA sits on the layers fluxzero's attention+mlp targets."""

from __future__ import annotations

import json

from fluxzero.config import TrainConfig
from fluxzero.data import build_dataloader
from tests.benchmarks.test_benchmarks import _load

sweep = _load("sweep")


def test_a_kontext_case_trains_on_pairs_and_takes_the_fit_json(tmp_path):
    ds = {
        "train_micro_batch_size_per_gpu": 3,
        "zero_optimization": {"stage": 2},
        "fluxzero": {"activation_checkpointing": {"every_k_blocks": 2}, "compile": {"blocks": False}},
    }
    (tmp_path / "fit.json").write_text(json.dumps(ds))
    case = sweep.with_ds_json(
        sweep.Case(
            model="flux-tiny-kontext",
            res=64,
            txt=4,
            attn="auto",
            warmup=1,
            steps=1,
            lora={"rank": 4, "targets": "attention+mlp"},
        ),
        str(tmp_path / "fit.json"),
        "cpu",
    )
    assert (case.mb, case.zero, case.ckpt, case.compile) == (3, 2, 2, False)
    cfg = TrainConfig(**sweep.run_file(case, 1, tmp_path / "fit.json", tmp_path / "run"))
    assert cfg.model == "flux-tiny-kontext" and cfg.data.endswith(",ref=1")
    batch = next(iter(build_dataloader(cfg.data, micro_batch=3, rank=0, world_size=1, seed=0)))
    assert batch["reference"].shape == batch["latents"].shape == (3, 16, 8, 8)
    plain = sweep.Case(model="flux-tiny", res=64, txt=4)
    assert "ref=" not in sweep.data_source(plain, 1)


def test_the_baselines_lora_targets_are_fluxzeros_attention_mlp_layers():
    """PEFT on diffusers' names must adapt the same linears fluxzero's attention+mlp preset adapts (with diffusers
    splitting the fused qkv and single blocks' linear1 into their parts): every one of them, nothing else."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    from fluxzero.config import get_model_config
    from fluxzero.config.lora import LoraConfig as FzLora
    from fluxzero.model import build_model
    from fluxzero.model.layouts import diffusers_names
    from fluxzero.model.lora import apply_lora

    kontext, diffusers_config = _load("kontext_lora"), _load("baseline_diffusers").diffusers_config
    cfg = get_model_config("flux-tiny-kontext")
    theirs = FluxTransformer2DModel.from_config(diffusers_config(cfg))
    theirs.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=kontext.DIFFUSERS_TARGETS))
    adapted = {n.removesuffix(".lora_A.default") for n, _ in theirs.named_modules() if n.endswith(".lora_A.default")}
    ours = build_model(cfg, device="meta")
    apply_lora(ours, FzLora(rank=4, targets="attention+mlp"))
    want = set()
    for n, _ in ours.named_modules():
        if n.endswith(".lora_A"):
            want |= {d.removesuffix(".weight") for d in diffusers_names(n.removesuffix(".lora_A") + ".weight")[0]}
    assert adapted == want, sorted(adapted ^ want)


def test_the_fit_json_takes_a_pinned_zero_stage(tmp_path):
    kontext = _load("kontext_lora")
    base = ["--device", "cpu", "--model", "flux-tiny-kontext", "--res", "64", "--txt", "16", "--gpu-memory", "8"]
    stages = []
    for pin in ([], ["--zero-stage", "2"]):
        path = tmp_path / f"fit{len(pin)}.json"
        kontext.fit_config(kontext.parse_args(base + pin), path)
        stages.append(json.loads(path.read_text())["zero_optimization"]["stage"])
    assert stages == [0, 2]  # --fit's own choice for a LoRA on one GPU, then the pin
