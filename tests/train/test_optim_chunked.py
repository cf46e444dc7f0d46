"""The eager bf16 optimizers step a flat tensor (a ZeRO 1-3 partition) a chunk at a time: same result, bounded
temporaries. Plain torch on CPU; the DeepSpeed runs of the modes are tests/train/test_optim_deepspeed.py."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fluxzero.config.optim_modes import MODES, STEP_CHUNK
from fluxzero.train.optim.optimizers import AdafactorSR, KahanAdamW, _pieces, build_optimizer

BLOCK = 1 << 14  # AdafactorSR's chunks are whole blocks of its norm sums
N = 3 * BLOCK + 1234  # a partition that no chunk size divides


def _run(make, chunk, dtype, steps=3, shapes=((N,), (48, 40))):
    """Params and optimizer states after `steps` steps on fixed gradients, stepped `chunk` elements at a time."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.05).to(dtype)) for s in shapes]
    opt = make(params, chunk)
    torch.manual_seed(1)  # the stochastic rounding's noise: the same stream for every chunk size
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(dtype)
        opt.step()
    return [p.detach().clone() for p in params], opt.state_dict()["state"]


MAKERS = {
    "bf16-kahan": lambda ps, c: KahanAdamW(ps, lr=1e-3, weight_decay=0.1, step_chunk=c),
    "adafactor-sr": lambda ps, c: AdafactorSR(ps, lr=1e-2, weight_decay=0.1, step_chunk=c),
}
CHUNKS = {"bf16-kahan": (1000, BLOCK, 2 * BLOCK), "adafactor-sr": (BLOCK, 2 * BLOCK)}


# bf16: the stochastic rounding's noise must not depend on the chunking; fp32 (nothing rounded away): every
# last bit of the step, so also Adafactor's whole-tensor norms (in bf16 their last bits rarely reach a weight)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", MAKERS)
def test_chunked_step_is_bit_identical_to_the_whole_tensor_step(mode, dtype):
    whole_p, whole_s = _run(MAKERS[mode], None, dtype)
    for chunk in CHUNKS[mode]:
        ps, states = _run(MAKERS[mode], chunk, dtype)
        assert all(torch.equal(a, b) for a, b in zip(ps, whole_p)), (mode, chunk)
        for pid, st in whole_s.items():
            for k, v in st.items():
                assert torch.equal(states[pid][k], v), (mode, chunk, k)
    assert not torch.equal(whole_p[0], _run(MAKERS[mode], None, dtype, steps=0)[0][0])  # the weights did move


def test_adafactor_norms_do_not_depend_on_the_chunking():
    """Its step size takes the norms of the whole flat weight and update (fp64 sums over fixed blocks): equal to
    the last bit of a Python float (the bit-identical steps above rarely see those bits)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(N, generator=gen) * 0.05)
    p.grad = torch.randn(N, generator=gen) * 1e-3
    opt = AdafactorSR([p], lr=1e-2)
    variance = torch.rand(N, generator=gen) * 1e-6
    with torch.no_grad():
        scales = {
            c: opt._flat_scale(opt.param_groups[0], 3, p, variance, _pieces(p, c)).item()
            for c in (None, BLOCK, 2 * BLOCK)
        }
    assert len(set(scales.values())) == 1, scales


class _LargestOutput(TorchDispatchMode):
    """Bytes of the largest tensor any op makes (a view's own extent, not its base's storage)."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("mode", MAKERS)
def test_no_temporary_of_a_step_is_larger_than_a_chunk(mode):
    """The 1-D tensor stands for a ZeRO partition 16 chunks long: every tensor a step makes is one chunk's
    (at most 8 B per element: the fp64 squares of Adafactor's norms, the two SR draws of Kahan's m and v)."""
    chunk = BLOCK
    p = torch.nn.Parameter(torch.randn(16 * chunk).to(torch.bfloat16))
    opt = MAKERS[mode]([p], chunk)
    p.grad = torch.randn_like(p)
    opt.step()  # the first step allocates the states (the size of p: not temporaries)
    with _LargestOutput() as seen:
        opt.step()
    assert seen.largest <= 8 * chunk, seen.largest


def test_build_optimizer_chunks_the_eager_modes_and_the_registry_says_so():
    for mode in MAKERS:
        opt = build_optimizer([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], mode, lr=1e-3)
        assert opt.step_chunk == MODES[mode].step_chunk == STEP_CHUNK
    assert STEP_CHUNK % BLOCK == 0


def test_a_chunk_size_adafactor_cannot_use_is_one_sentence():
    with pytest.raises(ValueError, match="step_chunk must be a positive multiple of 16384"):
        AdafactorSR([torch.nn.Parameter(torch.zeros(4))], step_chunk=1000)
