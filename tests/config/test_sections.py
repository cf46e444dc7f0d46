"""The run file's checkpoint:, sample:, validation: and export: sections: frozen, validated where they are read,
an older run file's flat key refused in one sentence naming its new place, and an older checkpoint's run.yaml
read with those keys moved into their sections."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from fluxzero.config.run import TrainConfig
from fluxzero.config.runfile import ConfigError, load_config, override_key, read_saved_run
from fluxzero.config.sections import (
    MOVED_TO_SECTIONS,
    CheckpointConfig,
    ExportConfig,
    SampleConfig,
    ValidationConfig,
    nest_moved_keys,
)

BASE = {"deepspeed": "ds.json", "data": "synthetic:n=8", "output_dir": "out"}
# what the run file before the sections saved beside a checkpoint (TrainConfig.to_dict of fluxzero at 4c02348)
OLD_SAVED = {
    **BASE,
    "model": "flux-tiny",
    "weights": None,
    "steps": 4,
    "epochs": 1,
    "stop_after": 2,
    "seed": 0,
    "checkpoint_every": 2,
    "keep_checkpoints": 3,
    "log_every": 1,
    "resume": False,
    "export_format": "comfyui",
    "export_dtype": "fp32",
    "export_merged": False,
    "attention": "auto",
    "num_workers": None,
    "prefetch_batches": 1,
    "flow": {
        "timestep_sampling": "logit_normal",
        "logit_mean": 0.0,
        "logit_std": 1.0,
        "shift": "resolution",
        "shift_value": 3.0,
        "guidance": 1.0,
    },
    "ema": {"decay": 0.9, "warmup": False, "every": 1, "device": "gpu", "dtype": "fp32"},
    "export_weights": "ema",
    "sample_every": 5,
    "sample_prompts": "p.safetensors",
    "sample_vae": "vae",
    "sample_size": "256x512",
    "sample_steps": 4,
    "sample_guidance": 2.0,
    "sample_seeds": [1, 2],
    "sample_weights": "live",
    "validation_data": "val",
    "validation_every": 7,
    "validation_timesteps": [0.5],
    "lora": None,
}


def test_every_old_flat_key_is_refused_in_one_sentence_naming_its_new_place(tmp_path):
    for old, new in MOVED_TO_SECTIONS.items():
        run = tmp_path / "run.yaml"
        run.write_text(yaml.safe_dump({**BASE, old: OLD_SAVED[old]}))
        for args in ((str(run), []), (None, [f"{k}={v}" for k, v in BASE.items()] + [f"{old}={OLD_SAVED[old]}"])):
            with pytest.raises(ConfigError) as e:
                load_config(*args)
            msg = str(e.value)
            assert msg.startswith(f"{old} is {new} now: write it in the run file's {new.split('.')[0]}: section"), msg
            assert f"or as {new}=VALUE on the command line" in msg and ". " not in msg
            assert f"`{new.split('.')[1]}:` indented under it" in msg


def test_several_old_keys_are_one_sentence():
    with pytest.raises(
        ValueError,
        match=r"^checkpoint_every and sample_vae are checkpoint\.every and sample\.vae "
        r"now: write them in the run file's checkpoint: and sample: sections",
    ):
        TrainConfig.from_dict({**BASE, "sample_vae": "v", "checkpoint_every": 2})


def test_a_flags_hint_names_the_key_where_it_lives_now():
    assert [override_key(f) for f in ("--steps", "--export-format", "--checkpoint-every=3", "--resume")] == [
        "steps",
        "export.format",
        "checkpoint.every",
        "checkpoint.resume",
    ]


def test_sections_from_yaml_and_overrides(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text(
        yaml.safe_dump(
            {
                **BASE,
                "checkpoint": {"every": 5, "keep": 2},
                "export": {"format": None},
                "sample": {"every": 3, "prompts": "~/p.safetensors", "vae": "v", "size": "64x32"},
                "validation": {"data": "~/val", "every": 4},
            }
        )
    )
    cfg = load_config(str(run), ["checkpoint.resume=false", "sample.seeds=[3, 4]", "export.dtype=fp32"])
    assert cfg.checkpoint == CheckpointConfig(every=5, keep=2, resume=False)
    assert cfg.export == ExportConfig(format=None, dtype="fp32")
    assert cfg.sample.wh == (64, 32) and cfg.sample.seeds == [3, 4] and not cfg.sample.prompts.startswith("~")
    assert cfg.validation.data.endswith("/val") and not cfg.validation.data.startswith("~")
    assert TrainConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg  # the saved run.yaml
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.checkpoint.every = 1  # type: ignore[misc]
    defaults = TrainConfig.from_dict({**BASE, "checkpoint": None, "sample": None, "validation": None})
    assert (defaults.checkpoint, defaults.sample, defaults.validation, defaults.export) == (
        CheckpointConfig(),
        SampleConfig(),
        ValidationConfig(),
        ExportConfig(),
    )


@pytest.mark.parametrize(
    "section, words",
    [
        ({"checkpoint": {"every": -1}}, "checkpoint.every must be 0 or more, got -1"),
        ({"checkpoint": {"keep": 1.5}}, "checkpoint.keep must be a whole number, got 1.5"),
        ({"checkpoint": {"resume": "maybe"}}, "checkpoint.resume must be true or false, got 'maybe'"),
        (
            {"checkpoint": {"evry": 2}},
            "unknown checkpoint keys ['evry'] (did you mean 'every' for 'evry'?); valid keys: every, keep, resume",
        ),
        ({"checkpoint": 5}, "checkpoint must be a mapping of checkpoint options (every, keep, resume), got 5"),
        (
            {"sample": {"every": 2}},
            "sample.every needs sample.prompts (a file from `fluxzero encode-prompts`) and "
            "sample.vae (a diffusers VAE folder); set both, or set sample.every to 0",
        ),
        ({"sample": {"size": "500x500"}}, "sample.size must be WIDTHxHEIGHT in pixels, multiples of 16"),
        ({"sample": {"steps": 0}}, "sample.steps must be at least 1, got 0"),
        ({"sample": {"guidance": float("nan")}}, "sample.guidance must be a finite number >= 0, got nan"),
        ({"sample": {"seeds": [0, True]}}, "sample.seeds must be a list of whole numbers such as [0, 1]"),
        ({"sample": {"weights": "ema"}}, "sample.weights is ema but the run keeps no EMA; add an ema: section"),
        ({"validation": {"every": 3}}, "validation.every needs validation.data (a held-out shard folder)"),
        ({"validation": {"timesteps": [0.0]}}, "validation.timesteps must be a list of numbers in (0, 1]"),
        ({"export": {"format": "png"}}, "export.format must be bfl, diffusers, comfyui or null, got 'png'"),
        ({"export": {"dtype": "fp8"}}, "export.dtype must be bf16 or fp32, got 'fp8'"),
        ({"export": {"weights": "best"}}, "export.weights must be live or ema, got 'best'"),
        (
            {"export": {"merged": True}},
            "export.merged merges a LoRA into its base weights, but this run has no lora section; remove export.merged",
        ),
        ({"export": None}, "export: null would still export with the defaults; write export.format: null"),
    ],
)
def test_a_bad_section_value_names_the_field_and_the_fix(section, words):
    with pytest.raises(ValueError) as e:
        TrainConfig.from_dict({**BASE, **section})
    assert str(e.value).startswith(words), str(e.value)


def test_an_older_checkpoints_run_yaml_is_read_with_its_keys_in_their_sections(tmp_path):
    saved = tmp_path / "run.yaml"
    saved.write_text(yaml.safe_dump(OLD_SAVED, sort_keys=False))
    got = read_saved_run(saved, "repair it", ValueError)
    assert not set(got) & set(MOVED_TO_SECTIONS)
    assert got["checkpoint"] == {"every": 2, "keep": 3, "resume": False}
    assert got["export"] == {"format": "comfyui", "dtype": "fp32", "merged": False, "weights": "ema"}
    assert got["validation"] == {"data": "val", "every": 7, "timesteps": [0.5]}
    cfg = TrainConfig.from_dict(got)  # the whole old run as this version's config, every value where it went
    assert (cfg.sample.every, cfg.sample.size, cfg.sample.seeds, cfg.sample.guidance) == (5, "256x512", [1, 2], 2.0)
    assert cfg.stop_after == 2 and cfg.ema.decay == 0.9 and cfg.export.weights == "ema"
    # a run.yaml of this version comes back as it was written
    saved.write_text(yaml.safe_dump(cfg.to_dict()))
    assert read_saved_run(saved, "repair it", ValueError) == cfg.to_dict()


def test_nesting_keeps_what_a_section_already_says_and_leaves_the_input_alone():
    d = {"sample_every": 1, "sample": {"every": 2}, "export_format": None}
    assert nest_moved_keys(d) == {"sample": {"every": 2}, "export": {"format": None}}
    assert d == {"sample_every": 1, "sample": {"every": 2}, "export_format": None}
