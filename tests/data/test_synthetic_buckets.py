"""Synthetic aspect buckets: weighted sizes, the `buckets=RES` mix, and shard folders written from a spec."""

from __future__ import annotations

from collections import Counter

import pytest

from fluxzero.data import DataError, build_dataloader, read_manifest
from fluxzero.data.buckets import make_buckets
from fluxzero.data.synthetic import SyntheticSource, bucket_mix, write_shards


def test_weighted_sizes_repeat_in_proportion():
    s = SyntheticSource("synthetic:n=20,hw=4x4*3+4x6+6x4,txt=2,ctx=2,vec=2")
    assert s.latent_sizes()[:5] == [(4, 4), (4, 4), (4, 4), (4, 6), (6, 4)]
    assert Counter(s.latent_sizes()) == {(4, 4): 12, (4, 6): 4, (6, 4): 4}
    # an unweighted spec keeps its sizes and its fingerprint (a checkpoint's data check)
    assert (
        SyntheticSource("synthetic:hw=4x4+4x6").fingerprint() == SyntheticSource("synthetic:hw=4x4*1+4x6").fingerprint()
    )


def test_bucket_mix_is_what_cache_buckets_a_photo_collection_into():
    assert bucket_mix(512) == "64x64*4+72x56*2+56x72*2+80x48+48x80"  # the 64 px default step
    assert bucket_mix(512, step=16) == "64x64*4+74x54*2+54x74*2+78x52+52x78"
    pixels = {(h * 8, w * 8) for h, w in SyntheticSource("synthetic:n=10,buckets=1024").latent_sizes()}
    assert pixels <= set(make_buckets(1024)) and (1024, 1024) in pixels and len(pixels) == 5
    sizes = Counter(SyntheticSource("synthetic:n=100,buckets=512").latent_sizes())
    assert sizes == {(64, 64): 40, (72, 56): 20, (56, 72): 20, (80, 48): 10, (48, 80): 10}
    # every image token count (latent h x w / 4) a multiple of 16: one compiled shape family for Inductor
    assert all(h * w // 4 % 16 == 0 for h, w in sizes)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("synthetic:buckets=500", "buckets must be a pixel resolution, a multiple of 16"),
        ("synthetic:buckets=512,hw=8x8", "give hw or buckets, not both"),
        ("synthetic:hw=8x8*0", "hw must be latent sizes like 32x32"),
        ("synthetic:hw=8x8*two", "hw must be latent sizes like 32x32"),
    ],
)
def test_bad_bucket_specs_name_the_fix(spec, match):
    with pytest.raises(DataError, match=match):
        SyntheticSource(spec)


def test_write_shards_is_read_by_the_trainer_loader_bucket_by_bucket(tmp_path):
    spec = "synthetic:n=30,buckets=128,txt=3,ctx=4,vec=2"
    manifest = write_shards(spec, tmp_path / "d", samples_per_shard=4, dtype="float32")
    assert read_manifest(tmp_path / "d") == manifest
    assert {k: b["num_samples"] for k, b in manifest["buckets"].items()} == {
        "16x16": 12,
        "18x14": 6,
        "14x18": 6,
        "20x12": 3,
        "12x20": 3,
    }
    loader = build_dataloader(str(tmp_path / "d"), micro_batch=2, rank=0, world_size=1, seed=0)
    shapes = [tuple(b["latents"].shape[-2:]) for b in loader]
    assert len(set(shapes)) == 5  # every micro batch is one bucket; the buckets interleave
    # the shards hold the synthetic samples themselves (float32: bit for bit)
    source, synthetic = loader.source, SyntheticSource(spec)
    firsts = {tuple(source.get(i)["latents"][0, 0, :3].tolist()) for i in range(len(source))}
    assert tuple(synthetic.get(0)["latents"][0, 0, :3].tolist()) in firsts
