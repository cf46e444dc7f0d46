"""Compiled blocks on several aspect buckets: one graph per block class for every image token count when the
token axis is dynamic, one per token count when it is static, and the same losses and gradients as the eager
model on each bucket.

Dynamo with the `aot_eager` backend (capture, AOTAutograd's joint graph, no Inductor code generation): the
graph count and the wiring are Dynamo's; Inductor's dynamic-shape kernels are run by benchmarks/bucketed_speed.py.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from fluxzero.config import get_model_config
from fluxzero.model.compile import CACHE_ENV, apply_compile, compile_cache_dir
from fluxzero.model.flux import build_model
from fluxzero.model.packing import img_ids, pack, txt_ids

# latent (h, w) of three buckets: 16, 15 and 12 image tokens after 2x2 packing
BUCKETS = [(8, 8), (6, 10), (4, 12)]


def _step(model, h: int, w: int) -> tuple[float, list]:
    g = torch.Generator().manual_seed(h * 100 + w)
    out = model(
        pack(torch.randn(2, 16, h, w, generator=g)),
        img_ids(2, h, w),
        torch.randn(2, 4, 64, generator=g),
        txt_ids(2, 4),
        torch.rand(2, generator=g),
        torch.randn(2, 32, generator=g),
        torch.ones(2),
    )
    loss = out.pow(2).mean()
    grads = torch.autograd.grad(loss, [p for p in model.parameters()])
    return loss.item(), [x.norm().item() for x in grads]


def _compiled(dynamic: bool | None):
    """(eager flux-tiny, its compiled copy, Dynamo's counters cleared)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = build_model(get_model_config("flux-tiny"))
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, backend="aot_eager", dynamic_tokens=dynamic, token_counts=len(BUCKETS))
    return eager, compiled, counters


def test_dynamic_token_axis_compiles_each_block_class_once_for_every_bucket():
    eager, compiled, counters = _compiled(dynamic=True)
    want = [_step(eager, h, w) for h, w in BUCKETS]
    got = [_step(compiled, h, w) for h, w in BUCKETS]
    assert counters["stats"]["unique_graphs"] == 2  # the double and the single block class, whatever the bucket
    for (loss, grads), (loss_c, grads_c) in zip(want, got):
        # the same fp32 aten ops: equal up to float reassociation in the joint graph
        assert loss_c == pytest.approx(loss, rel=1e-6)
        assert grads_c == pytest.approx(grads, rel=1e-5)


def test_static_token_axis_compiles_a_graph_per_bucket_and_trains_like_eager():
    # the count above can fail: with the sizes fixed each token count gets graphs of its own
    eager, compiled, counters = _compiled(dynamic=False)
    for h, w in BUCKETS[:2]:
        (loss, grads), (loss_c, grads_c) = _step(eager, h, w), _step(compiled, h, w)
        assert loss_c == pytest.approx(loss, rel=1e-6) and grads_c == pytest.approx(grads, rel=1e-5)
    assert counters["stats"]["unique_graphs"] == 4


def test_compile_cache_dir_keeps_the_users_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert compile_cache_dir() == str(tmp_path / "mine")
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache_dir() == str(tmp_path / "xdg" / "fluxzero" / "inductor")
    assert (tmp_path / "xdg" / "fluxzero" / "inductor").is_dir()
    monkeypatch.delenv(CACHE_ENV)
    (tmp_path / "file").write_text("")  # a cache home that cannot hold folders: torch's own default stays
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    assert compile_cache_dir() is None and CACHE_ENV not in os.environ
