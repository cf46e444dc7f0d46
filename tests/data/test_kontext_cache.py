"""`fluxzero cache` on FLUX.1 Kontext pairs: metadata.jsonl with file_name, control_file_name, text; both latents
in the shard, the reference at its target's bucket; bad pairs refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fluxzero.cli import main
from fluxzero.data.tiny_encoders import write_tiny_encoders

ARGS = ["--resolution", "64", "--min-side", "32", "--t5-max-length", "16", "--shard-size", "4", "--batch-size", "2"]


def _image(path: Path, w: int, h: int, seed: int) -> None:
    import numpy as np
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)


def make_pairs(root: Path, rows=None) -> Path:
    """Three targets (two aspects) and their references in control/, the reference of wide.png twice its size."""
    sizes = {"sq.png": (64, 64), "sq2.png": (64, 64), "wide.png": (128, 64)}
    for i, (name, (w, h)) in enumerate(sizes.items()):
        _image(root / name, w, h, i)
        _image(
            root / "control" / name, w * (2 if name == "wide.png" else 1), h * (2 if name == "wide.png" else 1), 10 + i
        )
    rows = rows or [
        {"file_name": n, "control_file_name": f"control/{n}", "text": f"make it {i}"} for i, n in enumerate(sizes)
    ]
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return write_tiny_encoders(tmp_path_factory.mktemp("kontext") / "flux")


def _cache(images, out, flux):
    return CliRunner().invoke(main, ["cache", str(images), str(out), "--flux-dir", str(flux), *ARGS])


def test_pairs_are_cached_with_their_reference_latents(flux, tmp_path):
    import torch

    from fluxzero.config import get_model_config
    from fluxzero.data.loader import check_model_fit
    from fluxzero.data.shards import ShardSource

    images, out = make_pairs(tmp_path / "pairs"), tmp_path / "shards"
    r = _cache(images, out, flux)
    assert r.exit_code == 0, r.output
    src = ShardSource(out)
    assert len(src) == 3 and src.dims["reference"] == 1  # the references are not targets of their own
    assert json.loads((out / "manifest.json").read_text())["cache"]["num_pairs"] == 3
    by_file = {src.sample_meta(i)["file"]: i for i in range(len(src))}
    for name, i in by_file.items():
        s = src.get(i)
        assert s["reference"].shape == s["latents"].shape  # the reference at its target's bucket
        assert not torch.equal(s["reference"], s["latents"])
        assert src.sample_meta(i)["reference"] == f"control/{name}"
        assert src.caption(i).startswith("make it")
    h, w = src.get(by_file["wide.png"])["latents"].shape[-2:]
    assert w > h  # a landscape bucket, the reference (twice the target's size) resized into it
    check_model_fit(src.dims, get_model_config("flux-tiny-kontext"))
    with pytest.raises(Exception, match="not a Kontext model"):
        check_model_fit(src.dims, get_model_config("flux-tiny"))


ROWS = [("sq.png", "control/sq.png"), ("sq2.png", "control/sq2.png"), ("wide.png", "control/wide.png")]


@pytest.mark.parametrize("case", ["missing", "aspect", "no_reference", "misnamed_column", "own_reference", "thumbnail"])
def test_bad_pairs_are_one_sentence_exit_2_and_write_nothing(flux, tmp_path, case):
    rows = None
    if case == "misnamed_column":  # the references would be cached as targets of their own
        rows = [{"file_name": t, "control_file": r, "text": "x"} for t, r in ROWS]
    elif case == "own_reference":
        rows = [{"file_name": t, "control_file_name": t if t == "sq.png" else r, "text": "x"} for t, r in ROWS]
    images = make_pairs(tmp_path / "pairs", rows)
    if case == "misnamed_column":
        want = (
            "metadata.jsonl: column 'control_file' names the image 'control/sq.png', but a FLUX.1 Kontext "
            "reference is read from control_file_name .*; rename the column to control_file_name"
        )
    elif case == "own_reference":
        want = "metadata.jsonl names sq.png as its own reference"
    elif case == "thumbnail":  # 8 px: a 64 px target of the 32 px smallest bucket side is skipped below 16
        _image(images / "control" / "sq.png", 8, 8, 3)
        want = "reference image .*control/sq.png is 8x8 px, its shorter side below 16 px .*--min-image-side"
    elif case == "missing":
        (images / "control" / "sq2.png").unlink()
        want = "reference image .*control/sq2.png .* does not exist"
    elif case == "aspect":
        _image(images / "control" / "sq.png", 128, 64, 3)
        want = "reference image .*control/sq.png is 128x64 px, another aspect ratio than its target .*sq.png"
    else:
        _image(images / "extra.png", 64, 64, 4)
        want = "image .*extra.png has no reference image"
    out = tmp_path / "shards"
    r = _cache(images, out, flux)
    assert r.exit_code == 2, r.output
    msg = r.output.strip().splitlines()[-1]
    assert __import__("re").search(want, msg), msg
    assert "Traceback" not in r.output and not out.exists()


def test_a_chain_of_edits_caches_every_pair(flux, tmp_path):
    """sq.png is sq2.png's reference and a target with its own reference: both pairs are cached."""
    from fluxzero.data.shards import ShardSource

    rows = [
        {"file_name": "sq.png", "control_file_name": "control/sq.png", "text": "a"},
        {"file_name": "sq2.png", "control_file_name": "sq.png", "text": "b"},
        {"file_name": "wide.png", "control_file_name": "control/wide.png", "text": "c"},
    ]
    images = make_pairs(tmp_path / "pairs", rows)
    (images / "control" / "sq2.png").unlink()
    r = _cache(images, tmp_path / "shards", flux)
    assert r.exit_code == 0, r.output
    src = ShardSource(tmp_path / "shards")
    assert sorted((src.sample_meta(i)["file"], src.sample_meta(i)["reference"]) for i in range(len(src))) == [
        ("sq.png", "control/sq.png"),
        ("sq2.png", "sq.png"),
        ("wide.png", "control/wide.png"),
    ]


def test_check_model_fit_asks_a_kontext_model_for_pairs():
    from fluxzero.config import get_model_config
    from fluxzero.data.errors import DataError
    from fluxzero.data.loader import check_model_fit

    dims = {"latent_channels": 16, "t5_len": 16, "t5_dim": 64, "clip_dim": 32}
    with pytest.raises(DataError, match="control_file_name"):
        check_model_fit(dims, get_model_config("flux-tiny-kontext"))
    check_model_fit(dims, get_model_config("flux-tiny"))
