"""LoRA files on disk: a damaged or foreign-made file is refused in one sentence naming it wherever a LoRA is read
(read_lora, the run file's lora.weights, `fluxzero sample --lora`), before anything changes; the same LoRA is
always the same bytes, with the usual permissions (a user's chmod kept); a killed export's temp file is removed by
the next one; `fluxzero convert` moves a LoRA between layouts.
"""

import hashlib
import json
import math
import subprocess
import sys

import click
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from fluxzero.config.lora import LoraConfig
from fluxzero.model import build_model, lora_keys
from fluxzero.model import lora as L
from fluxzero.model import lora_formats as F
from tests.helpers import umask_027 as _umask_027

umask_027 = pytest.fixture(_umask_027)

LCFG = LoraConfig(rank=4, alpha=2, targets="attention")


def _lora_sd(lcfg=LCFG, seed=0):
    """A canonical LoRA of flux-tiny with random A and B (the adapters of a trained run)."""
    model = build_model("flux-tiny", device="meta")
    g = torch.Generator().manual_seed(seed)
    mods = dict(model.named_modules())
    sd = {}
    for name in L.target_modules(model, lcfg.targets):
        sd[f"{name}.lora_A.weight"] = torch.randn(lcfg.rank, mods[name].in_features, generator=g)
        sd[f"{name}.lora_B.weight"] = torch.randn(mods[name].out_features, lcfg.rank, generator=g)
    return sd


def _contents(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _damaged(tmp_path, name, layout, tensors=None, meta=None):
    """A LoRA file written by fluxzero in `layout`, then changed: `tensors(dict)` edits the tensors in place,
    `meta` replaces header entries."""
    good = tmp_path / f"good_{layout}.safetensors"
    F.save_lora(good, _lora_sd(), LCFG, layout=layout, base_model="flux-tiny")
    t, m = _contents(good)
    if tensors:
        tensors(t)
    save_file(t, str(tmp_path / name), metadata={**m, **(meta or {})})
    return tmp_path / name


def _first(t, suffix):
    return next(k for k in sorted(t) if k.endswith(suffix))


def _set(suffix, value):
    def edit(t):
        k = _first(t, suffix)
        t[k] = t[k].clone()
        t[k].view(-1)[0] = value

    return edit


def _replace(suffix, make):
    def edit(t):
        k = _first(t, suffix)
        t[k] = make(t[k])

    return edit


BAD = [  # (name, layout, tensor edit, header entries, words of the one sentence)
    (
        "rank_text",
        "kohya",
        None,
        {"fluxzero.rank": "four"},
        "header entry fluxzero.rank is 'four', not a whole number of at least 1",
    ),
    ("rank_zero", "diffusers", None, {"fluxzero.rank": "0"}, "header entry fluxzero.rank is '0'"),
    ("alpha_text", "diffusers", None, {"fluxzero.alpha": "strong"}, "header entry fluxzero.alpha is 'strong'"),
    ("targets_not_json", "kohya", None, {"fluxzero.targets": "{attention"}, "header entry fluxzero.targets is"),
    (
        "adapter_metadata_not_json",
        "diffusers",
        None,
        {F.DIFFUSERS_METADATA_KEY: "{r: 4,"},
        "header entry lora_adapter_metadata is not a JSON mapping of PEFT settings",
    ),
    (
        "adapter_r_text",
        "diffusers",
        None,
        {F.DIFFUSERS_METADATA_KEY: json.dumps({"transformer.r": "x"})},
        "header entry lora_adapter_metadata r is 'x'",
    ),
    (
        "alpha_two_values",
        "kohya",
        _replace(".alpha", lambda a: torch.stack([a, a])),
        None,
        ".alpha holds 2 values, but an alpha is one number",
    ),
    (
        "alpha_nan",
        "kohya",
        _replace(".alpha", lambda a: torch.tensor(math.nan)),
        None,
        ".alpha is nan, but an alpha is a finite number above 0",
    ),
    ("up_nan", "kohya", _set(".lora_up.weight", math.nan), None, ".lora_up.weight holds NaN or infinite values"),
    ("down_inf", "kohya", _set(".lora_down.weight", math.inf), None, ".lora_down.weight holds NaN or infinite values"),
    ("B_nan", "diffusers", _set(".lora_B.weight", math.nan), None, ".lora_B.weight holds NaN or infinite values"),
    (
        "up_int32",
        "kohya",
        _replace(".lora_up.weight", lambda t: (t * 10).to(torch.int32)),
        None,
        ".lora_up.weight holds int32 values, but LoRA tensors are floating point",
    ),
    (
        "A_int8",
        "diffusers",
        _replace(".lora_A.weight", lambda t: t.to(torch.int8)),
        None,
        ".lora_A.weight holds int8 values, but LoRA tensors are floating point",
    ),
]


def _one_sentence(msg, path, words):
    assert str(path) in msg and words in msg and "\n" not in msg and msg.endswith(("again", "again.")), msg


@pytest.mark.parametrize("name, layout, edit, meta, words", BAD, ids=[c[0] for c in BAD])
def test_a_bad_lora_file_is_one_sentence_everywhere_it_is_read(tmp_path, name, layout, edit, meta, words):
    from fluxzero.commands.sample import _apply_adapters

    path = _damaged(tmp_path, f"{name}.safetensors", layout, edit, meta)
    with pytest.raises(lora_keys.LoraError) as e:
        F.read_lora(path)
    _one_sentence(str(e.value), path, words)
    # the run file's lora.weights (what every rank runs at the start of training)
    model = build_model("flux-tiny")
    with pytest.raises(lora_keys.LoraError) as e:
        L.apply_lora(model, LoraConfig(rank=4, alpha=2, targets="attention", weights=str(path)))
    _one_sentence(str(e.value), path, words)
    # `fluxzero sample --lora`: refused before any weight changes
    model = build_model("flux-tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(click.BadParameter) as e:
        _apply_adapters(model, path)
    _one_sentence(e.value.message, path, words)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_integer_alpha_and_a_one_element_alpha_are_read(tmp_path):
    # what other trainers write and is unambiguous: an int alpha, an alpha of shape (1,)
    sd = _lora_sd()
    path = _damaged(
        tmp_path, "int_alpha.safetensors", "kohya", _replace(".alpha", lambda a: a.to(torch.int64).reshape(1))
    )
    got, info = F.read_lora(path)
    assert info.alpha == 2.0 and all(torch.equal(got[k], sd[k]) for k in sd)


@pytest.mark.parametrize("layout", F.LAYOUTS)
def test_the_same_lora_is_the_same_bytes(tmp_path, layout):
    # safetensors' own writer put the header entries in a random order: three exports, three sha256s
    sd = _lora_sd()
    digests = set()
    for i in range(3):
        F.save_lora(
            tmp_path / f"{i}.safetensors", sd, LCFG, layout=layout, base_model="flux-tiny", dtype=torch.bfloat16
        )
        digests.add(hashlib.sha256((tmp_path / f"{i}.safetensors").read_bytes()).hexdigest())
    assert len(digests) == 1


def test_lora_files_follow_the_umask_and_keep_a_users_chmod(tmp_path, umask_027):
    path = tmp_path / "lora.safetensors"
    F.save_lora(path, _lora_sd(), LCFG)
    assert oct(path.stat().st_mode & 0o777) == oct(0o640)  # safetensors' writer left 0600 whatever the umask
    path.chmod(0o644)
    F.save_lora(path, _lora_sd(seed=1), LCFG)  # export --overwrite, or the trainer's final export again
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora.safetensors"]  # no temp file beside it


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)  # a process that has ended


def _tag_dir(tmp_path):
    """A checkpoint folder as the LoRA export reads it: run.yaml (rank, alpha, targets, model, base weights)."""
    from fluxzero.model.weights import save_weights

    save_weights(build_model("flux-tiny").state_dict(), tmp_path / "base.safetensors")
    tag = tmp_path / "checkpoints" / "step_00000001"
    tag.mkdir(parents=True)
    (tag / "run.yaml").write_text(
        yaml.safe_dump({"model": "flux-tiny", "weights": str(tmp_path / "base.safetensors"), "lora": LCFG.to_dict()})
    )
    return tag


def test_a_killed_lora_exports_temp_file_is_removed_by_the_next(tmp_path):
    from fluxzero.train.export.lora import write_lora_export

    tag, pid = _tag_dir(tmp_path), _dead_pid()
    out, merged = tmp_path / "out" / "lora.safetensors", tmp_path / "out" / "merged.safetensors"
    out.parent.mkdir()
    for f in (out, merged):  # what an export killed while writing leaves (24 GB for a merged FLUX.1-dev)
        (f.parent / f".{f.name}.tmp-{pid}").write_bytes(b"half an export")
    write_lora_export(_lora_sd(), tag, out, layout="comfyui", dtype="bf16")
    write_lora_export(_lora_sd(), tag, merged, layout="bfl", dtype="bf16", merge=True)
    assert sorted(p.name for p in out.parent.iterdir()) == ["lora.safetensors", "merged.safetensors"]


@pytest.mark.parametrize(
    "src_layout, to, want",
    [("diffusers", "kohya", "kohya"), ("kohya", "diffusers", "diffusers"), ("fluxzero", "comfyui", "kohya")],
)
def test_convert_moves_a_lora_between_layouts(tmp_path, src_layout, to, want):
    from click.testing import CliRunner

    from fluxzero.cli import main

    lcfg = LoraConfig(rank=4, alpha=8, targets="attention")  # scale 2: exact through the diffusers layout's fold
    sd = _lora_sd(lcfg)
    src = tmp_path / "in.safetensors"
    if src_layout == "fluxzero":  # our own module names, e.g. lora_state_dict(model) saved as it is
        save_file(sd, str(src), metadata={"fluxzero.rank": "4", "fluxzero.alpha": "8.0"})
    else:
        F.save_lora(src, sd, lcfg, layout=src_layout, base_model="flux-tiny")
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out.safetensors"), "--to", to])
    assert r.exit_code == 0, r.output
    assert f"(LoRA, {want} layout, 12 modules, rank 4, alpha 8)" in r.output, r.output
    got, info = F.read_lora(tmp_path / "out.safetensors")
    assert (info.layout, info.rank, info.alpha) == (want, 4, 8.0) and set(got) == set(sd)
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "folder"), "--to", "diffusers"])
    assert r.exit_code != 0 and "a LoRA is written as one file: give OUT a .safetensors name" in r.output
    if src_layout == "fluxzero":  # full weights have no kohya layout
        from fluxzero.model.weights import save_weights

        save_weights(build_model("flux-tiny").state_dict(), tmp_path / "base.safetensors")
        r = CliRunner().invoke(
            main, ["convert", str(tmp_path / "base.safetensors"), str(tmp_path / "k.safetensors"), "--to", "kohya"]
        )
        assert r.exit_code != 0 and "kohya is a LoRA layout and IN holds full weights" in r.output, r.output


# ---------------------------------------------------------------------------------------------------------
# `fluxzero sample --lora`: the PNGs say which LoRA, and --lora-scale is its strength
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sample_files(tmp_path_factory):
    """flux-tiny weights, a kohya LoRA for them, prompt embeddings and a VAE of seconds."""
    from diffusers import AutoencoderKL

    from fluxzero.model.weights import save_weights
    from fluxzero.sampling.embeddings import PromptEmbeddings, save_embeddings

    d = tmp_path_factory.mktemp("sample_lora")
    torch.manual_seed(0)
    save_weights(build_model("flux-tiny").state_dict(), d / "base.safetensors")
    F.save_lora(d / "lora.safetensors", {k: v * 3 for k, v in _lora_sd().items()}, LCFG, layout="kohya")
    save_embeddings(d / "emb.safetensors", PromptEmbeddings(["a cat"], torch.randn(1, 4, 64), torch.randn(1, 32)))
    AutoencoderKL(
        latent_channels=16,
        block_out_channels=(8,),
        norm_num_groups=8,
        layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
    ).save_pretrained(d / "vae")
    return d


def _sample(d, out, *extra):
    from click.testing import CliRunner

    from fluxzero.cli import main

    return CliRunner().invoke(
        main,
        [
            "sample",
            str(d / "base.safetensors"),
            "--out",
            str(out),
            "--embeddings",
            str(d / "emb.safetensors"),
            "--vae",
            str(d / "vae"),
            "--width",
            "32",
            "--height",
            "32",
            "--steps",
            "2",
            "--device",
            "cpu",
            *extra,
        ],
    )


def test_sample_pngs_record_the_lora(sample_files, tmp_path):
    from PIL import Image

    from fluxzero.sampling.images import read_png_params

    d = sample_files
    runs = {
        "plain": [],
        "lora": ["--lora", str(d / "lora.safetensors")],
        "half": ["--lora", str(d / "lora.safetensors"), "--lora-scale", "0.5"],
        "off": ["--lora", str(d / "lora.safetensors"), "--lora-scale", "0"],
    }
    pixels = {}
    for name, extra in runs.items():
        r = _sample(d, tmp_path / name, *extra)
        assert r.exit_code == 0, r.output
        png = tmp_path / name / "0000-p0-s0.png"
        pixels[name] = Image.open(png).tobytes()
        params = read_png_params(png)
        if name == "plain":
            assert "lora" not in params
        else:
            scale = {"lora": 1.0, "half": 0.5, "off": 0.0}[name]
            assert params["lora"] == {
                "path": str((d / "lora.safetensors").resolve()),
                "layout": "kohya",
                "scale": scale,
                "rank": 4,
                "alpha": 2.0,
            }
    assert pixels["off"] == pixels["plain"] and len({pixels["plain"], pixels["lora"], pixels["half"]}) == 3
    r = _sample(d, tmp_path / "bad", "--lora-scale", "2")
    assert r.exit_code == 2 and "--lora-scale sets the strength of a --lora" in r.output, r.output
