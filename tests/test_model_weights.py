"""Weights on disk: every layout round-trips bit-exactly, is detected, loads lazily and fails clearly."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from fluxzero.config import get_model_config
from fluxzero.model import build_model
from fluxzero.model import weights as W
from test_model import make_inputs


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
    assert W.detect_layout(path) == layout
    assert_same(W.load_weights(path), sd)
    assert_same(W.load_weights(path, cfg=model.config), sd)


def test_diffusers_sharded_folder_and_pipeline_root(tmp_path, model):
    sd = model.state_dict()
    root = tmp_path / "pipe"
    W.save_weights(sd, root / "transformer", layout="diffusers", max_shard_bytes=200_000)
    files = sorted(p.name for p in (root / "transformer").iterdir())
    shards = [f for f in files if f.startswith("diffusion_pytorch_model-")]
    assert len(shards) >= 2 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    assert W.DIFFUSERS_INDEX in files and "config.json" in files
    for path in (root, root / "transformer"):
        assert W.detect_layout(path) == "diffusers"
        assert_same(W.load_weights(path), sd)


def test_diffusers_folder_loads_in_diffusers(tmp_path, model):
    diffusers = pytest.importorskip("diffusers")
    W.save_weights(model.state_dict(), tmp_path / "t", layout="diffusers", max_shard_bytes=300_000)
    theirs = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "t").eval()
    x = make_inputs(model.config, batch=2, h=3, w=2, txt_len=4)
    with torch.no_grad():
        a = model(**x)
        b = theirs(hidden_states=x["img"], encoder_hidden_states=x["txt"], pooled_projections=x["y"],
                   timestep=x["timesteps"], img_ids=x["img_ids"][0], txt_ids=x["txt_ids"][0], guidance=x["guidance"],
                   return_dict=False)[0]
    assert ((a - b).norm() / b.norm()) <= 1e-5


def test_dtype_subset_iterator_and_assign_load(tmp_path, model):
    path = tmp_path / "w"
    W.save_weights(model.state_dict(), path, layout="diffusers", max_shard_bytes=100_000)
    keys = ["double_blocks.1.img_attn.qkv.weight", "single_blocks.0.linear1.bias", "final_layer.adaLN_modulation.1.weight"]
    part = W.load_weights(path, dtype=torch.bfloat16, keys=keys)
    assert sorted(part) == sorted(keys)
    for k in keys:
        assert part[k].dtype == torch.bfloat16 and torch.equal(part[k], model.state_dict()[k].bfloat16())
    names = [k for k, _ in W.iter_weights(path)]
    assert names == list(model.state_dict())
    loaded = W.load_model(path, dtype=torch.bfloat16)
    assert loaded.config == model.config and next(loaded.parameters()).dtype == torch.bfloat16
    assert not any(p.is_meta for p in loaded.parameters())
    with pytest.raises(W.WeightsError, match="unexpected: nope"):
        W.load_weights(path, keys=["nope"])


def test_config_inferred_and_presets_recognised(model):
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert W.infer_config(shapes) == get_model_config("flux-tiny")
    dev = {k: tuple(v.shape) for k, v in build_model("flux-dev", device="meta").state_dict().items()}
    assert W.infer_config(dev).name == "flux-dev"


def test_mismatch_is_one_clear_error(tmp_path, model):
    sd = dict(model.state_dict())
    sd.pop("double_blocks.0.img_attn.qkv.weight")
    sd["double_blocks.0.extra.weight"] = torch.zeros(1)
    path = tmp_path / "bad.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    with pytest.raises(W.WeightsError) as e:
        W.load_weights(path, cfg=model.config)
    msg = str(e.value)
    assert "bfl layout" in msg and "1 missing: double_blocks.0.img_attn.qkv.weight" in msg
    assert "1 unexpected: double_blocks.0.extra.weight" in msg

    # wrong shapes: schnell-sized file against the dev-sized tiny preset (and the other way round)
    with pytest.raises(W.WeightsError, match="missing: guidance_in"):
        W.load_weights(_save(tmp_path / "s.safetensors", build_model("flux-tiny-schnell").state_dict()), cfg=model.config)
    wide = build_model(get_model_config("flux-tiny").replace(context_in_dim=32)).state_dict()
    with pytest.raises(W.WeightsError, match=r"wrong shape: txt_in.weight \(64, 32\) != \(64, 64\)"):
        W.load_weights(_save(tmp_path / "w.safetensors", wide), cfg=model.config)


def test_diffusers_missing_parts_named_in_diffusers_terms(tmp_path, model):
    W.save_weights(model.state_dict(), tmp_path / "d", layout="diffusers")
    f = tmp_path / "d" / W.DIFFUSERS_WEIGHTS
    from safetensors.torch import load_file

    sd = load_file(str(f))
    del sd["transformer_blocks.1.attn.add_k_proj.weight"]
    save_file(sd, str(f))
    with pytest.raises(W.WeightsError, match="diffusers layout.*missing: transformer_blocks.1.attn.add_k_proj.weight"):
        W.load_weights(tmp_path / "d", cfg=model.config)


def test_refuses_pickles_and_unknown_files(tmp_path):
    pt = tmp_path / "w.pt"
    torch.save({"a": torch.zeros(1)}, pt)
    with pytest.raises(W.WeightsError, match="only .safetensors"):
        W.detect_layout(pt)
    other = _save(tmp_path / "o.safetensors", {"foo.weight": torch.zeros(1)})
    with pytest.raises(W.WeightsError, match="cannot tell the layout"):
        W.detect_layout(other)
    (tmp_path / "empty").mkdir()
    with pytest.raises(W.WeightsError, match="folder holds no"):
        W.load_weights(tmp_path / "empty")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(W.WeightsError, match="not a readable safetensors"):
        W.detect_layout(junk)
    with pytest.raises(W.WeightsError, match="no such file"):
        W.detect_layout(tmp_path / "absent.safetensors")


def _save(path, sd):
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def test_index_json_is_diffusers_format(tmp_path, model):
    W.save_weights(model.state_dict(), tmp_path / "d", layout="diffusers", max_shard_bytes=150_000)
    index = json.loads((tmp_path / "d" / W.DIFFUSERS_INDEX).read_text())
    assert set(index) == {"metadata", "weight_map"} and index["metadata"]["total_size"] > 0
    assert "transformer_blocks.0.attn.to_q.weight" in index["weight_map"]


def test_diffusers_single_file_and_comfyui_all_in_one(tmp_path, model):
    sd = model.state_dict()
    W.save_weights(sd, tmp_path / "d", layout="diffusers")
    single = tmp_path / "d" / W.DIFFUSERS_WEIGHTS
    assert W.detect_layout(single) == "diffusers"
    assert_same(W.load_weights(single), sd)
    # ComfyUI all-in-one checkpoints carry the VAE and text encoders next to the transformer: ignored.
    comfy = {W.COMFY_PREFIX + k: v.contiguous() for k, v in sd.items()}
    comfy["first_stage_model.decoder.conv_in.weight"] = torch.zeros(2, 2)
    assert_same(W.load_weights(_save(tmp_path / "aio.safetensors", comfy)), sd)
    comfy[W.COMFY_PREFIX + "double_blocks.0.lora_up.weight"] = torch.zeros(2, 2)
    with pytest.raises(W.WeightsError, match="comfyui layout.*1 unexpected: double_blocks.0.lora_up.weight"):
        W.load_weights(_save(tmp_path / "aio2.safetensors", comfy), cfg=model.config)


def test_diffusers_parts_that_do_not_fuse_are_a_shape_error(tmp_path, model):
    from safetensors.torch import load_file

    W.save_weights(model.state_dict(), tmp_path / "d", layout="diffusers")
    f = tmp_path / "d" / W.DIFFUSERS_WEIGHTS
    sd = load_file(str(f))
    sd["single_transformer_blocks.0.attn.to_k.weight"] = torch.zeros(64, 32)
    save_file(sd, str(f))
    with pytest.raises(W.WeightsError, match="1 wrong shape: single_blocks.0.linear1.weight"):
        W.load_weights(tmp_path / "d", cfg=model.config)


def test_save_refuses_a_state_dict_that_does_not_match(tmp_path, model):
    sd = dict(model.state_dict())
    extra = dict(sd, **{"double_blocks.0.lora.weight": torch.zeros(2)})
    with pytest.raises(W.WeightsError, match=r"d not written: .*1 unexpected: double_blocks.0.lora.weight"):
        W.save_weights(extra, tmp_path / "d", layout="diffusers", cfg=model.config)  # was a KeyError
    with pytest.raises(W.WeightsError, match=r"s not written: .*4 unexpected: guidance_in.in_layer.bias"):
        W.save_weights(sd, tmp_path / "s", layout="diffusers", cfg=get_model_config("flux-tiny-schnell"))
    ints = dict(sd, **{"img_in.bias": sd["img_in.bias"].long()})
    with pytest.raises(W.WeightsError, match=r"1 not floating point: img_in.bias \(torch.int64\)"):
        W.save_weights(ints, tmp_path / "i.safetensors")  # was written as is
    assert not any(tmp_path.iterdir())


# Run in a fresh interpreter so pytest's own allocations cannot move the peak. clear_refs "5" resets the
# peak RSS (VmHWM) to the current RSS, so each save's growth is measured on its own.
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
for dtype in (None, torch.bfloat16):
    open("/proc/self/clear_refs", "w").write("5")
    before = rss("VmRSS:")
    W.save_weights(sd, f"{sys.argv[1]}/{dtype}", layout="diffusers", dtype=dtype, cfg=cfg,
                   max_shard_bytes=int(sys.argv[2]))
    growth[str(dtype)] = rss("VmHWM:") - before
print(json.dumps({"growth": growth, "state": sum(v.nbytes for v in sd.values())}))
"""


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc peak-RSS reset")
def test_diffusers_save_holds_at_most_one_shard(tmp_path):
    # A 257 MiB fp32 state dict saved in 48 MiB shards: as is (split parts are views, nothing is copied)
    # and to bf16 (each shard converted while it is written). Copying everything first, as save_weights
    # once did, grows RSS by the whole state dict (measured 263 and 257 MiB); streaming by 7 and 51 MiB.
    # Bound: 1.3 shards plus 16 MiB for the allocator and safetensors' header.
    shard = 48 * 2**20
    p = subprocess.run([sys.executable, "-c", _SAVE_PEAK, str(tmp_path), str(shard)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)
    assert result["state"] > 5 * shard
    for dtype, growth in result["growth"].items():
        assert growth < 1.3 * shard + 16 * 2**20, (dtype, growth / 2**20)
    assert len(list((tmp_path / "torch.bfloat16").glob("diffusion_pytorch_model-*.safetensors"))) == 3
    assert len(list((tmp_path / "None").glob("diffusion_pytorch_model-*.safetensors"))) == 6
