"""Helpers written once: the dtype names (short, torch, safetensors), the all-or-nothing file write the safetensors
writer shares with every other file, and the split of a fused linear into diffusers' parts that weights and LoRA
files share."""

import os

import pytest
import torch
from safetensors.torch import load_file

from fluxzero.config.deepspeed import view as ds_view
from fluxzero.dtypes import SAFETENSORS_CODES, TORCH_NAMES, safetensors_code, torch_dtype, torch_name
from fluxzero.fsutil import atomic_file
from fluxzero.model.layouts import split_sizes, swap_halves
from fluxzero.model.weights import save_tensors


def test_dtype_names_agree_with_torch_and_safetensors(tmp_path):
    for short, name in TORCH_NAMES.items():
        assert torch_dtype(short) is torch_dtype(name) is getattr(torch, name)
        assert torch_name(short) == name and ds_view.DSView(precision=short).dtype_name == name
        path = tmp_path / f"{short}.safetensors"
        save_tensors(path, {"x": torch.zeros(2, dtype=torch_dtype(short))})
        header = path.read_bytes()[8:200].decode(errors="ignore")
        assert f'"dtype":"{safetensors_code(short)}"' in header
    assert set(SAFETENSORS_CODES) == set(TORCH_NAMES.values())
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; use one of fp32, bf16, fp16"):
        torch_dtype("fp8")


def test_atomic_file_leaves_the_old_file_on_an_error(tmp_path):
    path = tmp_path / "w.safetensors"
    save_tensors(path, {"a": torch.ones(3)})
    os.chmod(path, 0o640)
    with pytest.raises(RuntimeError, match="half way"), atomic_file(path) as f:
        f.write(b"partial")
        raise RuntimeError("half way")
    assert torch.equal(load_file(path)["a"], torch.ones(3)) and os.listdir(tmp_path) == ["w.safetensors"]
    save_tensors(path, {"a": torch.zeros(3)})  # replaced whole, the user's mode kept
    assert torch.equal(load_file(path)["a"], torch.zeros(3)) and os.stat(path).st_mode & 0o777 == 0o640


def test_fused_linear_split_and_swapped_halves():
    assert (
        split_sizes("single_blocks.0.linear1.weight", 40, 8)
        == split_sizes("single_blocks.0.linear1", 40, 8)
        == [8, 8, 8, 16]
    )
    assert split_sizes("double_blocks.0.img_attn.qkv.weight", 24, 8) == [8, 8, 8]
    t = torch.arange(6.0)
    assert swap_halves(t).tolist() == [3.0, 4.0, 5.0, 0.0, 1.0, 2.0] and torch.equal(swap_halves(swap_halves(t)), t)
