"""Model specs: a preset name, a mapping of field overrides, 'PRESET:field=value,...' or a diffusers config.json,
accepted by the run file, the trainer, `convert`, `estimate` and `gen-config`; custom shapes written to disk load
back with that shape (the RoPE axes included, which no tensor shape shows)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from fluxzero.config import MODEL_PRESETS, ModelConfig, TrainConfig, resolve_model
from fluxzero.config.models import model_spec, same_model

ROOT = Path(__file__).resolve().parents[2]
LITE = MODEL_PRESETS["flux-dev-lite"]
# The shape of the user's report: no preset has it, and its head dim 16 gives no RoPE axes by inference.
USER_DIFFUSERS = dict(
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    in_channels=16,
    axes_dims_rope=(4, 6, 6),
    num_layers=2,
    num_single_layers=1,
)


def _config_json(folder: Path, **fields) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel", **fields}))
    return folder


# ---------------------------------------------------------------------------------------------------------
# Pure: resolve_model, to_dict / from_dict, the run file
# ---------------------------------------------------------------------------------------------------------
def test_dev_lite_written_as_flux_dev_overrides_is_the_preset(tmp_path):
    for spec in (
        {"preset": "flux-dev", "depth": 5, "depth_single_blocks": 10},
        "flux-dev:depth=5,depth_single_blocks=10",
        _config_json(tmp_path / "lite", num_layers=5, num_single_layers=10, guidance_embeds=True),
    ):
        cfg = resolve_model(spec)
        assert cfg == LITE, spec  # every field, the name included
    assert resolve_model("flux-dev-lite") is LITE
    assert resolve_model({"preset": "flux-dev", "depth": 5, "depth_single_blocks": 10, "name": "mine"}).same_shape(LITE)
    # a mapping that changes nothing is its preset; one that keeps flux-dev's width keeps its RoPE axes
    assert resolve_model({"preset": "flux-tiny"}) == MODEL_PRESETS["flux-tiny"]
    assert resolve_model({"preset": "flux-dev", "depth": 1}).axes_dim == (16, 56, 56)


def test_mapping_fields_and_derivations():
    cfg = resolve_model(
        {
            "preset": "flux-tiny",
            "head_dim": 16,
            "num_heads": 2,
            "axes_dim": [4, 6, 6],
            "context_in_dim": 32,
            "vec_in_dim": 32,
            "in_channels": 16,
            "guidance_embed": False,
            "mlp_ratio": 3,
        }
    )
    assert (cfg.hidden_size, cfg.head_dim, cfg.axes_dim) == (32, 16, (4, 6, 6))
    assert (cfg.in_channels, cfg.out_channels, cfg.mlp_ratio, cfg.guidance_embed) == (16, 16, 3.0, False)
    assert cfg.name.startswith("flux-tiny (") and "head_dim=16" in cfg.name
    # a width change without axes keeps FLUX's proportions (as estimate --hidden-size does)
    assert resolve_model({"preset": "flux-dev", "hidden_size": 1536, "num_heads": 24}).axes_dim == (8, 28, 28)
    # the inline form continues a list with bare numbers
    inline = resolve_model(
        "flux-tiny:head_dim=16,num_heads=2,axes_dim=4,6,6,context_in_dim=32,vec_in_dim=32,"
        "in_channels=16,guidance_embed=false,mlp_ratio=3"
    )
    assert inline.same_shape(cfg)
    # no preset: flux-dev's values (ModelConfig's defaults) with the fields given
    assert resolve_model({"depth": 5, "depth_single_blocks": 10}).same_shape(LITE)


def test_model_config_round_trips_through_yaml_and_json():
    cfg = resolve_model("flux-tiny:head_dim=16,num_heads=2,axes_dim=4,6,6,theta=500,qkv_bias=false")
    for text in (yaml.safe_dump(cfg.to_dict()), json.dumps(cfg.to_dict())):
        back = ModelConfig.from_dict(yaml.safe_load(text))
        assert back == cfg and isinstance(back.axes_dim, tuple)
    for preset in MODEL_PRESETS.values():
        assert ModelConfig.from_dict(json.loads(json.dumps(preset.to_dict()))) == preset


def test_run_file_takes_every_spec_form_and_records_the_shape(tmp_path):
    from fluxzero.config.runfile import config_text, load_config

    base = {"deepspeed": "ds.json", "data": "d", "output_dir": "o"}
    lite = TrainConfig.from_dict({**base, "model": {"preset": "flux-dev", "depth": 5, "depth_single_blocks": 10}})
    assert lite.model == "flux-dev-lite"  # a preset's shape is recorded by its name
    folder = _config_json(tmp_path / "user", **USER_DIFFUSERS)
    for spec in (str(folder), str(folder / "config.json"), resolve_model(str(folder)).to_dict()):
        cfg = TrainConfig.from_dict({**base, "model": spec})
        assert isinstance(cfg.model, dict) and cfg.model["axes_dim"] == [4, 6, 6]  # the whole shape, not the path
        run = tmp_path / "run.yaml"
        run.write_text(config_text(cfg))  # what a checkpoint saves, read back as a run file
        again = load_config(str(run))
        assert again == cfg and resolve_model(again.model) == resolve_model(str(folder))
    # a mapping in the YAML, with a dotted override on top
    run.write_text("deepspeed: ds.json\ndata: d\noutput_dir: o\nmodel:\n  preset: flux-dev\n  depth: 5\n")
    assert load_config(str(run), ["model.depth_single_blocks=10"]).model == "flux-dev-lite"
    assert same_model("flux-dev-lite", {"preset": "flux-dev", "depth": 5, "depth_single_blocks": 10, "name": "x"})
    assert not same_model("flux-dev-lite", "flux-dev") and not same_model({"depth": "x"}, "flux-dev")
    assert model_spec(LITE) == "flux-dev-lite"
    assert model_spec(LITE.replace(name="x")) == {**LITE.to_dict(), "name": "x"}  # a name given is kept


BAD = [  # spec, what the sentence must name
    ("flux-huge", "unknown model preset 'flux-huge'"),
    ({"preset": "flux-dev", "dpth": 3}, "unknown field 'dpth' (did you mean 'depth'?)"),
    ({"preset": "flux-huge"}, "unknown preset 'flux-huge'"),
    ({"depth": "x"}, "depth must be a whole number, got 'x'"),
    ({"guidance_embed": 1}, "guidance_embed must be true or false"),
    ({"mlp_ratio": -1}, "mlp_ratio must be a positive number"),
    ({"hidden_size": 100, "num_heads": 3}, "hidden_size 100 must be a positive multiple of num_heads 3"),
    ({"preset": "flux-tiny", "axes_dim": [4, 6]}, "axes_dim must be three positive even whole numbers"),
    ({"preset": "flux-tiny", "axes_dim": [4, 6, 8]}, "axes_dim (4, 6, 8) must sum to the head dim 16"),
    ({"preset": "flux-tiny", "axes_dim": [5, 5, 6]}, "every entry of axes_dim (5, 5, 6) must be positive and even"),
    ({"preset": "flux-tiny", "head_dim": 2}, "head dim 2 is too small for 3-axis RoPE; set axes_dim"),
    ({"hidden_size": 64, "head_dim": 16, "num_heads": 2}, "hidden_size 64 is not head_dim 16 x num_heads 2"),
    ({"depth": -1}, "depth must be from 0 to 1024, got -1"),
    ({"in_channels": 0}, "in_channels must be from 1 to 65536, got 0"),
    ("flux-dev:depth", "'depth' must look like field=value"),
    ("flux-dev:depth=five", "depth must be a whole number, got 'five'"),
    ("nowhere/config.json", "model nowhere/config.json: no such file or folder"),
    (3, "model must be a preset name, a mapping"),
]


@pytest.mark.parametrize("spec, match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_specs_give_one_sentence(spec, match):
    from fluxzero.config.runfile import ConfigError, load_config

    with pytest.raises(ValueError) as e:
        resolve_model(spec)
    msg = str(e.value)
    assert match in msg and "\n" not in msg, msg
    with pytest.raises(ConfigError, match="^" + re.escape(msg) + "$"):  # the run file says the same sentence
        load_config(None, ["deepspeed=a", "data=b", "output_dir=c", f"model={json.dumps(spec)}"])


def test_bad_diffusers_configs(tmp_path):
    cases = [
        ("not json", "not a readable JSON file"),
        ('{"_class_name": "AutoencoderKL"}', "describes a AutoencoderKL, not a FluxTransformer2DModel"),
        ('{"patch_size": 2}', "patch_size 2 is not FLUX.1's 1"),
        ('{"num_layers": "19"}', "num_layers must be a whole number, got '19'"),
        ('{"attention_head_dim": 16}', "axes_dim (16, 56, 56) must sum to the head dim 16"),
        ("[1]", "holds a JSON object"),
    ]
    for i, (text, match) in enumerate(cases):
        (tmp_path / f"{i}.json").write_text(text)
        with pytest.raises(ValueError) as e:
            resolve_model(str(tmp_path / f"{i}.json"))
        assert match in str(e.value) and "\n" not in str(e.value), str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="the folder holds no config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_diffusers_config_json_reads_diffusers_names_and_defaults(tmp_path):
    pipeline = tmp_path / "FLUX.1-user"
    _config_json(pipeline / "transformer", **USER_DIFFUSERS)
    (pipeline / "model_index.json").write_text("{}")
    cfg = resolve_model(str(pipeline))  # a pipeline folder: its transformer/config.json
    assert cfg.name == "FLUX.1-user"
    assert (cfg.head_dim, cfg.num_heads, cfg.hidden_size, cfg.context_in_dim, cfg.vec_in_dim) == (16, 2, 32, 32, 32)
    assert (cfg.in_channels, cfg.out_channels, cfg.axes_dim, cfg.depth, cfg.depth_single_blocks) == (
        16,
        16,
        (4, 6, 6),
        2,
        1,
    )
    assert cfg.guidance_embed is False  # diffusers' default when config.json leaves it out
    assert resolve_model(str(pipeline / "transformer" / "config.json")).same_shape(cfg)
    # every key left out takes FluxTransformer2DModel's default
    assert resolve_model(str(_config_json(tmp_path / "bare"))).same_shape(MODEL_PRESETS["flux-schnell"])


def test_config_package_stays_pure():
    # resolve_model reads config.json with the standard library: gen-config / estimate stay instant
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['deepspeed'] = None\n"
        "from fluxzero.config import resolve_model\n"
        "print(resolve_model('flux-dev:depth=5,depth_single_blocks=10').name)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "flux-dev-lite"


# ---------------------------------------------------------------------------------------------------------
# Commands: estimate and gen-config take the same specs; --depth/... still work on top
# ---------------------------------------------------------------------------------------------------------
def test_estimate_and_gen_config_take_model_specs(tmp_path):
    from fluxzero.cli import main

    r = CliRunner()
    folder = _config_json(tmp_path / "user", **USER_DIFFUSERS)
    out = r.invoke(main, ["estimate", "--model", "flux-dev:depth=5,depth_single_blocks=10"])
    assert out.exit_code == 0 and out.output.startswith("flux-dev-lite ("), out.output
    lite = r.invoke(main, ["estimate", "--model", "flux-dev-lite"]).output
    assert out.output == lite
    out = r.invoke(main, ["estimate", "--model", str(folder)])
    assert out.exit_code == 0 and out.output.startswith("user ("), out.output
    out = r.invoke(main, ["estimate", "--model", "flux-dev:depth=5", "--single-depth", "10"])
    assert out.exit_code == 0 and "(3.18B parameters)" in out.output.splitlines()[0], out.output
    out = r.invoke(main, ["estimate", "--model", "flux-dev:dpth=5"])
    assert out.exit_code == 2 and "Traceback" not in out.output
    assert "Invalid value for '--model': model 'flux-dev:dpth=5': unknown field 'dpth'" in out.output
    # gen-config: the checks use the spec's block count (5 + 10)
    for spec in ("flux-dev:depth=5,depth_single_blocks=10", "flux-dev-lite"):
        out = r.invoke(main, ["gen-config", "--model", spec, "--checkpoint-every", "15"])
        assert out.exit_code == 0, out.output
        assert json.loads(out.output)["fluxzero"]["activation_checkpointing"]["every_k_blocks"] == 15
        out = r.invoke(main, ["gen-config", "--model", spec, "--checkpoint-every", "16"])
        assert out.exit_code != 0 and "exceeds the 15 blocks" in out.output, out.output
    out = r.invoke(
        main,
        [
            "gen-config",
            "--fit",
            "--model",
            "flux-dev:depth=5,depth_single_blocks=10",
            "--gpu-memory",
            "80",
            "--world-size",
            "1",
        ],
    )
    assert out.exit_code == 0 and "chose ZeRO-" in out.output, out.output
    out = r.invoke(main, ["gen-config", "--model", "flux-huge"])
    assert out.exit_code == 2 and "unknown model preset 'flux-huge'" in out.output


# ---------------------------------------------------------------------------------------------------------
# Weights: the user's diffusers shape round-trips diffusers -> BFL -> diffusers with equal outputs
# ---------------------------------------------------------------------------------------------------------
def _inputs(cfg, batch=2, h=3, w=4, txt_len=5, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    img_ids = torch.stack((torch.zeros_like(rows), rows, cols), -1).reshape(1, h * w, 3).float().repeat(batch, 1, 1)
    return dict(
        img=torch.randn(batch, h * w, cfg.in_channels, generator=g),
        img_ids=img_ids,
        txt=torch.randn(batch, txt_len, cfg.context_in_dim, generator=g),
        txt_ids=torch.zeros(batch, txt_len, 3),
        timesteps=torch.rand(batch, generator=g),
        y=torch.randn(batch, cfg.vec_in_dim, generator=g),
        guidance=torch.full((batch,), 3.5) if cfg.guidance_embed else None,
    )


def _run_diffusers(model, x):
    return model(
        hidden_states=x["img"],
        encoder_hidden_states=x["txt"],
        pooled_projections=x["y"],
        timestep=x["timesteps"],
        img_ids=x["img_ids"][0],
        txt_ids=x["txt_ids"][0],
        guidance=x["guidance"],
        return_dict=False,
    )[0]


@pytest.mark.parametrize("guidance", [False, True])
def test_user_diffusers_shape_round_trips_through_bfl(tmp_path, guidance):
    import torch
    from safetensors import safe_open

    diffusers = pytest.importorskip("diffusers")
    from fluxzero.cli import main
    from fluxzero.model import layouts
    from fluxzero.model import weights as W

    torch.manual_seed(0)
    theirs = diffusers.FluxTransformer2DModel(**USER_DIFFUSERS, guidance_embeds=guidance).eval()
    with torch.no_grad():  # default init leaves norm scales at 1 and zero biases: perturb everything
        for p in theirs.parameters():
            p.add_(0.05 * torch.randn_like(p))
    theirs.save_pretrained(tmp_path / "src")
    r = CliRunner()
    out = r.invoke(main, ["convert", str(tmp_path / "src"), str(tmp_path / "a.safetensors"), "--to", "bfl"])
    assert out.exit_code == 0, out.output
    with safe_open(str(tmp_path / "a.safetensors"), "pt") as f:
        recorded = ModelConfig.from_dict(json.loads(f.metadata()[layouts.MODEL_METADATA]))
    assert recorded.axes_dim == (4, 6, 6) and recorded.same_shape(resolve_model(str(tmp_path / "src")))
    out = r.invoke(main, ["convert", str(tmp_path / "a.safetensors"), str(tmp_path / "back"), "--to", "diffusers"])
    assert out.exit_code == 0, out.output
    assert json.loads((tmp_path / "back" / "config.json").read_text())["axes_dims_rope"] == [4, 6, 6]
    again = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "back").eval()
    cfg = W.source_config(tmp_path / "a.safetensors")
    assert cfg == recorded and cfg.guidance_embed is guidance
    x = _inputs(cfg)
    with torch.no_grad():
        a, b = _run_diffusers(theirs, x), _run_diffusers(again, x)
        ours = W.load_model(tmp_path / "a.safetensors", dtype=torch.float32)(**x)
    # the same fp32 tensors through the same code: exactly equal, not just close
    assert torch.equal(a, b)
    for k, v in theirs.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k
    # our model from the BFL file (axes from its metadata) agrees with diffusers to fp32 rounding (as the
    # parity tests: different op order, ~1e-7 relative per op over a few blocks)
    assert ((ours - a).norm() / a.norm()).item() <= 1e-5


def test_plain_bfl_file_of_custom_shape_needs_the_model_named(tmp_path):
    import torch
    from safetensors.torch import save_file

    from fluxzero.cli import main
    from fluxzero.model.flux import build_model

    cfg = resolve_model(str(_config_json(tmp_path / "user", **USER_DIFFUSERS)))
    torch.manual_seed(0)
    save_file(
        {k: v.contiguous() for k, v in build_model(cfg).state_dict().items()}, str(tmp_path / "plain.safetensors")
    )
    r = CliRunner()
    argv = ["convert", str(tmp_path / "plain.safetensors"), str(tmp_path / "out"), "--to", "diffusers"]
    out = r.invoke(main, argv)  # another tool's file: no metadata, and head dim 16 gives no axes
    assert out.exit_code == 2 and "Traceback" not in out.output
    assert "cannot infer RoPE axes for head dim 16; name the model the weights belong to (--model" in out.output
    for spec in (
        str(tmp_path / "user"),
        "flux-tiny:head_dim=16,num_heads=2,axes_dim=4,6,6,context_in_dim=32,"
        "vec_in_dim=32,in_channels=16,depth=2,depth_single_blocks=1,guidance_embed=false",
    ):
        out = r.invoke(main, [*argv, "--model", spec, "--overwrite"])
        assert out.exit_code == 0, out.output
        assert json.loads((tmp_path / "out" / "config.json").read_text())["axes_dims_rope"] == [4, 6, 6]
    out = r.invoke(main, [*argv, "--model", "flux-tiny", "--overwrite"])  # the wrong shape: every mismatch named
    assert out.exit_code == 2 and "do not match the model" in out.output


# ---------------------------------------------------------------------------------------------------------
# Training: a run file with a mapping model trains through launch/train.py; resume compares resolved shapes
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # three trainer processes, ~30 s
def test_mapping_model_trains_resumes_and_exports(tmp_path):
    from safetensors import safe_open

    from fluxzero.model import layouts
    from fluxzero.model import weights as W

    model = {
        "preset": "flux-tiny",
        "context_in_dim": 32,
        "vec_in_dim": 16,
        "in_channels": 16,
        "depth": 1,
        "depth_single_blocks": 1,
    }
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "run"
    run = {
        "deepspeed": str(tmp_path / "ds.json"),
        "output_dir": str(out),
        "steps": 2,
        "export": {"format": "bfl", "dtype": "fp32"},
        "data": "synthetic:n=8,hw=8x8,txt=4,ctx=32,vec=16,ch=4",
        "model": model,
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLUXZERO_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}

    def train(*overrides):
        return subprocess.run(
            [sys.executable, "launch/train.py", "--config", str(tmp_path / "run.yaml"), *overrides],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )

    p = train()
    assert p.returncode == 0, p.stderr[-3000:]
    saved = yaml.safe_load((out / "checkpoints" / "step_00000002" / "run.yaml").read_text())
    assert set(saved["model"]) == set(LITE.to_dict())  # the whole shape, not the spec as written
    assert ModelConfig.from_dict(saved["model"]).same_shape(resolve_model(model))
    with safe_open(str(out / "export.safetensors"), "pt") as f:
        assert resolve_model(json.loads(f.metadata()[layouts.MODEL_METADATA])).same_shape(resolve_model(model))
    assert W.source_config(out / "export.safetensors") == ModelConfig.from_dict(saved["model"])  # name too
    # the same shape written inline resumes; another shape is refused in one sentence before any model is built
    p = train("steps=3", "model=flux-tiny:context_in_dim=32,vec_in_dim=16,in_channels=16,depth=1,depth_single_blocks=1")
    assert p.returncode == 0, p.stderr[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    p = train("steps=4", "model=flux-tiny:context_in_dim=32,vec_in_dim=16,in_channels=16,depth=2,depth_single_blocks=1")
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert len(errors) == 1 and "is a checkpoint of flux-tiny (" in errors[0], p.stderr[-3000:]
    assert "but the run file trains flux-tiny (context_in_dim=32, vec_in_dim=16, in_channels=16, depth=2," in errors[0]
