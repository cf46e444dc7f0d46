"""The step's data phase ahead of the step: the prefetch thread gives the same batches, positions and errors."""

import time

import pytest
import torch

from fluxzero.config import FlowConfig
from fluxzero.data import DataError, build_dataloader
from fluxzero.train.step import Prefetcher, Prepared, TrainStep, batches


def _step(loader, prefetch):
    """A TrainStep used for its data phase only (no engine: _next_batch is what the step calls first)."""
    step = TrainStep.__new__(TrainStep)
    step.source, step.flow_cfg, step.seed, step.guidance_embed = batches(loader), FlowConfig(), 3, True
    step.device, step.dtype = torch.device("cpu"), torch.bfloat16
    step._position_fn = lambda: {"epoch": loader.epoch, "batches_done": loader.batches_done}
    step.prefetch, step.position, step._prepared = prefetch, None, None
    return step


def _loader():
    return build_dataloader("synthetic:n=10,hw=8x8+8x12", micro_batch=2, rank=0, world_size=1, seed=1)


def test_prefetched_batches_and_positions_equal_the_inline_ones():
    loader = _loader()
    inline, ahead = _step(_loader(), 0), _step(loader, 2)
    for _ in range(8):  # 5 batches an epoch: crosses an epoch boundary
        a, b = inline._next_batch(), ahead._next_batch()
        assert b.position == a.position == inline.position == ahead.position
        assert torch.equal(a.index, b.index)
        for k in a.inputs:
            assert (a.inputs[k] is None and b.inputs[k] is None) or torch.equal(a.inputs[k], b.inputs[k]), k
        assert torch.equal(a.target, b.target)
    # the thread has read ahead of what was consumed: the loader itself is past the recorded position
    deadline = time.monotonic() + 10
    while not ahead._prepared._queue.full() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (loader.epoch, loader.batches_done) != (ahead.position["epoch"], ahead.position["batches_done"])
    ahead.close()


def test_an_error_in_the_thread_is_raised_by_the_batch_that_had_it():
    def make():
        for i in range(3):
            yield Prepared({"img": torch.zeros(1)}, torch.zeros(1), torch.tensor([i]), {"i": i})
        raise DataError("shard-00001 could not be read")

    it = Prefetcher(make, depth=2, device=torch.device("cpu"))
    assert [next(it).position["i"] for _ in range(3)] == [0, 1, 2]
    with pytest.raises(DataError, match="shard-00001 could not be read"):
        next(it)


def test_close_ends_the_thread():
    def make():
        while True:
            yield Prepared({"img": torch.zeros(1)}, torch.zeros(1), torch.tensor([0]), None)

    it = Prefetcher(make, depth=1, device=torch.device("cpu"))
    next(it)
    it.close()
    it._thread.join(timeout=5)
    assert not it._thread.is_alive()
