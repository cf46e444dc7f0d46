"""Several datasets in one run (repeats, loss weight, caption dropout), loss masks cached by `fluxzero cache`
(NAME.mask.png, reduced to the image-token grid), the caption prefix, and their refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fluxzero.cli import main
from fluxzero.config.datasets import parse_data
from fluxzero.data import DataError, ShardWriter, build_dataloader
from fluxzero.data.tiny_encoders import WORDS, write_tiny_encoders

SYN_A = "synthetic:n=6,hw=8x8+8x12,txt=4,ctx=64,vec=32"
SYN_B = "synthetic:n=4,hw=8x8,txt=4,ctx=64,vec=32,seed=7"
CACHE_ARGS = [
    "--resolution",
    "64",
    "--min-side",
    "32",
    "--t5-max-length",
    "8",
    "--shard-size",
    "4",
    "--batch-size",
    "4",
]


def _loader(data, **kw):
    return build_dataloader(
        parse_data(data),
        micro_batch=kw.pop("micro_batch", 2),
        rank=kw.pop("rank", 0),
        world_size=kw.pop("world_size", 1),
        seed=kw.pop("seed", 0),
        **kw,
    )


# ------------------------------------------------------------------------------------------ several datasets
def test_repeats_weights_and_caption_dropout_per_dataset():
    data = [{"path": SYN_A, "repeats": 3}, {"path": SYN_B, "loss_weight": 0.25, "caption_dropout": 0.5}]
    loader = _loader(data, micro_batch=1)
    assert loader.num_samples == 6 * 3 + 4
    seen, weights, dropped = [], {}, 0
    for b in loader:
        seen += b["index"].tolist()
        w = b.get("loss_weight", torch.ones(len(b["index"])))
        for i, wi, clip in zip(b["index"].tolist(), w.tolist(), b["clip"]):
            weights[i] = wi
            dropped += bool(i >= 18 and not clip.any())  # SYN_B's empty caption is zeros
    assert sorted(seen) == list(range(22))  # every repeat once
    assert {weights[i] for i in range(18)} == {1.0} and {weights[i] for i in range(18, 22)} == {0.25}
    assert 0 < dropped < 4
    # a repeat is a sample of its own: the same latents, its own index (so its own noise and timestep)
    src = loader.source
    assert torch.equal(src.get(0)["latents"], src.get(6)["latents"]) and src.get(6)["index"] == 6
    assert (
        src.describe(13) == "synthetic sample 1" and "6 samples x 3;" in src.summary() and "2 datasets" in src.summary()
    )
    # the same plan on every call: and a loader resumed mid-epoch draws what the uninterrupted one drew
    first = [b["index"].tolist() for b in _loader(data)]
    again = _loader(data)
    it = iter(again)
    head = [next(it)["index"].tolist() for _ in range(4)]
    state = again.state_dict()
    resumed = _loader(data)
    resumed.load_state_dict(state)
    assert head + [b["index"].tolist() for b in resumed] == first


def test_a_single_source_batch_carries_no_weights():
    b = next(iter(_loader(SYN_A)))
    assert set(b) == {"latents", "t5", "clip", "index"}
    b = next(iter(_loader([{"path": SYN_A}, {"path": SYN_B}])))  # several datasets, all of weight 1: none either
    assert set(b) == {"latents", "t5", "clip", "index"}


def test_other_repeats_or_weights_are_other_data_on_resume():
    a = _loader([{"path": SYN_A, "repeats": 2}, {"path": SYN_B}])
    state = a.state_dict()
    for other in (
        [{"path": SYN_A, "repeats": 3}, {"path": SYN_B}],
        [{"path": SYN_A, "repeats": 2}, {"path": SYN_B, "loss_weight": 0.5}],
    ):
        with pytest.raises(DataError, match="training data changed"):
            _loader(other).load_state_dict(state)


@pytest.mark.parametrize(
    "data, words",
    [
        ([{"path": SYN_A, "repeats": 0}], "repeats 0; set repeats to 1 or more"),
        ([{"path": SYN_A, "repeats": 10**12}], "set repeats from 1 to 1000000"),
        (
            [{"path": SYN_A, "loss_weight": 0}, {"path": SYN_B, "loss_weight": 0}],
            "every dataset of data: has loss_weight 0",
        ),
        (
            [{"path": SYN_A, "trigger_word": "ohwx"}],
            "cache that dataset with --caption-prefix 'ohwx ' and remove trigger_word",
        ),
        ([{"path": SYN_A, "caption_prefix": "ohwx "}], "data[0].caption_prefix: captions are encoded into the shards"),
        ([{"path": SYN_A, "loss_weight": -1}], "loss_weight -1"),
        ([{"path": SYN_A, "caption_dropout": 1.0}], "caption_dropout 1.0"),
        ([{"path": SYN_A, "repeat": 2}], "did you mean 'repeats'"),
        ([{"repeats": 2}], "data[0] has no path"),
        ([{"path": SYN_A}, {"path": SYN_A}], "twice"),
        ([], "empty list"),
        ([SYN_A], "data[0] must be a mapping"),
    ],
)
def test_run_file_data_list_refusals_are_one_sentence(data, words):
    from fluxzero.config import TrainConfig

    with pytest.raises(ValueError) as e:
        TrainConfig.from_dict({"deepspeed": "ds.json", "data": data, "output_dir": "out"})
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_empty_or_mismatched_dataset_among_several_is_named(tmp_path):
    with ShardWriter(tmp_path / "good", samples_per_shard=2) as w:
        for _ in range(2):
            w.add(torch.randn(16, 8, 8), torch.randn(4, 64), torch.randn(32))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=f"data directory {tmp_path / 'empty'} is empty; fill it with `fluxzero cache"):
        _loader([{"path": str(tmp_path / "good")}, {"path": str(tmp_path / "empty")}])
    with pytest.raises(DataError, match="has dims .* cache every dataset of a run with the same encoders"):
        _loader([{"path": str(tmp_path / "good")}, {"path": "synthetic:n=4,hw=8x8,txt=5,ctx=64,vec=32"}])
    pairs = "synthetic:n=4,hw=8x8,txt=4,ctx=64,vec=32,ref=1"  # a Kontext run's regularization set of plain images
    with pytest.raises(
        DataError,
        match=f"dataset {pairs} holds FLUX.1 Kontext pairs but {tmp_path / 'good'} holds no "
        "reference latents; every dataset of a run must be pairs or none",
    ):
        _loader([{"path": pairs}, {"path": str(tmp_path / "good")}])
    # caption dropout at train time needs the empty caption `fluxzero cache` keeps: ShardWriter folders have none
    with pytest.raises(DataError, match="caption dropout needs .*empty_caption.safetensors.*or set caption_dropout"):
        _loader([{"path": str(tmp_path / "good"), "caption_dropout": 0.1}])


def test_an_epoch_too_long_to_list_is_refused_before_it_is_listed():
    big = "synthetic:n=200,hw=8x8,txt=4,ctx=64,vec=32"
    with pytest.raises(
        DataError,
        match="an epoch of 200,000,000 samples .* is more than the 100,000,000 the loader lists; lower the repeats",
    ):
        _loader([{"path": big, "repeats": 10**6}])


# ------------------------------------------------------------------------------------------ masks in the cache
@pytest.fixture(scope="module")
def masked_images(tmp_path_factory):
    """Three 64x64 images: a.png with a mask white on its left half, b.jpg with none, c.png with a mask that
    covers one token in full and one 16x16 token half; captions as .txt."""
    import numpy as np
    from PIL import Image

    base = tmp_path_factory.mktemp("masks")
    root = base / "images"
    root.mkdir()
    rng = np.random.default_rng(0)
    for i, name in enumerate(("a.png", "b.jpg", "c.png")):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(root / name)
        (root / name).with_suffix(".txt").write_text(f"a photo of a {WORDS[5 + i]}")
    left = np.zeros((64, 64), np.uint8)
    left[:, :32] = 255
    Image.fromarray(left).save(root / "a.mask.png")
    spot = np.zeros((64, 64), np.uint8)
    spot[0:16, 0:16] = 255  # token (0, 0) in full
    spot[16:24, 16:32] = 255  # token (1, 1): its top half
    Image.fromarray(spot).save(root / "c.mask.png")
    return write_tiny_encoders(base / "flux"), root


def _cache(*args):
    return CliRunner().invoke(main, ["cache", *map(str, args)], catch_exceptions=False)


def test_masks_are_cached_per_image_token_and_flipped_with_the_image(masked_images, tmp_path):
    flux, images = masked_images
    out = tmp_path / "shards"
    r = _cache(images, out, "--flux-dir", flux, *CACHE_ARGS, "--flip", "both", "--caption-prefix", "ohwx ")
    assert r.exit_code == 0, r.output
    assert "wrote 6 samples, 4 with a mask" in r.output  # the masks are not taken for images
    m = json.loads((out / "manifest.json").read_text())
    assert m["cache"]["num_masked"] == 4 and m["cache"]["caption_prefix"] == "ohwx "
    loader = build_dataloader(str(out), micro_batch=3, rank=0, world_size=1, seed=0)
    src = loader.source
    left = torch.tensor([[1.0, 1.0, 0.0, 0.0]] * 4)
    spot = torch.zeros(4, 4)
    spot[0, 0], spot[1, 1] = 1.0, 0.5
    want = {"a.png": left, "b.jpg": torch.ones(4, 4), "c.png": spot}
    seen = 0
    for b in loader:
        assert b["mask"].shape == (3, 4, 4)  # 64 px -> 8x8 latent -> 4x4 tokens of 2x2 latent patches
        for j, i in enumerate(b["index"].tolist()):
            meta = src.sample_meta(i)
            mask = want[meta["file"]].flip(-1) if meta["flip"] else want[meta["file"]]
            torch.testing.assert_close(b["mask"][j], mask)
            assert src.caption(i).startswith("ohwx a photo of a ")
            assert meta.get("mask") == (None if meta["file"] == "b.jpg" else meta["file"].replace(".png", ".mask.png"))
            seen += 1
    assert seen == 6

    # the image without a mask has the latents and text of a cache without any mask
    plain_images = tmp_path / "plain"
    plain_images.mkdir()
    for name in ("b.jpg", "b.txt"):
        (plain_images / name).write_bytes((images / name).read_bytes())
    plain = tmp_path / "plain_shards"
    assert _cache(plain_images, plain, "--flux-dir", flux, *CACHE_ARGS, "--caption-prefix", "ohwx ").exit_code == 0
    b = next(iter(build_dataloader(str(plain), micro_batch=1, rank=0, world_size=1, seed=0)))
    assert "mask" not in b  # no mask in its shards: the loss stays the plain mean
    k = next(i for i in range(6) if src.sample_meta(i)["file"] == "b.jpg" and not src.sample_meta(i)["flip"])
    s = src.get(k)
    # (within float rounding: the encoders saw it in another batch)
    torch.testing.assert_close(s["latents"], b["latents"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s["t5"], b["t5"][0], rtol=1e-5, atol=1e-5)


def test_an_alpha_channel_is_the_mask_when_asked(masked_images, tmp_path):
    import numpy as np
    from PIL import Image

    flux, _ = masked_images
    images = tmp_path / "images"
    images.mkdir()
    rgba = np.random.default_rng(1).integers(0, 255, (64, 64, 4), dtype=np.uint8)
    rgba[..., 3] = 0
    rgba[:32, :, 3] = 255  # the top half opaque
    Image.fromarray(rgba, "RGBA").save(images / "cut.png")
    r = _cache(images, tmp_path / "plain", "--flux-dir", flux, *CACHE_ARGS)  # by default: over white, no mask
    assert r.exit_code == 0 and "with a mask" not in r.output, r.output
    assert "mask" not in next(
        iter(build_dataloader(str(tmp_path / "plain"), micro_batch=1, rank=0, world_size=1, seed=0))
    )
    r = _cache(images, tmp_path / "alpha", "--flux-dir", flux, *CACHE_ARGS, "--mask-from-alpha")
    assert r.exit_code == 0 and "1 with a mask" in r.output, r.output
    loader = build_dataloader(str(tmp_path / "alpha"), micro_batch=1, rank=0, world_size=1, seed=0)
    b = next(iter(loader))
    assert torch.equal(b["mask"][0], torch.tensor([[1.0] * 4] * 2 + [[0.0] * 4] * 2))
    assert loader.source.sample_meta(0)["mask"] == "alpha"


def test_a_bad_mask_stops_the_cache_before_anything_is_written(masked_images, tmp_path):
    import numpy as np
    from PIL import Image

    flux, images = masked_images
    bad = tmp_path / "images"
    bad.mkdir()
    for name in ("a.png", "b.jpg"):
        (bad / name).write_bytes((images / name).read_bytes())
    Image.new("L", (32, 64), 255).save(bad / "a.mask.png")
    out = tmp_path / "out"
    r = _cache(bad, out, "--flux-dir", flux, *CACHE_ARGS)
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert errors == [
        f"Error: mask {bad / 'a.mask.png'} is 32x64 px but its image {bad / 'a.png'} is 64x64 px; "
        f"save the mask at its image's size (white where the loss applies, black where not)."
    ], r.output
    assert not out.exists()
    (bad / "a.mask.png").write_bytes(b"not a png")
    r = _cache(bad, out, "--flux-dir", flux, *CACHE_ARGS)
    assert r.exit_code == 2 and "mask " in r.output and "cannot be read" in r.output and not out.exists(), r.output
    Image.new("L", (64, 64), 0).save(bad / "a.mask.png")  # an inverted or empty mask: the image would train nothing
    r = _cache(bad, out, "--flux-dir", flux, *CACHE_ARGS)
    assert r.exit_code == 2 and f"mask {bad / 'a.mask.png'} is black everywhere" in r.output, r.output
    assert not out.exists()
    rgb = np.zeros((64, 64, 3), np.uint8)
    rgb[:, :32] = (255, 0, 0)  # a red brush stroke: which weight it means would be a guess
    Image.fromarray(rgb).save(bad / "a.mask.png")
    r = _cache(bad, out, "--flux-dir", flux, *CACHE_ARGS)
    assert r.exit_code == 2, r.output
    assert [line for line in r.output.splitlines() if line.startswith("Error:")] == [
        f"Error: mask {bad / 'a.mask.png'} has colour (its red, green and blue channels differ), and a mask is one "
        "weight per pixel; save it as a grayscale PNG (white where the loss applies, black where not)."
    ], r.output
    assert not out.exists()
    (bad / "a.mask.png").unlink()  # a mask saved as JPEG was cached as an image of its own
    Image.new("L", (64, 64), 255).save(bad / "a.mask.jpg")
    r = _cache(bad, out, "--flux-dir", flux, *CACHE_ARGS)
    assert (
        r.exit_code == 2 and f"mask {bad / 'a.mask.jpg'} is not a PNG; save it as {bad / 'a.mask.png'}" in r.output
    ), r.output
    assert not out.exists()


def test_a_gray_rgb_mask_is_its_gray_and_a_mask_without_image_is_reported(masked_images, tmp_path):
    """An RGB(A) mask with equal channels (how editors save a gray drawing) weighs as the same mask saved as gray;
    a mask whose image is not in the folder is named in one line and in the report, and the cache goes on."""
    import numpy as np
    from PIL import Image

    flux, images = masked_images
    root = tmp_path / "images"
    root.mkdir()
    for name in ("a.png", "a.txt"):
        (root / name).write_bytes((images / name).read_bytes())
    gray = np.asarray(Image.open(images / "a.mask.png"))
    rgba = np.stack([gray, gray, gray, np.full_like(gray, 128)], -1)  # alpha ignored
    Image.fromarray(rgba, "RGBA").save(root / "a.mask.png")
    for name in ("cat.mask.png", "sub/dog.mask.png"):  # cat.jpg renamed, dog never there
        (root / name).parent.mkdir(exist_ok=True)
        Image.new("L", (64, 64), 255).save(root / name)
    out = tmp_path / "out"
    r = _cache(root, out, "--flux-dir", flux, *CACHE_ARGS)
    assert r.exit_code == 0, r.output
    assert [line for line in r.output.splitlines() if "mask file(s)" in line] == [
        f"2 mask file(s) in {root} belong to no image cached here and are not used (first: cat.mask.png; a mask "
        "is NAME.mask.png beside its image NAME.png, .jpg, .jpeg or .webp; all listed in cache_report.json)"
    ], r.output
    report = json.loads((out / "cache_report.json").read_text())
    assert report["masks_matching_no_image"] == ["cat.mask.png", "sub/dog.mask.png"]
    b = next(iter(build_dataloader(str(out), micro_batch=1, rank=0, world_size=1, seed=0)))
    torch.testing.assert_close(b["mask"][0], torch.tensor([[1.0, 1.0, 0.0, 0.0]] * 4), rtol=0, atol=0)


def test_captions_cut_at_t5s_length_are_counted_and_keep_their_prefix(masked_images, tmp_path):
    """T5 keeps a caption's first --t5-max-length tokens (as FLUX.1's pipeline and kohya's cache do): the prefix
    survives, the caption's end is lost; the cache says how many and lists them."""
    flux, images = masked_images
    root = tmp_path / "images"
    root.mkdir()
    for name in ("a.png", "a.txt", "b.jpg"):
        (root / name).write_bytes((images / name).read_bytes())
    (root / "b.txt").write_text(WORDS[5])
    out = tmp_path / "out"
    # 8 tokens: a's 3 prefix + 5 caption words + end-of-text is 9 (cut), b's 3 + 1 + 1 is 5
    r = _cache(root, out, "--flux-dir", flux, *CACHE_ARGS, "--flip", "both", "--caption-prefix", "ohwx ohwx ohwx ")
    assert r.exit_code == 0, r.output
    assert [line for line in r.output.splitlines() if "T5 tokens" in line] == [
        "1 of 2 image(s) have captions longer than 8 T5 tokens, cut at the end (a --caption-prefix, at the start, "
        f"is kept; first: a.png; all listed in {out}/cache_report.json); shorten them, or raise --t5-max-length "
        "(FLUX.1-dev's pipeline uses 512)"
    ], r.output
    assert json.loads((out / "cache_report.json").read_text())["captions_truncated"] == ["a.png"]
    from safetensors.torch import load_file

    lengths = sorted(int(n) for f in out.glob("shard-*.safetensors") for n in load_file(f)["t5_len"])
    assert lengths == [5, 5, 8, 8]  # a's row is full (its start, the prefix, kept); b's is not
    r = _cache(root, tmp_path / "plain", "--flux-dir", flux, *CACHE_ARGS)  # 5 + 1 tokens: nothing cut, nothing said
    assert r.exit_code == 0 and "T5 tokens" not in r.output, r.output


def test_masks_are_checked_with_the_shard():
    """A mask row is part of its sample's checksum: damage to it is caught as damage to the latents is."""
    import tempfile

    from fluxzero.data.shards import ShardSource

    with tempfile.TemporaryDirectory() as d:
        with ShardWriter(d, samples_per_shard=2) as w:
            w.add(torch.randn(16, 8, 8), torch.randn(4, 64), torch.randn(32), mask=torch.zeros(4, 4))
            w.add(torch.randn(16, 8, 8), torch.randn(4, 64), torch.randn(32))
        shard = next(Path(d).glob("shard-*.safetensors"))
        raw = bytearray(shard.read_bytes())
        src = ShardSource(d)
        assert torch.equal(src.get(1)["mask"], torch.ones(4, 4))  # the sample without a mask: all ones
        header = 8 + int.from_bytes(raw[:8], "little")
        meta = json.loads(raw[8:header])
        start = header + meta["mask"]["data_offsets"][0]
        raw[start + 3] ^= 0x40  # sample 0's mask
        shard.write_bytes(bytes(raw))
        with pytest.raises(DataError, match="sample 0 .*fails its checksum"):
            ShardSource(d).get(0)
