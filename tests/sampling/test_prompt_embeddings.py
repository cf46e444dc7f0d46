"""Prompt-embeddings files: values that would sample black images or garbage (NaN, inf, integers, no T5 tokens) are
refused in one sentence naming the file, in `fluxzero sample` as in the trainer's previews (test_train_lora.py runs
those through the trainer); `fluxzero encode-prompts` files are the same bytes each time, with the usual
permissions."""

import hashlib
import math

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from fluxzero.cli import main
from fluxzero.sampling.embeddings import (
    FORMAT,
    VERSION,
    EmbeddingsError,
    PromptEmbeddings,
    load_embeddings,
    save_embeddings,
)
from tests.helpers import umask_027 as _umask_027

umask_027 = pytest.fixture(_umask_027)


def _t5(n=1, tokens=4, width=64):
    return torch.randn(n, tokens, width, generator=torch.Generator().manual_seed(0))


def _poison(t, value):
    t = t.clone()
    t.view(-1)[3] = value
    return t


BAD = [  # (name, t5, clip_pooled, words)
    ("t5_nan", _poison(_t5(), math.nan), torch.randn(1, 32), "t5 holds NaN or infinite values"),
    ("clip_inf", _t5(), _poison(torch.randn(1, 32), math.inf), "clip_pooled holds NaN or infinite values"),
    (
        "t5_int",
        (_t5() * 100).to(torch.int32),
        torch.randn(1, 32),
        "t5 holds int32 values, but prompt embeddings are floating point",
    ),
    ("t5_no_tokens", _t5(tokens=0), torch.randn(1, 32), "the prompt embeddings are empty (t5 (1, 0, 64)"),
]


def _raw_file(path, t5, clip):
    """A file as encode-prompts lays it out, written raw (save_embeddings itself refuses these values)."""
    save_file(
        {"t5": t5.contiguous(), "clip_pooled": clip.contiguous()},
        str(path),
        {"format": FORMAT, "version": VERSION, "prompts": '["a cat"]'},
    )
    return path


@pytest.mark.parametrize("name, t5, clip, words", BAD, ids=[c[0] for c in BAD])
def test_bad_embeddings_are_refused(tmp_path, name, t5, clip, words):
    with pytest.raises(EmbeddingsError, match="encode them again"):
        PromptEmbeddings(["a cat"], t5, clip)
    path = _raw_file(tmp_path / f"{name}.safetensors", t5, clip)
    with pytest.raises(EmbeddingsError) as e:
        load_embeddings(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and words in msg and "\n" not in msg, msg


def test_sample_refuses_nan_embeddings_before_loading_anything(tmp_path):
    path = _raw_file(tmp_path / "nan.safetensors", _poison(_t5(), math.nan), torch.randn(1, 32))
    # WEIGHTS and the VAE are not even read: the embeddings are checked first
    (tmp_path / "w.safetensors").write_bytes(b"")
    r = CliRunner().invoke(
        main,
        [
            "sample",
            str(tmp_path / "w.safetensors"),
            "--out",
            str(tmp_path / "o"),
            "--embeddings",
            str(path),
            "--vae",
            str(tmp_path / "vae"),
        ],
    )
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "t5 holds NaN or infinite values" in text and "Traceback" not in text, r.output
    assert not (tmp_path / "o").exists()


def test_embeddings_files_are_reproducible_with_the_usual_permissions(tmp_path, umask_027):
    emb = PromptEmbeddings(["a cat", "a dog"], _t5(2), torch.randn(2, 32), "blurry", _t5(1), torch.randn(1, 32))
    for name in ("a", "b"):
        save_embeddings(tmp_path / f"{name}.safetensors", emb)
    a, b = (tmp_path / "a.safetensors").read_bytes(), (tmp_path / "b.safetensors").read_bytes()
    assert hashlib.sha256(a).digest() == hashlib.sha256(b).digest()  # safetensors' writer: metadata in any order
    assert oct((tmp_path / "a.safetensors").stat().st_mode & 0o777) == oct(0o640)  # it left 0600 whatever the umask
    (tmp_path / "a.safetensors").chmod(0o644)
    save_embeddings(tmp_path / "a.safetensors", emb)  # encode-prompts again over the same file: the chmod stays
    assert oct((tmp_path / "a.safetensors").stat().st_mode & 0o777) == oct(0o644)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors"]
