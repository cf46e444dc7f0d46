"""fluxzero.config.deepspeed.view: the one parsed view of a DeepSpeed config, and the readers that go through it
(the run file's moved keys, the memory model, `estimate --ds-config`, `check-config`'s summary). Pure Python."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fluxzero import plan as memory
from fluxzero.cli import main
from fluxzero.config.deepspeed import build as ds_config
from fluxzero.config.deepspeed import file as ds_file
from fluxzero.config.deepspeed import view as ds_view
from fluxzero.config.deepspeed.view import DSConfigError, DSView, view
from fluxzero.config.run import TrainConfig

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------------------
# The view
# ---------------------------------------------------------------------------------------------------------
def test_absent_keys_read_as_deepspeed_defaults():
    """An empty config is what deepspeed 0.19.8 runs without those keys: ZeRO-0, fp32, no offload, no
    scheduler; and what the trainer runs without a fluxzero section: no checkpointing, no compile."""
    v = view({})
    assert v == DSView()
    assert (v.stage, v.precision, v.offload_optimizer, v.offload_param) == (0, "fp32", "none", "none")
    assert (v.micro_batch, v.grad_accum, v.global_batch, v.gradient_clipping) == (None, None, None, None)
    assert (v.checkpoint_every, v.compile, v.optimizer, v.scheduler) == (
        0,
        None,
        None,
        None,
    )  # compile: trainer decides
    assert v.dtype_name == "float32"
    # sections present but empty, and precision sections that are there but not enabled, read the same
    assert view({"zero_optimization": {}, "bf16": {"enabled": False}, "fp16": {}, "fluxzero": {}}) == DSView()


def test_view_reads_what_gen_config_writes():
    o = ds_config.options_from(
        "zero3-offload",
        model="flux-tiny",
        world_size=2,
        micro_batch=3,
        grad_accum=2,
        checkpoint_every=2,
        compile=True,
        scheduler="WarmupCosineLR",
        total_steps=50,
        warmup_steps=5,
        gradient_clipping=0.5,
    )
    v = view(ds_config.build(o))
    assert (v.stage, v.precision, v.offload_optimizer, v.offload_param) == (3, "bf16", "cpu", "cpu")
    assert (v.micro_batch, v.grad_accum, v.global_batch, v.gradient_clipping) == (3, 2, 12, 0.5)
    assert (v.checkpoint_every, v.compile, v.optimizer, v.optimizer_impl) == (2, True, "adamw", "torch-fused")
    # total_num_steps is written one short (DeepSpeed's iteration k - 2 at step k: the floor lands on step 50)
    assert (v.scheduler, v.scheduler_total_steps, v.lr) == ("WarmupCosineLR", 49, 1e-5)
    assert v.checkpointed_blocks(ds_config.num_blocks("flux-tiny")) == ds_view.checkpointed_blocks(
        ds_config.num_blocks("flux-tiny"), 2
    )
    assert v.batch_for(2) == (3, 2, 12)
    # the same facts options_view states without building (what the combination rules read)
    ov = ds_config.options_view(o)
    for f in (
        "stage",
        "precision",
        "offload_optimizer",
        "offload_param",
        "checkpoint_every",
        "compile",
        "optimizer",
        "optimizer_impl",
        "scheduler",
        "lr",
        "gradient_clipping",
    ):
        assert getattr(ov, f) == getattr(v, f), f


@pytest.mark.parametrize(
    "ds,where",
    [
        ({"zero_optimization": 2}, "zero_optimization must be a JSON object, got 2"),
        ({"bf16": True}, "bf16 must be a JSON object, got true"),
        (
            {"zero_optimization": {"offload_optimizer": "cpu"}},
            'zero_optimization.offload_optimizer must be a JSON object, got "cpu"',
        ),
        ({"optimizer": {"type": "AdamW", "params": [1]}}, "optimizer.params must be a JSON object, got [1]"),
        ({"fluxzero": {"activation_checkpointing": 1}}, "fluxzero.activation_checkpointing must be a JSON object"),
        ({"scheduler": "WarmupLR"}, 'scheduler must be a JSON object, got "WarmupLR"'),
    ],
)
def test_sections_of_the_wrong_type_are_one_sentence(ds, where):
    with pytest.raises(DSConfigError) as e:
        view(ds)
    assert str(e.value).startswith(where) and len(e.value.problems) == 1 and "\n" not in str(e.value)


def test_batch_for_derives_as_deepspeed_does():
    assert view({"train_batch_size": 32, "gradient_accumulation_steps": 2}).batch_for(4) == (4, 2, 32)
    assert view({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}).batch_for(4) == (2, 4, 32)
    assert view({"train_micro_batch_size_per_gpu": 2}).batch_for(3) == (2, 1, 6)
    with pytest.raises(
        DSConfigError, match=r"train_batch_size 30 .* world size 4 \(it fits 5 ranks\): fix the batch sizes"
    ):
        view({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}).batch_for(
            4
        )
    with pytest.raises(DSConfigError, match="train_micro_batch_size_per_gpu is not set"):
        view({}).batch_for(1)


# ---------------------------------------------------------------------------------------------------------
# The run file holds none of the DeepSpeed config's settings
# ---------------------------------------------------------------------------------------------------------
MOVED = [
    (
        "micro_batch",
        2,
        "micro_batch is set in the DeepSpeed config now (train_micro_batch_size_per_gpu in "
        "launch/tiny-zero2.json): remove it from the run file",
    ),
    (
        "grad_accum",
        4,
        "grad_accum is set in the DeepSpeed config now (gradient_accumulation_steps in "
        "launch/tiny-zero2.json): remove it from the run file",
    ),
    (
        "precision",
        "bf16",
        "precision is set in the DeepSpeed config now (bf16.enabled / fp16.enabled in "
        "launch/tiny-zero2.json): remove it from the run file",
    ),
    (
        "warmup_steps",
        10,
        "warmup_steps is the DeepSpeed scheduler's now (scheduler.params.warmup_num_steps in "
        "launch/tiny-zero2.json; `fluxzero gen-config --scheduler WarmupCosineLR "
        "--warmup-steps N --total-steps M` writes it): remove it from the run file",
    ),
    (
        "lr_decay",
        "cosine",
        "lr_decay is the DeepSpeed scheduler's now (scheduler.type in launch/tiny-zero2.json; "
        "`fluxzero gen-config --scheduler WarmupCosineLR --warmup-steps N --total-steps M` "
        "writes it): remove it from the run file",
    ),
    (
        "min_lr_ratio",
        0.1,
        "min_lr_ratio is the DeepSpeed scheduler's now (scheduler.params.cos_min_ratio in "
        "launch/tiny-zero2.json; `fluxzero gen-config --scheduler WarmupCosineLR "
        "--warmup-steps N --total-steps M` writes it): remove it from the run file",
    ),
]


@pytest.mark.parametrize("key,value,sentence", MOVED, ids=[m[0] for m in MOVED])
def test_an_old_run_file_with_a_moved_key_gets_one_sentence(key, value, sentence):
    run = {"deepspeed": "launch/tiny-zero2.json", "data": "d", "output_dir": "o", key: value}
    with pytest.raises(ValueError) as e:
        TrainConfig.from_dict(run)
    assert str(e.value) == sentence


def test_moved_keys_through_the_yaml_loader_and_overrides(tmp_path):
    """The trainer's own loader (YAML + key=value overrides) says the same sentence, with no traceback."""
    yaml = pytest.importorskip("yaml")
    from fluxzero.config.runfile import ConfigError, load_config

    run = tmp_path / "run.yaml"
    run.write_text(
        yaml.safe_dump({"deepspeed": "my.json", "data": "d", "output_dir": "o", "micro_batch": 2, "warmup_steps": 5})
    )
    with pytest.raises(ConfigError) as e:
        load_config(str(run))
    assert str(e.value).startswith(
        "micro_batch is set in the DeepSpeed config now (train_micro_batch_size_per_gpu "
        "in my.json) and warmup_steps is the DeepSpeed scheduler's now"
    )
    assert str(e.value).endswith(": remove them from the run file")
    run.write_text(yaml.safe_dump({"deepspeed": "my.json", "data": "d", "output_dir": "o"}))
    assert load_config(str(run)).steps == 0
    with pytest.raises(ConfigError, match=r"^precision is set in the DeepSpeed config now .* in other.json\)"):
        load_config(str(run), ["deepspeed=other.json", "precision=bf16"])


def test_run_file_without_deepspeed_still_names_where():
    with pytest.raises(ValueError, match=r"in the file deepspeed: names\): remove it from the run file$"):
        TrainConfig.from_dict({"data": "d", "output_dir": "o", "micro_batch": 2})


def test_run_file_keeps_no_deepspeed_setting():
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not fields & {"micro_batch", "grad_accum", "precision", "warmup_steps", "lr_decay", "min_lr_ratio"}
    for gone in ("global_batch", "lr_factor", "check_deepspeed"):
        assert not hasattr(TrainConfig, gone)
    cfg = TrainConfig(deepspeed="a.json", data="d", output_dir="o", epochs=3)
    assert cfg.total_steps(10, 4) == 7  # 3 epochs x 10 micro batches / 4 per optimizer step, rounded down
    assert cfg.total_steps(1, 4) == 1  # never 0
    assert dataclasses.replace(cfg, steps=5).total_steps(10, 4) == 5


def test_launch_tiny_yaml_loads_and_its_json_holds_the_batch():
    yaml = pytest.importorskip("yaml")
    run = yaml.safe_load((ROOT / "launch" / "tiny.yaml").read_text())
    cfg = TrainConfig.from_dict(run)
    v = view(ds_file.read_json(ROOT / cfg.deepspeed))
    assert (v.micro_batch, v.grad_accum, v.precision) == (2, 1, "fp32")


# ---------------------------------------------------------------------------------------------------------
# Readers go through the view
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path", sorted((ROOT / "ds_configs").glob("*.json")) + [ROOT / "launch/tiny-zero2.json"], ids=lambda p: p.name
)
def test_memory_reads_committed_configs_as_the_view_does(path):
    ds = json.loads(path.read_text())
    v, got = view(ds), memory.run_options_from_ds_config(ds, 2)
    assert (got["stage"], got["precision"], got["offload_optimizer"], got["offload_param"]) == (
        v.stage,
        v.precision,
        v.offload_optimizer,
        v.offload_param,
    )
    assert (got["micro_batch"], got["checkpoint_every"], got["optimizer_impl"]) == (
        v.micro_batch,
        v.checkpoint_every,
        v.optimizer_impl,
    )
    z = ds["zero_optimization"]
    assert got["zero"].reduce_bucket_size == z.get("reduce_bucket_size", memory.ZeroSettings().reduce_bucket_size)


def test_memory_takes_the_micro_batch_from_train_batch_size():
    ds = {"train_batch_size": 48, "gradient_accumulation_steps": 3}
    assert memory.run_options_from_ds_config(ds, 4)["micro_batch"] == 4
    assert "micro_batch" not in memory.run_options_from_ds_config(ds, 5)  # does not divide: not decided
    assert "micro_batch" not in memory.run_options_from_ds_config({"train_micro_batch_size_per_gpu": "auto"}, 1)


def test_estimate_config_with_a_section_of_the_wrong_type_is_one_sentence(tmp_path):
    cfg = tmp_path / "bad.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": 2}))
    r = CliRunner().invoke(main, ["estimate", "--ds-config", str(cfg)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "zero_optimization must be a JSON object, got 2" in r.output
    cfg.write_text("[1, 2]")
    r = CliRunner().invoke(main, ["estimate", "--ds-config", str(cfg)])
    assert r.exit_code == 2 and "must be a JSON object" in r.output and "gen-config" in r.output


def test_estimate_config_follows_the_view(tmp_path):
    """estimate --ds-config models the stage, precision, micro batch and checkpointing the view reads."""
    cfg = tmp_path / "ds.json"
    ds = ds_config.build(
        ds_config.options_from("zero3", model="flux-tiny", micro_batch=3, checkpoint_every=2, precision="fp32")
    )
    cfg.write_text(json.dumps(ds))
    r = CliRunner().invoke(main, ["estimate", "--model", "flux-tiny", "--ds-config", str(cfg), "--json"])
    assert r.exit_code == 0, r.output
    d, v = json.loads(r.stdout), view(ds)
    assert (
        (d["stage"], d["precision"], d["micro_batch"], d["checkpoint_every"])
        == (v.stage, v.precision, v.micro_batch, v.checkpoint_every)
        == (3, "fp32", 3, 2)
    )


def test_check_config_summary_is_read_through_the_view(tmp_path):
    cfg = tmp_path / "ds.json"
    ds = ds_config.build(
        ds_config.options_from(
            "zero2-offload",
            model="flux-tiny",
            micro_batch=2,
            grad_accum=3,
            world_size=2,
            checkpoint_every=0,
            scheduler="none",
            gradient_clipping=0.0,
        )
    )
    cfg.write_text(json.dumps(ds))
    r = CliRunner().invoke(main, ["check-config", "--no-deepspeed", "--world-size", "2", str(cfg)])
    assert r.exit_code == 0, r.output
    assert r.output.strip().endswith(
        "OK (fluxzero's checks; world size 2): ZeRO-2 with optimizer offload to cpu, bf16, micro batch 2 x "
        "accumulation 3 (global batch 12), adamw lr 1e-05, constant lr, no gradient clipping, "
        "no activation checkpointing, blocks compiled on a GPU"
    )


def test_the_view_is_hashable_with_object_values_in_zero_optimization():
    """DSView is frozen: a zero_optimization key holding an object (leaf_module) must not make it unhashable."""
    v = view({"zero_optimization": {"stage": 3, "leaf_module": {"classes": ["DoubleStreamBlock"]}}})
    assert hash(v) == hash(view({"zero_optimization": {"stage": 3, "leaf_module": {"classes": ["X"]}}}))
    assert dict(v.zero_settings) == {"leaf_module": {"classes": ["DoubleStreamBlock"]}}


@pytest.mark.parametrize(
    "section, counts, dynamic",
    [
        ({}, 1, None),
        ({}, 3, True),  # unset: dynamic where the data has several image token counts
        ({"dynamic": False}, 3, False),
        ({"dynamic": True}, 1, True),
    ],
)
def test_dynamic_tokens_follow_the_buckets_unless_the_config_says(section, counts, dynamic):
    v = view({"train_micro_batch_size_per_gpu": 1, "fluxzero": {"compile": {"blocks": True, **section}}})
    assert v.dynamic_tokens(counts) is dynamic
