"""`fluxzero cache`: buckets, captions, and the real command on tiny random encoders saved in FLUX's layout."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fluxzero.cli import main
from fluxzero.data.buckets import cover_and_crop, make_buckets, nearest_bucket
from fluxzero.data.errors import DataError
from fluxzero.data.images import captions_for, list_images
from fluxzero.data.tiny_encoders import CLIP_DIM, T5_DIM, WORDS
from fluxzero.data.tiny_encoders import write_tiny_encoders as build_tiny_flux_dir

T5_LEN = 16
CACHE_ARGS = [
    "--resolution",
    "64",
    "--min-side",
    "32",
    "--t5-max-length",
    str(T5_LEN),
    "--shard-size",
    "2",
    "--batch-size",
    "2",
]


# ------------------------------------------------------------------------------------------ buckets
def test_buckets_respect_step_area_and_aspect():
    for res, min_side, max_aspect in [(1024, None, 4.0), (512, 256, 2.0), (64, 32, 4.0)]:
        buckets = make_buckets(res, min_side, max_aspect)
        assert (res, res) in buckets
        for h, w in buckets:
            assert h % 16 == 0 and w % 16 == 0
            assert h * w <= res * res
            assert max(h / w, w / h) <= max_aspect + 1e-9
            assert (w, h) in buckets  # portrait and landscape both present
    assert make_buckets(1024)[0] == (512, 2048) and make_buckets(1024)[-1] == (2048, 512)


def test_nearest_bucket_by_log_aspect():
    buckets = make_buckets(1024, step=16)
    assert nearest_bucket(1000, 1000, buckets) == (1024, 1024)
    assert nearest_bucket(2048, 1024, buckets) == (720, 1440)  # exactly 2:1 within 1024^2
    assert nearest_bucket(1024, 2048, buckets) == (1440, 720)
    for w, h in [(1920, 1080), (1080, 1920), (640, 480), (3000, 400), (333, 777)]:
        got = nearest_bucket(w, h, buckets)
        dist = lambda b: abs(math.log(b[0] / b[1]) - math.log(h / w))  # noqa: E731
        assert dist(got) == pytest.approx(min(dist(b) for b in buckets))
    # extreme aspect ratios go to the most extreme bucket
    assert nearest_bucket(10000, 10, buckets) == (512, 2048)


def test_cover_and_crop():
    size, box = cover_and_crop(200, 100, (64, 64))
    assert size == (128, 64) and box == (32, 0, 96, 64)
    size, box = cover_and_crop(30, 90, (96, 48))  # upscales to cover
    assert size[0] >= 48 and size[1] >= 96 and box[2] - box[0] == 48 and box[3] - box[1] == 96


# ------------------------------------------------------------------------------------------ captions
def test_caption_sources(tmp_path):
    for name in ("a.png", "sub/b.jpg", "c.webp"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "a.txt").write_text("a cat \n")
    images = list_images(tmp_path)
    assert images == ["a.png", "c.webp", "sub/b.jpg"]
    caps, src, unmatched = captions_for(tmp_path, images)
    assert src == "txt" and caps == {"a.png": "a cat", "c.webp": None, "sub/b.jpg": None} and unmatched == []
    (tmp_path / "metadata.jsonl").write_text(
        '{"file_name": "sub/b.jpg", "text": "a dog"}\n{"file_name": "c.webp", "caption": "sky"}\n'
    )
    caps, src, unmatched = captions_for(tmp_path, images)
    assert src == "metadata.jsonl" and caps == {"a.png": None, "c.webp": "sky", "sub/b.jpg": "a dog"}
    csv = tmp_path / "caps.csv"
    csv.write_text(
        '\ufefffile_name,text\na.png,"red, blue"\nb.jpg,tree\nzzz.png,gone\n', encoding="utf-8"
    )  # with a BOM
    caps, src, unmatched = captions_for(tmp_path, images, csv)
    assert caps == {"a.png": "red, blue", "c.webp": None, "sub/b.jpg": "tree"}  # bare names match too
    assert unmatched == ["zzz.png"]
    (tmp_path / "bad.jsonl").write_text('{"file_name": "a.png"}\n')
    with pytest.raises(DataError, match="no caption column"):
        captions_for(tmp_path, images, tmp_path / "bad.jsonl")
    (tmp_path / "latin1.csv").write_bytes("file_name,text\na.png,caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8 text"):
        captions_for(tmp_path, images, tmp_path / "latin1.csv")


# ------------------------------------------------------------------------------------------ tiny encoders
def make_images(root: Path) -> Path:
    """Five good images in several aspect ratios and formats, one corrupt, one truncated; captions as .txt."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    (root / "sub").mkdir(parents=True)
    sizes = {
        "square.png": (64, 64),
        "wide.jpg": (128, 64),
        "tall.webp": (48, 96),
        "sub/near.png": (80, 64),
        "alpha.png": (70, 70),
    }
    for i, (name, (w, h)) in enumerate(sizes.items()):
        im = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        (im.convert("RGBA") if name == "alpha.png" else im).save(root / name)
        if name != "alpha.png":  # one image without a caption
            (root / name).with_suffix(".txt").write_text(f"a photo of a {WORDS[5 + i]}")
    (root / "corrupt.png").write_bytes(os.urandom(300))
    data = (root / "wide.jpg").read_bytes()
    (root / "truncated.jpg").write_bytes(data[: len(data) // 3])
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("cache")
    return build_tiny_flux_dir(base / "flux"), make_images(base / "images")


def _cache(*args):
    return CliRunner().invoke(main, ["cache", *map(str, args)], catch_exceptions=False)


def _state(out: Path) -> dict:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.rglob("*")) if p.is_file()}


def test_cache_end_to_end_and_rerun_is_noop(tiny, tmp_path):
    import torch
    from diffusers import AutoencoderKL
    from safetensors.torch import load_file

    from fluxzero.data import build_dataloader
    from fluxzero.data.images import load_bucketed

    flux, images = tiny
    out = tmp_path / "shards"
    r = _cache(images, out, "--flux-dir", flux, *CACHE_ARGS, "--flip", "both", "--caption-dropout", "0.4")
    assert r.exit_code == 0, r.output
    assert "wrote 10 samples" in r.output and "skipped 2 unreadable" in r.output
    assert "encoded 10 of 12 planned samples" in r.output  # truncated.jpg x 2 flips fail to decode
    assert "have no same-name .txt file" in r.output  # not only in the report
    assert "3 of 3 buckets hold fewer than 8 samples (10 samples in all)" in r.output
    assert "a larger --bucket-step (this run's: 16)" in r.output

    report = json.loads((out / "cache_report.json").read_text())
    assert sorted(s["file"] for s in report["skipped"]) == ["corrupt.png", "truncated.jpg"]
    assert report["no_caption"] == ["alpha.png"]  # truncated.jpg has no caption either, but is skipped
    m = json.loads((out / "manifest.json").read_text())
    assert m["version"] == 1 and m["num_samples"] == 10  # 5 good images x (plain + flipped)
    assert m["dims"] == {"latent_channels": 16, "t5_len": T5_LEN, "t5_dim": T5_DIM, "clip_dim": CLIP_DIM}
    c = m["cache"]
    assert c["num_flipped"] == 5 and c["flip"] == "both" and c["num_skipped"] == 2
    assert (c["vae_scale"], c["vae_shift"]) == (0.3611, 0.1159)
    assert 0 < c["num_caption_dropped"] < 10
    assert sum(b["num_samples"] for b in c["pixel_buckets"].values()) == 10
    assert set(c["pixel_buckets"]) == {"64x64", "48x80", "80x48"}  # square, 2:1-ish wide and tall

    # the shards feed the trainer's loader; latents follow FLUX's (z - shift) * scale of the VAE mode
    loader = build_dataloader(str(out), micro_batch=2, rank=0, world_size=1, seed=0)
    assert len(loader) == 5
    batches = list(loader)
    assert sorted(i for b in batches for i in b["index"].tolist()) == list(range(10))
    vae = AutoencoderKL.from_pretrained(flux / "vae", low_cpu_mem_usage=False).eval()
    empty = load_file(str(out / "empty_caption.safetensors"))
    src = loader.source
    dropped = 0
    for b in batches:
        for j, i in enumerate(b["index"].tolist()):
            meta = src.sample_meta(i)
            h, w = b["latents"].shape[-2:]
            px = load_bucketed(images / meta["file"], (h * 8, w * 8), meta["flip"])
            with torch.no_grad():
                z = vae.encode(px[None]).latent_dist.mode()[0]
            torch.testing.assert_close(b["latents"][j], (z - 0.1159) * 0.3611, rtol=1e-5, atol=1e-5)
            if meta["caption_dropped"]:
                dropped += 1
                assert torch.equal(b["t5"][j], empty["t5"]) and torch.equal(b["clip"][j], empty["clip"])
                assert src.caption(i) == ""
            elif meta["file"] != "alpha.png":
                assert src.caption(i).startswith("a photo of a ")
                assert not torch.equal(b["t5"][j], empty["t5"])
    assert dropped == c["num_caption_dropped"]

    before = _state(out)
    r = _cache(images, out, "--flux-dir", flux, *CACHE_ARGS, "--flip", "both", "--caption-dropout", "0.4")
    assert r.exit_code == 0, r.output
    assert "already done" in r.output and "loading encoders" not in r.output
    assert _state(out) == before  # a rerun rewrites nothing


def test_interrupted_and_damaged_shards_are_redone(tiny, tmp_path):
    flux, images = tiny
    out = tmp_path / "shards"
    assert _cache(images, out, "--flux-dir", flux, *CACHE_ARGS).exit_code == 0
    manifest = (out / "manifest.json").read_bytes()
    shards = sorted(out.glob("shard-*.safetensors"))
    # a crash after writing shard 0 but before its part file, and a truncated shard 1
    (out / "parts" / "shard-00000.json").unlink()
    (out / "manifest.json").unlink()
    shards[1].write_bytes(shards[1].read_bytes()[:100])
    r = _cache(images, out, "--flux-dir", flux, *CACHE_ARGS)
    assert r.exit_code == 0, r.output
    assert f"{len(shards) - 2} of {len(shards)} shards already done" in r.output
    assert (out / "manifest.json").read_bytes() == manifest  # same bytes as the uninterrupted run


@pytest.mark.slow
def test_two_processes_split_the_work(tiny, tmp_path):
    """Two real processes (RANK/WORLD_SIZE from the environment) give the same shards as one process."""
    flux, images = tiny
    one, two = tmp_path / "one", tmp_path / "two"
    assert _cache(images, one, "--flux-dir", flux, *CACHE_ARGS).exit_code == 0
    cmd = [sys.executable, "-m", "fluxzero.cli", "cache", str(images), str(two), "--flux-dir", str(flux), *CACHE_ARGS]
    procs = [
        subprocess.Popen(
            cmd,
            env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    # shards 0, 2 (truncated.jpg fails to decode) and shards 1, 3; the counts add up to the manifest's 5
    assert "encoded 2 of 3 planned samples" in outs[0] and "1 unreadable image(s) skipped" in outs[0], outs
    assert "encoded 3 samples" in outs[1] and "wrote 5 samples" in "".join(outs), outs
    assert json.loads((two / "manifest.json").read_text()) == json.loads((one / "manifest.json").read_text())


def test_bad_input_messages(tiny, tmp_path):
    flux, images = tiny
    r = _cache(images, tmp_path / "o", "--flux-dir", images)
    assert r.exit_code == 2 and "vae/" in r.output and "text_encoder_2/" in r.output
    r = _cache(images, tmp_path / "o")
    assert r.exit_code == 2 and "--flux-dir" in r.output
    r = _cache(images, tmp_path / "o", "--flux-dir", flux, "--t5", images)
    assert r.exit_code == 2 and "T5EncoderModel" in r.output and "no config.json" in r.output
    r = _cache(images, tmp_path / "o", "--flux-dir", flux, "--resolution", "100")
    assert r.exit_code == 2 and "multiple of 16" in r.output
    (tmp_path / "empty").mkdir()
    r = _cache(tmp_path / "empty", tmp_path / "o", "--flux-dir", flux)
    assert r.exit_code == 1 and "holds no .png" in r.output
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.png").write_bytes(b"not an image")
    r = _cache(bad, tmp_path / "o2", "--flux-dir", flux, *CACHE_ARGS)
    assert r.exit_code == 1 and "could be used: 1 of 1 skipped (1 unreadable)" in r.output, r.output
    assert "cache_report.json" in r.output
    out = tmp_path / "o3"
    assert _cache(images, out, "--flux-dir", flux, *CACHE_ARGS).exit_code == 0
    r = _cache(images, out, "--flux-dir", flux, *CACHE_ARGS, "--flip", "random")
    assert r.exit_code == 1 and "other images, captions or options" in r.output
    assert "(changed: --flip was none, now random)" in r.output, r.output  # which option, by its flag
    shutil.copytree(flux / "text_encoder_2", tmp_path / "t5_copy")
    r = _cache(images, out, "--flux-dir", flux, *CACHE_ARGS, "--t5", tmp_path / "t5_copy")  # other encoder
    assert r.exit_code == 1 and "other images, captions or options" in r.output
    assert "(changed: the encoders (--flux-dir, --vae, --t5, --clip, --dtype))" in r.output, r.output
    from fluxzero.data import ShardWriter

    with ShardWriter(tmp_path / "foreign") as w:
        w.add(*[t[0] for t in _tiny_tensors()])
    r = _cache(images, tmp_path / "foreign", "--flux-dir", flux, *CACHE_ARGS)
    assert r.exit_code == 1 and "not made by this cache run" in r.output


def test_wrong_encoder_folders_are_refused(tiny, tmp_path, monkeypatch):
    """A folder of another model would load as random weights: refused by config.json, or by missing weights."""
    flux, images = tiny
    out = tmp_path / "o"
    for opt, folder, found in [
        ("--t5", "text_encoder", "clip_text_model"),
        ("--clip", "text_encoder_2", "t5"),
        ("--vae", "text_encoder", "clip_text_model"),
    ]:
        r = _cache(images, out, "--flux-dir", flux, *CACHE_ARGS, opt, flux / folder)
        assert (
            r.exit_code == 2 and f"is a '{found}' model folder, not a" in r.output and str(flux / folder) in r.output
        ), r.output
    tok = tmp_path / "clip_tok"
    shutil.copytree(flux / "tokenizer", tok)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "CLIPTokenizer"}))
    r = _cache(images, out, "--flux-dir", flux, *CACHE_ARGS, "--t5-tokenizer", tok)
    assert r.exit_code == 2 and "CLIPTokenizer (a CLIP tokenizer), not a T5 tokenizer" in r.output, r.output
    pickled = tmp_path / "pickled_t5"
    pickled.mkdir()
    shutil.copy(flux / "text_encoder_2" / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"pickle")
    r = _cache(images, out, "--flux-dir", flux, *CACHE_ARGS, "--t5", pickled)
    assert r.exit_code == 2 and "only pickled .bin weights" in r.output, r.output
    assert not out.exists()  # all refused before anything was written

    # the right config.json but another model's weights: missing weights, refused after the plan is written
    mixed = tmp_path / "mixed_t5"
    mixed.mkdir()
    shutil.copy(flux / "text_encoder_2" / "config.json", mixed)
    shutil.copy(flux / "text_encoder" / "model.safetensors", mixed)
    r = _cache(images, out, "--flux-dir", flux, *CACHE_ARGS, "--t5", mixed)
    assert r.exit_code == 1 and f"{mixed} lacks 12 weight(s)" in r.output and "random numbers" in r.output, r.output
    assert "MISSING" not in r.output and "Traceback" not in r.output  # no transformers load report
    assert (out / "cache_plan.json").exists() and not list(out.glob("shard-*"))
    # the fixed command replaces the plan of the failed run (nothing was encoded under it) and succeeds
    monkeypatch.chdir(flux.parent)
    r = _cache(images, out, "--flux-dir", "flux", *CACHE_ARGS)  # relative: the manifest stores absolute paths
    assert r.exit_code == 0 and "wrote 5 samples" in r.output, r.output
    encoders = json.loads((out / "manifest.json").read_text())["cache"]["encoders"]
    assert encoders["t5"] == str(flux / "text_encoder_2") and all(os.path.isabs(p) for p in encoders.values())


def test_sixteen_bit_grayscale_is_scaled_not_clipped(tmp_path):
    import numpy as np
    import torch
    from PIL import Image

    from fluxzero.data.images import load_bucketed

    ramp = np.tile(np.linspace(0, 65535, 64).astype(np.uint16), (64, 1))
    Image.fromarray(ramp).save(tmp_path / "gray16.png")
    assert Image.open(tmp_path / "gray16.png").mode in ("I;16", "I")
    Image.fromarray((ramp / 257).round().astype(np.uint8)).save(tmp_path / "gray8.png")
    px16, px8 = (load_bucketed(tmp_path / f, (64, 64), False) for f in ("gray16.png", "gray8.png"))
    assert px16.shape == (3, 64, 64) and px16.min() == -1.0 and px16.max() == 1.0  # was all 1.0 (white)
    torch.testing.assert_close(px16, px8, rtol=0, atol=1.01 / 127.5)  # the same picture within one 8-bit level


def test_captions_small_images_and_bucket_step(tiny, tmp_path):
    """Unused caption rows and tiny images are reported on the console; --bucket-step coarsens the buckets."""
    import numpy as np
    from PIL import Image

    flux, images = tiny
    data = tmp_path / "data"
    data.mkdir()
    for name in ("square.png", "wide.jpg", "tall.webp"):
        shutil.copy(images / name, data)
    Image.fromarray(np.zeros((1, 1, 3), np.uint8)).save(data / "dot.png")
    caps = tmp_path / "caps.csv"
    caps.write_text("file_name,text\nsquare.png,a red house\nwide.jpg,a tree\nghost.png,a cat\n")
    r = _cache(data, tmp_path / "out", "--flux-dir", flux, *CACHE_ARGS, "--captions", caps, "--bucket-step", "32")
    assert r.exit_code == 0, r.output
    assert "1 of 3 image(s) have no row in caps.csv" in r.output and "first: tall.webp" in r.output
    assert "1 row(s) of caps.csv name no image" in r.output and "first: ghost.png" in r.output
    assert "skipped 1 too small image(s)" in r.output
    report = json.loads((tmp_path / "out" / "cache_report.json").read_text())
    assert report["captions_matching_no_image"] == ["ghost.png"] and report["no_caption"] == ["tall.webp"]
    assert report["skipped"] == [
        {"file": "dot.png", "reason": "too small: 1x1 px, shorter side below 16 px (--min-image-side)"}
    ]
    c = json.loads((tmp_path / "out" / "manifest.json").read_text())["cache"]
    assert c["bucket_step"] == 32 and c["min_image_side"] == 16 and c["num_images"] == 4
    assert all(int(side) % 32 == 0 for k in c["pixel_buckets"] for side in k.split("x")), c["pixel_buckets"]

    # a caption file that names none of the images is refused before any encoder loads
    (tmp_path / "other.csv").write_text("file_name,text\nimg_001.png,a cat\n")
    r = _cache(data, tmp_path / "out2", "--flux-dir", flux, *CACHE_ARGS, "--captions", tmp_path / "other.csv")
    assert r.exit_code == 1 and "other.csv (e.g. 'img_001.png') names one of the 4 images" in r.output, r.output
    assert "loading encoders" not in r.output
    r = _cache(data, tmp_path / "out2", "--flux-dir", flux, *CACHE_ARGS, "--bucket-step", "48")
    assert r.exit_code == 2 and "--bucket-step" in r.output and "divides --resolution 64" in r.output
    assert len(make_buckets(1024)) == len(make_buckets(1024, step=64)) == 33 < len(make_buckets(1024, step=16)) == 129


def test_default_bucket_step_is_64_and_a_cached_folder_keeps_its_own(tiny, tmp_path):
    """At 256 px and above the default step is 64 (every token count a multiple of 16); a folder cached with
    another step (an explicit one, or 16 before the default changed) is resumed with that step, not refused."""
    flux, images = tiny
    args = ["--flux-dir", flux, "--resolution", "256", "--t5-max-length", T5_LEN, "--shard-size", "2"]
    r = _cache(images, tmp_path / "d", *args)
    assert r.exit_code == 0, r.output
    c = json.loads((tmp_path / "d" / "manifest.json").read_text())["cache"]
    assert c["bucket_step"] == 64
    assert all(int(h) * int(w) // 256 % 16 == 0 for h, w in (k.split("x") for k in c["pixel_buckets"]))
    r = _cache(images, tmp_path / "s", *args, "--bucket-step", "16")
    assert r.exit_code == 0, r.output
    before = _state(tmp_path / "s")
    r = _cache(images, tmp_path / "s", *args)  # no --bucket-step: the folder's 16, so a no-op rerun
    assert r.exit_code == 0 and "changed" not in r.output, r.output
    assert _state(tmp_path / "s") == before
    r = _cache(images, tmp_path / "s", *args, "--bucket-step", "64")  # an explicit other step is a change
    assert r.exit_code != 0 and "--bucket-step was 16, now 64" in r.output, r.output


def test_user_errors_are_one_sentence(tiny, tmp_path, monkeypatch):
    import errno

    from fluxzero.data import shards

    flux, images = tiny
    args = ["--flux-dir", flux, *CACHE_ARGS]
    r = _cache(images, tmp_path / "o", *args, "--device", "cuda:99")  # no such GPU, with or without CUDA
    assert r.exit_code == 2 and "--device: 'cuda:99'" in r.output and "GPU" in r.output, r.output
    (tmp_path / "file").write_text("x")
    r = _cache(images, tmp_path / "file" / "o", *args)
    assert r.exit_code == 1 and "cannot write to the output folder" in r.output, r.output
    r = CliRunner(env={"RANK": "abc", "WORLD_SIZE": "2"}).invoke(
        main, ["cache", str(images), str(tmp_path / "o"), *map(str, args)]
    )
    assert r.exit_code == 2 and "RANK='abc' is not a whole number" in r.output, r.output
    (tmp_path / "latin1.csv").write_bytes("file_name,text\nsquare.png,caf\xe9\n".encode("latin-1"))
    r = _cache(images, tmp_path / "o", *args, "--captions", tmp_path / "latin1.csv")
    assert r.exit_code == 1 and "is not UTF-8 text" in r.output, r.output

    # a full disk at the second shard: one sentence; the first shard is kept and the same command resumes
    out, real, calls = tmp_path / "full", shards.write_shard, []

    def write_shard(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(a[0]))
        return real(*a, **k)

    (out).mkdir()
    (out / "cache_plan.json").write_text("{not json")  # damaged and nothing encoded yet: replaced
    monkeypatch.setattr(shards, "write_shard", write_shard)
    r = _cache(images, out, *args)
    assert r.exit_code == 1 and "No space left on device" in r.output and "Traceback" not in r.output, r.output
    assert "(1 by this process) are kept" in r.output and "same command again" in r.output
    monkeypatch.setattr(shards, "write_shard", real)
    r = _cache(images, out, *args)
    assert r.exit_code == 0 and "1 of 4 shards already done" in r.output, r.output
    (out / "cache_plan.json").write_text("{not json")  # damaged with shards there: they cannot be matched
    r = _cache(images, out, *args)
    assert r.exit_code == 1 and "cache_plan.json is damaged" in r.output, r.output


def test_missing_cache_dependencies(tiny, tmp_path, monkeypatch):
    flux, images = tiny
    monkeypatch.setitem(sys.modules, "diffusers", None)  # find_spec and import then fail as if not installed
    monkeypatch.setitem(sys.modules, "PIL", None)
    r = _cache(images, tmp_path / "o", "--flux-dir", flux, *CACHE_ARGS)
    assert r.exit_code == 1 and "needs Pillow, diffusers, which are not installed" in r.output, r.output
    assert "pip install -e '.[cache]'" in r.output and not (tmp_path / "o").exists()


def test_txt_captions_hidden_by_a_metadata_file_are_counted(tiny, tmp_path):
    from PIL import Image

    flux, _ = tiny
    images = tmp_path / "images"
    images.mkdir()
    for name in ("a", "b", "c"):
        Image.new("RGB", (64, 64), (40, 90, 160)).save(images / f"{name}.png")
        (images / f"{name}.txt").write_text(f"photo {name}")
    r = _cache(images, tmp_path / "o1", "--flux-dir", flux, *CACHE_ARGS)
    assert r.exit_code == 0 and "ignored" not in r.output, r.output  # the .txt files are the captions
    (images / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "a dog"}\n')
    r = _cache(images, tmp_path / "o2", "--flux-dir", flux, *CACHE_ARGS)
    assert r.exit_code == 0, r.output
    assert (
        f"3 same-name .txt caption file(s) are ignored: the captions come from {images / 'metadata.jsonl'} "
        "(move it out of the image folder to use them)"
    ) in r.output, r.output


def _tiny_tensors():
    import torch

    return torch.zeros(1, 16, 2, 2), torch.zeros(1, 3, 4), torch.zeros(1, 5)


@pytest.mark.slow
def test_trainer_learns_from_cached_shards(tiny, tmp_path):
    """cache -> shards -> the real trainer (one process, DeepSpeed ZeRO-2 on CPU) on flux-tiny: loss finite and falling."""
    pytest.importorskip("fluxzero.train")
    flux, images = tiny
    out = tmp_path / "shards"
    r = _cache(images, out, "--flux-dir", flux, *CACHE_ARGS, "--flip", "both")
    assert r.exit_code == 0, r.output
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    cfg = {
        "deepspeed": str(tmp_path / "ds.json"),
        "data": str(out),
        "output_dir": str(tmp_path / "run"),
        "model": "flux-tiny",
        "steps": 40,
        "seed": 0,
        "export": {"format": None},
        "log_every": 10,
    }
    code = (
        "import json, sys; from fluxzero.config import TrainConfig; from fluxzero.train.loop import train; "
        "print('LOSSES', json.dumps(train(TrainConfig.from_dict(json.loads(sys.argv[1])))['losses']))"
    )
    # one thread, as every trainer child of the suite: two OpenMP threads on a shared 2-core machine spin for
    # the CPU and flux-tiny gains nothing from them
    env = {**os.environ, "FLUXZERO_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cfg)], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    losses = json.loads(p.stdout.split("LOSSES", 1)[1])
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < 0.8 * first, losses  # measured: 1.11 -> 0.61


def test_processes_with_different_plans_never_share_a_folder(tmp_path):
    """The plan file is created exclusively; a differing plan is refused while its run may still be working,
    replaced once that run recorded a failure, and parts of another plan are never taken as done."""
    from fluxzero.data.cache import PLAN_FILE, CacheOptions, _claim_dir, _mark_failed, _part_path, _read_part, make_plan

    images = tmp_path / "img"
    images.mkdir()
    from PIL import Image

    Image.new("RGB", (64, 64)).save(images / "a.png")
    out = tmp_path / "out"
    a, b = (CacheOptions(str(images), str(out), resolution=64, seed=s) for s in (0, 7))
    plan_a, plan_b = make_plan(a), make_plan(b)
    _claim_dir(out, plan_a, a)
    _claim_dir(out, plan_a, a)  # a sibling rank of the same run joins
    with pytest.raises(
        DataError, match=f"being cached by another process.*changed: --seed was 0, now 7.*delete {out} to start over"
    ):
        _claim_dir(out, plan_b, b)  # a run with another seed starting while the first has no shard yet
    _mark_failed(out, plan_a, a)
    _claim_dir(out, plan_b, b)  # the first run failed before encoding anything: the corrected one takes over
    assert json.loads((out / PLAN_FILE).read_text())["fingerprint"] == plan_b["fingerprint"]
    _part_path(out, 0).write_text(json.dumps({"fingerprint": plan_a["fingerprint"], "record": None, "skipped": []}))
    assert _read_part(out, 0, plan_b["fingerprint"]) is None  # another plan's part is not this plan's shard
    assert _read_part(out, 0, plan_a["fingerprint"]) is not None


def test_in_place_edit_of_same_size_changes_the_plan(tmp_path):
    from PIL import Image

    from fluxzero.data.cache import CacheOptions, make_plan

    Image.new("RGB", (64, 64), (10, 20, 30)).save(tmp_path / "a.png")
    opts = CacheOptions(str(tmp_path), str(tmp_path / "out"), resolution=64)
    before = make_plan(opts)["fingerprint"]
    st = (tmp_path / "a.png").stat()
    os.utime(tmp_path / "a.png", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes count, new mtime
    assert make_plan(opts)["fingerprint"] != before


def test_txt_captions_are_utf8_with_or_without_bom(tmp_path):
    (tmp_path / "a.png").write_bytes(b"")
    (tmp_path / "a.txt").write_bytes("\ufeffcafé au lait".encode("utf-8"))
    assert captions_for(tmp_path, ["a.png"])[0] == {"a.png": "café au lait"}
    (tmp_path / "a.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match=r"a.txt is not UTF-8 text \(byte 3 cannot be decoded\); save it as UTF-8"):
        captions_for(tmp_path, ["a.png"])


def test_sampled_latents_do_not_depend_on_batch_size(tiny, tmp_path):
    flux, images = tiny
    args = [*CACHE_ARGS[:-2], "--shard-size", "4", "--latent", "sample", "--seed", "3"]
    for bs in (2, 4):
        assert _cache(images, tmp_path / f"bs{bs}", "--flux-dir", flux, *args, "--batch-size", bs).exit_code == 0
    import torch
    from safetensors.torch import load_file

    shards = sorted(p.name for p in (tmp_path / "bs2").glob("shard-*.safetensors"))
    assert len(shards) == 3
    for n in shards:
        a, b = load_file(str(tmp_path / "bs2" / n)), load_file(str(tmp_path / "bs4" / n))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in ("t5", "clip", "t5_len"))
        # the noise is the same; the CPU convolutions round differently by batch size (~1e-6), while noise
        # drawn per batch differed by O(1)
        torch.testing.assert_close(a["latents"], b["latents"], rtol=0, atol=1e-5)


def test_caption_table_by_relative_or_absolute_path_is_one_plan(tmp_path, monkeypatch):
    from PIL import Image

    from fluxzero.data.cache import CacheOptions, make_plan

    Image.new("RGB", (64, 64)).save(tmp_path / "a.png")
    (tmp_path / "c.csv").write_text("file_name,text\na.png,a cat\n")
    monkeypatch.chdir(tmp_path)
    plans = [
        make_plan(CacheOptions(str(tmp_path), "out", resolution=64, caption_file=f))
        for f in ("c.csv", str(tmp_path / "c.csv"))
    ]
    assert plans[0]["fingerprint"] == plans[1]["fingerprint"]


def test_rank_without_its_siblings_says_what_is_missing(tiny, tmp_path, monkeypatch):
    from fluxzero.data.encode import local_rank

    flux, images = tiny
    r = _cache(images, tmp_path / "o", "--flux-dir", flux, *CACHE_ARGS, "--rank", "0", "--world-size", "2")
    assert r.exit_code == 0 and "2 of 4 shards still missing (those of rank(s) 1 of 2)" in r.output, r.output
    assert "planning" in r.output  # rank 0's progress bar over the image headers
    assert not (tmp_path / "o" / "manifest.json").exists()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert local_rank() == 3  # srun sets no LOCAL_RANK


def test_trns_colour_key_is_put_over_white(tmp_path):
    """PNG tRNS marks one colour transparent in L, RGB and 16-bit gray images too, not only in palette ones."""
    import numpy as np
    from PIL import Image

    from fluxzero.data.images import load_bucketed

    half = np.zeros((64, 64), np.uint8)
    half[:, 32:] = 128  # left half the transparent key (0), right half opaque gray
    Image.fromarray(half).save(tmp_path / "l.png", transparency=0)
    Image.fromarray(np.stack([half] * 3, -1)).save(tmp_path / "rgb.png", transparency=(0, 0, 0))
    Image.fromarray(half.astype(np.uint16) * 257).save(tmp_path / "i16.png", transparency=0)
    for f in ("l.png", "rgb.png", "i16.png"):
        assert "transparency" in Image.open(tmp_path / f).info, f
        px = load_bucketed(tmp_path / f, (64, 64), False)
        assert px[:, :, :30].min() == 1.0, f  # white, not black
        assert abs(px[:, :, 34:].mean().item() - (128 / 127.5 - 1)) < 0.01, f


def test_large_images_are_not_taken_for_decompression_bombs(tmp_path, monkeypatch):
    """PIL refuses images above 2 x MAX_IMAGE_PIXELS (179 MP by default); the cache raises that limit and keeps its own."""
    import torch
    from PIL import Image

    import fluxzero.data.images as images

    Image.new("RGB", (600, 400), (200, 10, 10)).save(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # stands in for PIL's 89 MP against a 15000x12000 photo
    monkeypatch.setattr(images, "_BIG_PIXELS", 1000)  # takes the one-at-a-time, reduced decode
    assert images.probe_size(tmp_path / "big.png") == (600, 400)
    px = images.load_bucketed(tmp_path / "big.png", (32, 48), False)
    torch.testing.assert_close(px[0], torch.full((32, 48), 200 / 127.5 - 1))
    monkeypatch.setattr(images, "MAX_PIXELS", 200_000)
    with pytest.raises(ValueError, match="600x400 px is more than"):
        images.probe_size(tmp_path / "big.png")


def test_tiny_encoders_command_lets_cache_run_without_weights(tmp_path):
    """`fluxzero tiny-encoders DIR` writes a FLUX.1-layout folder that `cache --flux-dir DIR` takes, marked as a toy."""
    from fluxzero.data.tiny_encoders import NOTE_FILE

    enc = tmp_path / "tiny"
    r = CliRunner().invoke(main, ["tiny-encoders", str(enc)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "for trying the pipeline only" in r.output and f"--flux-dir {enc}" in r.output
    assert {p.name for p in enc.iterdir()} == {
        "vae",
        "text_encoder",
        "text_encoder_2",
        "tokenizer",
        "tokenizer_2",
        NOTE_FILE,
    }
    assert "useless for training a real model" in (enc / NOTE_FILE).read_text()
    r = CliRunner().invoke(main, ["tiny-encoders", str(enc)])
    assert r.exit_code == 2 and "is not empty" in r.output  # never writes over a folder
    images = make_images(tmp_path / "images")
    r = _cache(images, tmp_path / "shards", "--flux-dir", enc, *CACHE_ARGS)
    assert r.exit_code == 0, r.output
    assert "tiny random-weight encoders" in r.output and "useless for training a real model" in r.output
    dims = json.loads((tmp_path / "shards" / "manifest.json").read_text())["dims"]
    assert (dims["t5_dim"], dims["clip_dim"], dims["latent_channels"]) == (T5_DIM, CLIP_DIM, 16)  # flux-tiny's widths


def test_nothing_usable_says_how_many_were_skipped_and_why(tiny, tmp_path):
    import numpy as np
    from PIL import Image

    flux, _ = tiny
    data = tmp_path / "small"
    data.mkdir()
    for i in range(2):
        Image.fromarray(np.zeros((8, 12, 3), np.uint8)).save(data / f"s{i}.png")
    (data / "bad.png").write_bytes(b"not an image")
    r = _cache(data, tmp_path / "out", "--flux-dir", flux, *CACHE_ARGS)  # smallest bucket side 32: 16 px at least
    assert r.exit_code == 1, r.output
    assert "could be used: 3 of 3 skipped (2 too small, 1 unreadable)" in r.output, r.output
    assert "shorter side below 16 px (half the smallest bucket side; a lower --resolution or --min-side" in r.output
    assert "cache_report.json" in r.output and "loading encoders" not in r.output
    report = json.loads((tmp_path / "out" / "cache_report.json").read_text())
    assert sorted(s["file"] for s in report["skipped"]) == ["bad.png", "s0.png", "s1.png"]
    r = _cache(data, tmp_path / "out2", "--flux-dir", flux, *CACHE_ARGS, "--min-image-side", "10")
    assert r.exit_code == 1 and "below 10 px (--min-image-side; a lower value keeps them" in r.output, r.output
