"""Weights on disk: every layout round-trips bit-exactly, is detected, loads lazily and fails clearly."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from fluxzero.config import get_model_config
from fluxzero.model import build_model, layouts
from fluxzero.model import weights as W
from tests.model.test_model import make_inputs


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model("flux-tiny")
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return m


def assert_same(a, b):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["bfl", "comfyui", "diffusers"])
def test_round_trip_bit_exact(tmp_path, model, layout, dtype):
    sd = {k: v.to(dtype) for k, v in model.state_dict().items()}
    path = tmp_path / ("out" if layout == "diffusers" else "out.safetensors")
    W.save_weights(sd, path, layout=layout)
    assert W._raw_files(path)[0] == layout
    assert_same(W.load_weights(path), sd)
    assert_same(W.load_weights(path, cfg=model.config), sd)


def test_diffusers_sharded_folder_and_pipeline_root(tmp_path, model):
    sd = model.state_dict()
    root = tmp_path / "pipe"
    W.save_weights(sd, root / "transformer", layout="diffusers", max_shard_bytes=200_000)
    files = sorted(p.name for p in (root / "transformer").iterdir())
    shards = [f for f in files if f.startswith("diffusion_pytorch_model-")]
    assert len(shards) >= 2 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    assert layouts.DIFFUSERS_INDEX in files and "config.json" in files
    for path in (root, root / "transformer"):
        assert W._raw_files(path)[0] == "diffusers"
        assert_same(W.load_weights(path), sd)


def test_diffusers_folder_loads_in_diffusers(tmp_path, model):
    diffusers = pytest.importorskip("diffusers")
    W.save_weights(model.state_dict(), tmp_path / "t", layout="diffusers", max_shard_bytes=300_000)
    theirs = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "t").eval()
    x = make_inputs(model.config, batch=2, h=3, w=2, txt_len=4)
    with torch.no_grad():
        a = model(**x)
        b = theirs(
            hidden_states=x["img"],
            encoder_hidden_states=x["txt"],
            pooled_projections=x["y"],
            timestep=x["timesteps"],
            img_ids=x["img_ids"][0],
            txt_ids=x["txt_ids"][0],
            guidance=x["guidance"],
            return_dict=False,
        )[0]
    assert ((a - b).norm() / b.norm()) <= 1e-5


def test_dtype_subset_iterator_and_assign_load(tmp_path, model):
    path = tmp_path / "w"
    W.save_weights(model.state_dict(), path, layout="diffusers", max_shard_bytes=100_000)
    keys = [
        "double_blocks.1.img_attn.qkv.weight",
        "single_blocks.0.linear1.bias",
        "final_layer.adaLN_modulation.1.weight",
    ]
    part = W.load_weights(path, dtype=torch.bfloat16, keys=keys)
    assert sorted(part) == sorted(keys)
    for k in keys:
        assert part[k].dtype == torch.bfloat16 and torch.equal(part[k], model.state_dict()[k].bfloat16())
    names = [k for k, _ in W.iter_weights(path)]
    assert names == list(model.state_dict())
    loaded = W.load_model(path, dtype=torch.bfloat16)
    assert loaded.config == model.config and next(loaded.parameters()).dtype == torch.bfloat16
    assert not any(p.is_meta for p in loaded.parameters())
    with pytest.raises(layouts.WeightsError, match="unexpected: nope"):
        W.load_weights(path, keys=["nope"])


def test_config_inferred_and_presets_recognised(model):
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert layouts.infer_config(shapes) == get_model_config("flux-tiny")
    dev = {k: tuple(v.shape) for k, v in build_model("flux-dev", device="meta").state_dict().items()}
    assert layouts.infer_config(dev).name == "flux-dev"


def test_mismatch_is_one_clear_error(tmp_path, model):
    sd = dict(model.state_dict())
    sd.pop("double_blocks.0.img_attn.qkv.weight")
    sd["double_blocks.0.extra.weight"] = torch.zeros(1)
    path = tmp_path / "bad.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    with pytest.raises(layouts.WeightsError) as e:
        W.load_weights(path, cfg=model.config)
    msg = str(e.value)
    assert "bfl layout" in msg and "1 missing: double_blocks.0.img_attn.qkv.weight" in msg
    assert "1 unexpected: double_blocks.0.extra.weight" in msg

    # wrong shapes: schnell-sized file against the dev-sized tiny preset (and the other way round)
    with pytest.raises(layouts.WeightsError, match="missing: guidance_in"):
        W.load_weights(
            _save(tmp_path / "s.safetensors", build_model("flux-tiny-schnell").state_dict()), cfg=model.config
        )
    wide = build_model(get_model_config("flux-tiny").replace(context_in_dim=32)).state_dict()
    with pytest.raises(layouts.WeightsError, match=r"wrong shape: txt_in.weight \(64, 32\) != \(64, 64\)"):
        W.load_weights(_save(tmp_path / "w.safetensors", wide), cfg=model.config)


def test_diffusers_missing_parts_named_in_diffusers_terms(tmp_path, model):
    W.save_weights(model.state_dict(), tmp_path / "d", layout="diffusers")
    f = tmp_path / "d" / layouts.DIFFUSERS_WEIGHTS
    from safetensors.torch import load_file

    sd = load_file(str(f))
    del sd["transformer_blocks.1.attn.add_k_proj.weight"]
    save_file(sd, str(f))
    with pytest.raises(
        layouts.WeightsError, match="diffusers layout.*missing: transformer_blocks.1.attn.add_k_proj.weight"
    ):
        W.load_weights(tmp_path / "d", cfg=model.config)


def test_refuses_pickles_and_unknown_files(tmp_path):
    pt = tmp_path / "w.pt"
    torch.save({"a": torch.zeros(1)}, pt)
    with pytest.raises(layouts.WeightsError, match="only .safetensors"):
        W._raw_files(pt)
    other = _save(tmp_path / "o.safetensors", {"foo.weight": torch.zeros(1)})
    with pytest.raises(layouts.WeightsError, match="cannot tell the layout"):
        W._raw_files(other)
    (tmp_path / "empty").mkdir()
    with pytest.raises(layouts.WeightsError, match="folder holds no"):
        W.load_weights(tmp_path / "empty")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(layouts.WeightsError, match="not a readable safetensors"):
        W._raw_files(junk)
    with pytest.raises(layouts.WeightsError, match="no such file"):
        W._raw_files(tmp_path / "absent.safetensors")


def _save(path, sd):
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def test_index_json_is_diffusers_format(tmp_path, model):
    W.save_weights(model.state_dict(), tmp_path / "d", layout="diffusers", max_shard_bytes=150_000)
    index = json.loads((tmp_path / "d" / layouts.DIFFUSERS_INDEX).read_text())
    assert set(index) == {"metadata", "weight_map"} and index["metadata"]["total_size"] > 0
    assert "transformer_blocks.0.attn.to_q.weight" in index["weight_map"]


def test_diffusers_single_file_and_comfyui_all_in_one(tmp_path, model):
    sd = model.state_dict()
    W.save_weights(sd, tmp_path / "d", layout="diffusers")
    single = tmp_path / "d" / layouts.DIFFUSERS_WEIGHTS
    assert W._raw_files(single)[0] == "diffusers"
    assert_same(W.load_weights(single), sd)
    # ComfyUI all-in-one checkpoints carry the VAE and text encoders next to the transformer: ignored.
    comfy = {layouts.COMFY_PREFIX + k: v.contiguous() for k, v in sd.items()}
    comfy["first_stage_model.decoder.conv_in.weight"] = torch.zeros(2, 2)
    assert_same(W.load_weights(_save(tmp_path / "aio.safetensors", comfy)), sd)
    comfy[layouts.COMFY_PREFIX + "double_blocks.0.lora_up.weight"] = torch.zeros(2, 2)
    with pytest.raises(layouts.WeightsError, match="comfyui layout.*1 unexpected: double_blocks.0.lora_up.weight"):
        W.load_weights(_save(tmp_path / "aio2.safetensors", comfy), cfg=model.config)


def test_diffusers_parts_that_do_not_fuse_are_a_shape_error(tmp_path, model):
    from safetensors.torch import load_file

    W.save_weights(model.state_dict(), tmp_path / "d", layout="diffusers")
    f = tmp_path / "d" / layouts.DIFFUSERS_WEIGHTS
    sd = load_file(str(f))
    sd["single_transformer_blocks.0.attn.to_k.weight"] = torch.zeros(64, 32)
    save_file(sd, str(f))
    with pytest.raises(layouts.WeightsError, match="1 wrong shape: single_blocks.0.linear1.weight"):
        W.load_weights(tmp_path / "d", cfg=model.config)


def test_save_refuses_a_state_dict_that_does_not_match(tmp_path, model):
    sd = dict(model.state_dict())
    extra = dict(sd, **{"double_blocks.0.lora.weight": torch.zeros(2)})
    with pytest.raises(layouts.WeightsError, match=r"d not written: .*1 unexpected: double_blocks.0.lora.weight"):
        W.save_weights(extra, tmp_path / "d", layout="diffusers", cfg=model.config)  # was a KeyError
    with pytest.raises(layouts.WeightsError, match=r"s not written: .*4 unexpected: guidance_in.in_layer.bias"):
        W.save_weights(sd, tmp_path / "s", layout="diffusers", cfg=get_model_config("flux-tiny-schnell"))
    ints = dict(sd, **{"img_in.bias": sd["img_in.bias"].long()})
    with pytest.raises(layouts.WeightsError, match=r"1 not floating point: img_in.bias \(torch.int64\)"):
        W.save_weights(ints, tmp_path / "i.safetensors")  # was written as is
    assert not any(tmp_path.iterdir())


# Run in a fresh interpreter so pytest's own allocations cannot move the peak. clear_refs "5" resets the
# peak RSS (VmHWM) to the current RSS, so each save's growth is measured on its own. One interpreter runs
# every case (argv: JSON list of [name, layout, dtype or null, max_shard_bytes]) to keep the tests fast.
_SAVE_PEAK = r"""
import json, sys
import numpy, safetensors.torch  # the first save would import these: their memory is not the save's
import torch
from fluxzero.config import MODEL_PRESETS
from fluxzero.model import build_model
from fluxzero.model import weights as W

def rss(field):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))

cfg = MODEL_PRESETS["flux-dev"].replace(name="wide", hidden_size=768, num_heads=6, depth=2, depth_single_blocks=2)
sd = {k: torch.ones(v.shape) for k, v in build_model(cfg, device="meta").state_dict().items()}  # 257 MiB
growth = {}
for name, layout, dtype, shard in json.loads(sys.argv[2]):
    open("/proc/self/clear_refs", "w").write("5")
    before = rss("VmRSS:")
    W.save_weights(sd, f"{sys.argv[1]}/{name}", layout=layout, dtype=dtype and getattr(torch, dtype), cfg=cfg,
                   max_shard_bytes=shard)
    growth[name] = rss("VmHWM:") - before
print(json.dumps({"growth": growth, "state": sum(v.nbytes for v in sd.values())}))
"""
_SHARD = 48 * 2**20


@pytest.fixture(scope="module")
def save_peaks(tmp_path_factory):
    """(output folder, {"growth": {case: bytes}, "state": bytes}) of the cases below, in this order."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux /proc peak-RSS reset")
    out = tmp_path_factory.mktemp("peaks")
    cases = [
        ["bfl.safetensors", "bfl", "bfloat16", 2**40],  # first: the fresh heap is the worst case
        ["diffusers-fp32", "diffusers", None, _SHARD],
        ["diffusers-bf16", "diffusers", "bfloat16", _SHARD],
    ]
    p = subprocess.run(
        [sys.executable, "-c", _SAVE_PEAK, str(out), json.dumps(cases)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    return out, json.loads(p.stdout)


def test_diffusers_save_holds_at_most_one_shard(save_peaks):
    # A 257 MiB fp32 state dict saved in 48 MiB shards: as is (split parts are views, nothing is copied)
    # and to bf16 (each tensor converted while it is written). Copying everything first, as save_weights
    # once did, grows RSS by the whole state dict (measured 263 and 257 MiB); a shard at a time by 7 and
    # 51 MiB; a tensor at a time by 0 and 0 MiB. Bound: 1.3 shards plus 16 MiB for the allocator.
    out, result = save_peaks
    assert result["state"] > 5 * _SHARD
    for case in ("diffusers-fp32", "diffusers-bf16"):
        assert result["growth"][case] < 1.3 * _SHARD + 16 * 2**20, (case, result["growth"][case] / 2**20)
    assert len(list((out / "diffusers-bf16").glob("diffusion_pytorch_model-*.safetensors"))) == 3
    assert len(list((out / "diffusers-fp32").glob("diffusion_pytorch_model-*.safetensors"))) == 6


def test_single_file_bf16_save_holds_about_one_tensor(save_peaks):
    # The 257 MiB fp32 state dict as one bf16 BFL file (the trainer's export): converting the whole file
    # before writing it grew RSS by 129.6 MiB, the file's size; converting and writing one tensor at a time
    # by 13-16 MiB (the largest bf16 tensor, single_blocks linear1, is 7.9 MiB). Bound: 0.3 file + 16 MiB.
    out, result = save_peaks
    size = (out / "bfl.safetensors").stat().st_size
    assert 2 * size > result["state"] > size
    assert result["growth"]["bfl.safetensors"] < 0.3 * size + 16 * 2**20, result["growth"]["bfl.safetensors"] / 2**20


# Every dtype safetensors and torch share, in shapes that stress the header: 0-dim, empty, odd byte counts.
_WRITER_CASES = {
    "f64": torch.randn(3, dtype=torch.float64),
    "f32": torch.randn(4, 5),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 3),
    "f16": torch.randn(7, dtype=torch.float16),
    "bf16": torch.randn(2, 3).bfloat16(),
    "bf16.scalar": torch.tensor(1.0, dtype=torch.bfloat16),
    "bf16.empty": torch.zeros(0, dtype=torch.bfloat16),
    "e4m3": torch.randn(5).to(torch.float8_e4m3fn),
    "e5m2": torch.randn(3).to(torch.float8_e5m2),
    "i64": torch.arange(3),
    "i32": torch.arange(3, dtype=torch.int32),
    "i16": torch.arange(-2, 3, dtype=torch.int16),
    "i8": torch.arange(-3, 2, dtype=torch.int8),
    "u8": torch.arange(5, dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "transposed": torch.randn(3, 2).t(),
    "u16": torch.arange(3).to(torch.uint16),
    "e4m3fnuz": torch.randn(2).to(torch.float8_e4m3fnuz),
}


def test_safetensors_writer_is_byte_identical_to_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    outs = [W._Out.of(k, v, "copy", None, None) for k, v in _WRITER_CASES.items()]
    W._write_safetensors(tmp_path / "ours.safetensors", outs, {"format": "pt"})
    save_file(
        {k: v.contiguous() for k, v in _WRITER_CASES.items()}, str(tmp_path / "theirs.safetensors"), {"format": "pt"}
    )
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes()
    loaded = load_file(str(tmp_path / "ours.safetensors"))
    assert list(loaded) != list(_WRITER_CASES) and set(loaded) == set(_WRITER_CASES)  # safetensors' own order
    for k, v in _WRITER_CASES.items():  # compared as bytes: float8 has no torch.equal on the CPU
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape, k
        assert torch.equal(loaded[k].reshape(-1).view(torch.uint8), v.contiguous().reshape(-1).view(torch.uint8)), k
    with safe_open(str(tmp_path / "ours.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    n = int.from_bytes(ours[:8], "little")
    header = json.loads(ours[8 : 8 + n])
    assert (8 + n) % 8 == 0 and ours[8 : 8 + n].rstrip(b" ").endswith(b"}")  # space-padded to align the data
    begin, end = header["bf16.scalar"]["data_offsets"]
    assert ours[8 + n + begin : 8 + n + end] == b"\x80\x3f"  # bf16 1.0 is 0x3F80, stored little-endian
    with pytest.raises(layouts.WeightsError, match=r"c.safetensors not written: tensors of dtype torch.complex64"):
        W._write_safetensors(
            tmp_path / "c.safetensors", [W._Out.of("c", torch.zeros(1, dtype=torch.cfloat), "copy", None, None)], {}
        )


def test_converting_save_is_byte_identical_to_converting_first(tmp_path, model):
    # What the trainer's export does (fp32 master weights to bf16), against safetensors given the converted
    # tensors; the diffusers file covers split (views) and swapped parts converted one at a time.
    sd = model.state_dict()
    W.save_weights(sd, tmp_path / "ours.safetensors", dtype=torch.bfloat16)
    save_file({k: v.bfloat16() for k, v in sd.items()}, str(tmp_path / "theirs.safetensors"), {"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    W.save_weights(sd, tmp_path / "d", layout="diffusers", dtype=torch.bfloat16)
    converted = {k: v.bfloat16().contiguous() for k, v in layouts.bfl_to_diffusers(sd).items()}
    save_file(converted, str(tmp_path / "theirs-d.safetensors"), {"format": "pt"})
    assert (tmp_path / "d" / layouts.DIFFUSERS_WEIGHTS).read_bytes() == (tmp_path / "theirs-d.safetensors").read_bytes()


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_saved_files_follow_the_umask_and_appear_whole(tmp_path, model, umask_027):
    # safetensors' save_file creates 0600 files: exports other users could not read.
    sd = model.state_dict()
    target = tmp_path / "w.safetensors"
    W.save_weights(sd, target)
    W.save_weights(sd, tmp_path / "d", layout="diffusers", max_shard_bytes=200_000)
    files = [target, *(tmp_path / "d").glob("*.safetensors")]
    assert len(files) > 2 and {oct(f.stat().st_mode & 0o777) for f in files} == {oct(0o640)}
    target.chmod(0o644)  # a user's chmod: a file written over it (export --overwrite) keeps it
    W.save_weights(sd, target)
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)
    # A save that fails part way leaves the previous file as it was and no temp file behind.
    before = target.read_bytes()
    boom = W._Out("x", torch.float32, (1,), lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        W._write_safetensors(target, [W._Out.of("a", torch.ones(2), "copy", None, None), boom], {})
    assert target.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["d", "w.safetensors"]
