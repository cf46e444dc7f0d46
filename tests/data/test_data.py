"""Shard format, writer/reader round trip, distributed bucketed partitioning, resume, bad input."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter

import pytest
import torch

from fluxzero.data import DataError, ShardWriter, build_dataloader, read_manifest, verify_shards
from fluxzero.data.loader import check_model_fit
from fluxzero.data.shards import FORMAT_VERSION, MANIFEST

SIZES = [(4, 4), (4, 6), (6, 4)]


def _sample(i):
    g = torch.Generator().manual_seed(i)
    h, w = SIZES[i % len(SIZES)]
    return torch.randn(16, h, w, generator=g), torch.randn(5, 8, generator=g), torch.randn(3, generator=g)


@pytest.fixture()
def shard_dir(tmp_path):
    """19 samples in 3 sizes, 4 per shard -> several full and partial shards."""
    d = tmp_path / "shards"
    with ShardWriter(d, samples_per_shard=4, extra={"note": "test"}) as w:
        for i in range(19):
            lat, t5, clip = _sample(i)
            w.add(lat, t5, clip, caption=f"caption {i}", t5_len=i % 5 + 1, meta={"file": f"img{i}.png"})
    return d


def _all_batches(loader):
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def test_manifest_format(shard_dir):
    m = read_manifest(shard_dir)
    assert m["version"] == FORMAT_VERSION and m["format"] == "fluxzero-shards"
    assert m["num_samples"] == 19
    assert m["dims"] == {"latent_channels": 16, "t5_len": 5, "t5_dim": 8, "clip_dim": 3}
    assert {k: v["num_samples"] for k, v in m["buckets"].items()} == {"4x4": 7, "4x6": 6, "6x4": 6}
    assert m["cache"] == {"note": "test"}
    assert sum(r["num_samples"] for r in m["shards"]) == 19
    for r in m["shards"]:
        data = (shard_dir / r["file"]).read_bytes()
        assert len(data) == r["bytes"] and hashlib.sha256(data).hexdigest() == r["sha256"]
        assert len(r["text_lens"]) == r["num_samples"]
    assert not [p for p in shard_dir.iterdir() if p.name.startswith(".")]  # no temp files left
    verify_shards(shard_dir)


def test_round_trip_every_sample_once(shard_dir):
    loader = build_dataloader(str(shard_dir), micro_batch=1, rank=0, world_size=1, seed=0)
    assert len(loader) == 19
    seen = {}
    for b in loader:
        i = int(b["index"][0])  # position in the shards (the writer groups samples by size)
        seen[i] = b
        lat, t5, clip = _sample(int(loader.source.caption(i).split()[1]))
        assert b["latents"].dtype == torch.float32
        assert torch.equal(b["latents"][0], lat) and torch.equal(b["t5"][0], t5) and torch.equal(b["clip"][0], clip)
    assert sorted(seen) == list(range(19))
    assert sorted(int(loader.source.caption(i).split()[1]) for i in seen) == list(range(19))


def test_writer_leaves_no_manifest_on_error(tmp_path):
    d = tmp_path / "s"
    with pytest.raises(RuntimeError), ShardWriter(d, samples_per_shard=1) as w:
        w.add(*_sample(0))
        raise RuntimeError("boom")
    assert not (d / MANIFEST).exists()
    with pytest.raises(DataError, match="no manifest.json"):
        build_dataloader(str(d), micro_batch=1, rank=0, world_size=1, seed=0)
    with pytest.raises(DataError, match="already holds shards"):
        ShardWriter(d)


@pytest.mark.parametrize(
    "world_size,micro_batch,remainder", [(1, 2, "wrap"), (2, 2, "wrap"), (3, 1, "wrap"), (2, 2, "drop"), (3, 2, "drop")]
)
def test_partition_across_ranks(world_size, micro_batch, remainder):
    n = 23
    spec = "synthetic:n=23,hw=4x4+4x6+6x6,txt=3,ctx=4,vec=2"
    loaders = [
        build_dataloader(spec, micro_batch=micro_batch, rank=r, world_size=world_size, seed=3, remainder=remainder)
        for r in range(world_size)
    ]
    lengths = {len(l) for l in loaders}
    assert len(lengths) == 1  # every rank runs the same number of batches
    per_rank = [_all_batches(l) for l in loaders]
    assert all(len(b) == len(loaders[0]) for b in per_rank)
    counts = Counter()
    for step in range(len(loaders[0])):
        shapes = {per_rank[r][step]["latents"].shape for r in range(world_size)}
        assert len(shapes) == 1  # one latent size per batch and per step across ranks
        for r in range(world_size):
            b = per_rank[r][step]
            assert b["latents"].shape[0] == micro_batch
            counts.update(b["index"].tolist())
    total = len(loaders[0]) * micro_batch * world_size
    if remainder == "wrap":
        assert set(counts) == set(range(n))  # every sample at least once
        assert max(counts.values()) <= 2
        assert total - n < 3 * micro_batch * world_size  # < one global batch of padding per bucket
    else:
        assert max(counts.values()) == 1  # no sample twice
        assert n - total < 3 * micro_batch * world_size


def test_order_is_deterministic_and_changes_with_epoch_and_seed():
    spec = "synthetic:n=40,hw=4x4+4x6,txt=2,ctx=2,vec=2"

    def order(seed, epoch):
        l = build_dataloader(spec, micro_batch=2, rank=1, world_size=2, seed=seed)
        return l.rank_batches(epoch)

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)
    l = build_dataloader(spec, micro_batch=2, rank=1, world_size=2, seed=0)
    l.set_epoch(1)
    assert [b["index"].tolist() for b in l] == order(0, 1)


def test_synthetic_is_deterministic_per_index():
    spec = "synthetic:n=12,hw=4x4+4x6,txt=3,ctx=5,vec=7"
    a = {int(b["index"][0]): b for b in build_dataloader(spec, micro_batch=1, rank=0, world_size=1, seed=0)}
    b = {int(x["index"][0]): x for x in build_dataloader(spec, micro_batch=1, rank=0, world_size=1, seed=9)}
    for i in range(12):
        assert torch.equal(a[i]["latents"], b[i]["latents"]) and torch.equal(a[i]["t5"], b[i]["t5"])
        assert a[i]["latents"].shape[-2:] == ((4, 4) if i % 2 == 0 else (4, 6))
        assert a[i]["t5"].shape == (1, 3, 5) and a[i]["clip"].shape == (1, 7)
    assert not torch.equal(a[0]["latents"], a[2]["latents"])


@pytest.mark.parametrize(
    "spec,match",
    [
        ("synthetic:n=4,bogus=1", "unknown item"),
        ("synthetic:hw=32", "hw must be"),
        ("synthetic:n=x", "n must be an integer"),
        ("synthetic:n=0", "n must be >= 1"),
    ],
)
def test_synthetic_spec_errors(spec, match):
    with pytest.raises(DataError, match=match):
        build_dataloader(spec, micro_batch=1, rank=0, world_size=1, seed=0)


def test_resume_mid_epoch_and_across_epochs(shard_dir, tmp_path):
    kw = dict(micro_batch=2, rank=1, world_size=2, seed=5)
    ref = build_dataloader(str(shard_dir), **kw)
    uninterrupted = []
    for epoch in range(2):
        ref.set_epoch(epoch)
        uninterrupted += [b["index"].tolist() for b in ref]

    run = build_dataloader(str(shard_dir), **kw)
    got = []
    it = iter(run)
    for _ in range(3):
        got.append(next(it)["index"].tolist())
    sd = run.state_dict()
    assert (sd["epoch"], sd["batches_done"]) == (0, 3)
    resumed = build_dataloader(str(shard_dir), **kw)
    resumed.load_state_dict(json.loads(json.dumps(sd)))  # survives a JSON round trip
    for epoch in range(2):
        resumed.set_epoch(epoch)  # keeps the position for the current epoch
        got += [b["index"].tolist() for b in resumed]
    assert got == uninterrupted
    assert (resumed.state_dict()["epoch"], resumed.state_dict()["batches_done"]) == (2, 0)
    # the position belongs to one epoch plan: another micro batch or seed is refused, not silently misread
    for change in ({"micro_batch": kw["micro_batch"] + 1}, {"seed": kw["seed"] + 1}):
        other = build_dataloader(str(shard_dir), **{**kw, **change})
        key = next(iter(change))
        with pytest.raises(DataError, match=f"saved with {key}={kw[key]} but this run uses {key}={change[key]}"):
            other.load_state_dict(sd)

    # the samples themselves: the same shards moved elsewhere resume; other samples are refused, or with
    # allow_data_change start the saved epoch from its beginning
    moved = tmp_path / "moved"
    shutil.copytree(shard_dir, moved)
    build_dataloader(str(moved), **kw).load_state_dict(sd)
    spec = "synthetic:n=16,hw=16x16,txt=8,ctx=64,vec=32"
    other = build_dataloader(spec.replace("n=16", "n=12"), **kw)
    with pytest.raises(DataError, match="the training data changed since the checkpoint"):
        other.load_state_dict(sd)
    other.load_state_dict(sd, allow_data_change=True)
    assert (other.epoch, other.batches_done) == (0, 0)
    assert (
        build_dataloader(spec, **kw).state_dict()["data"]
        == build_dataloader(spec.replace("hw=16x16,", "") + ",hw=16x16", **kw).state_dict()["data"]
    )


def test_workers_match_in_process(shard_dir):
    kw = dict(micro_batch=2, rank=0, world_size=2, seed=1)
    a = _all_batches(build_dataloader(str(shard_dir), **kw))
    loader = build_dataloader(str(shard_dir), num_workers=2, pin_memory=True, **kw)
    b = _all_batches(loader)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert all(torch.equal(x[k], y[k]) for k in x)
    # second epoch through the persistent workers, resumed mid-way
    loader.load_state_dict({"epoch": 1, "batches_done": 2})
    ref = build_dataloader(str(shard_dir), **kw)
    ref.set_epoch(1)
    assert [t["index"].tolist() for t in loader] == [t["index"].tolist() for t in ref][2:]


def test_threads_started_after_the_first_batch_get_the_loaders_thread_count():
    """A pin-memory thread's torch.set_num_threads(1) (DataLoader does it when its thread starts) sets the count
    that threads started later take, autograd's CUDA device thread among them: compiled blocks recomputed there
    compiled a second time. After the first batch the loader hands new threads this thread's count again."""
    import threading

    def new_thread_count() -> int:
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        return seen[0]

    before = torch.get_num_threads()
    loader = build_dataloader("synthetic:n=4,hw=4x4,txt=3,ctx=64,vec=32", micro_batch=1, rank=0, world_size=1, seed=0)
    try:
        torch.set_num_threads(2 if before == 1 else before)
        main = torch.get_num_threads()
        pin = threading.Thread(target=torch.set_num_threads, args=(1,))  # what the pin-memory thread does
        pin.start()
        pin.join()
        assert new_thread_count() == 1  # the leak this guards against
        next(iter(loader))
        assert torch.get_num_threads() == main
        assert new_thread_count() == main
    finally:
        torch.set_num_threads(before)


def test_model_fit(shard_dir):
    from fluxzero.config import get_model_config

    loader = build_dataloader("synthetic:n=4,hw=4x4,txt=3,ctx=64,vec=32", micro_batch=1, rank=0, world_size=1, seed=0)
    loader.check_model(get_model_config("flux-tiny"))
    with pytest.raises(DataError, match="context_in_dim"):
        loader.check_model(get_model_config("flux-dev"))
    with pytest.raises(DataError, match="odd"):
        check_model_fit({**loader.dims, "latent_sizes": [(5, 4)]}, get_model_config("flux-tiny"))


# ------------------------------------------------------------------------------------------- bad input
def _open(path):
    return build_dataloader(str(path), micro_batch=1, rank=0, world_size=1, seed=0)


def test_missing_and_empty_dir(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        _open(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is empty"):
        _open(tmp_path / "empty")
    with pytest.raises(DataError, match="source is empty"):
        build_dataloader("", micro_batch=1, rank=0, world_size=1, seed=0)


def test_manifest_version_mismatch(shard_dir):
    m = json.loads((shard_dir / MANIFEST).read_text())
    m["version"] = FORMAT_VERSION + 1
    (shard_dir / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DataError, match=f"format version {FORMAT_VERSION + 1}") as e:
        _open(shard_dir)
    assert "\n" not in str(e.value)


def test_truncated_shard_detected_at_open(shard_dir):
    p = sorted(shard_dir.glob("shard-*.safetensors"))[1]
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(DataError, match=p.name + ".*truncated"):
        _open(shard_dir)


def test_corrupt_header_detected_at_open(shard_dir):
    p = sorted(shard_dir.glob("shard-*.safetensors"))[0]
    data = bytearray(p.read_bytes())
    data[8:20] = b"garbage!!!!!"
    p.write_bytes(bytes(data))
    with pytest.raises(DataError, match=p.name + ".*corrupt"):
        _open(shard_dir)


def test_corrupt_bytes_caught_by_checksum(shard_dir):
    p = sorted(shard_dir.glob("shard-*.safetensors"))[0]
    data = bytearray(p.read_bytes())
    data[-3] ^= 0xFF
    p.write_bytes(bytes(data))
    _open(shard_dir)  # same size, valid header: the cheap check passes
    with pytest.raises(DataError, match=p.name + ".*sha256"):
        verify_shards(shard_dir)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_read_failure_during_training_names_the_shard(shard_dir, num_workers):
    loader = build_dataloader(str(shard_dir), micro_batch=1, rank=0, world_size=1, seed=0, num_workers=num_workers)
    for p in shard_dir.glob("shard-*.safetensors"):
        p.unlink()  # vanish after the open-time check
    with pytest.raises(DataError, match=r"shard .*shard-\d+\.safetensors could not be read") as e:
        list(loader)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)


def test_bounded_open_shards(shard_dir, monkeypatch):
    import fluxzero.data.shards as shards

    monkeypatch.setattr(shards, "MAX_OPEN_SHARDS", 2)
    loader = build_dataloader(str(shard_dir), micro_batch=1, rank=0, world_size=1, seed=0)
    ref = {
        int(b["index"][0]): b["latents"]
        for b in build_dataloader(str(shard_dir), micro_batch=1, rank=0, world_size=1, seed=0)
    }
    for b in loader:
        assert len(loader.source._handles) <= 2
        assert torch.equal(b["latents"], ref[int(b["index"][0])])


def test_bucket_smaller_than_global_batch():
    spec = "synthetic:n=5,hw=4x4+4x6,txt=2,ctx=2,vec=2"  # buckets of 3 and 2 samples, global batch 8
    loaders = [build_dataloader(spec, micro_batch=4, rank=r, world_size=2, seed=0) for r in range(2)]
    assert [len(l) for l in loaders] == [2, 2]
    seen = Counter(i for l in loaders for b in l for i in b["index"].tolist())
    assert set(seen) == set(range(5)) and sum(seen.values()) == 16  # cycled through each bucket
    with pytest.raises(DataError, match="remainder='drop' leaves no batch"):
        build_dataloader(spec, micro_batch=4, rank=0, world_size=2, seed=0, remainder="drop")


def test_spawned_workers_as_the_trainer_uses_them(shard_dir):
    """The trainer starts workers with spawn (fork can hang once DeepSpeed runs): the source must pickle."""
    kw = dict(micro_batch=2, rank=1, world_size=2, seed=4)
    ref = _all_batches(build_dataloader(str(shard_dir), **kw))
    got = _all_batches(build_dataloader(str(shard_dir), num_workers=1, multiprocessing_context="spawn", **kw))
    assert len(ref) == len(got)
    for x, y in zip(ref, got):
        assert all(torch.equal(x[k], y[k]) for k in x)
