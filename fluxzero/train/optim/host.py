"""HostAdamW: the optimizer of the cpu-* modes, AdamW stepped on the host on DeepSpeed's offloaded bf16 partitions.

With optimizer offload and `bf16_master_weights_and_grads` + `bf16_optimizer_states`, ZeRO 1-3 keep the master
partition and its gradient in bf16 in host memory and hand them to the client optimizer (one flat 1-D tensor per
group or ZeRO-3 sub-group). This optimizer steps them in chunks of HOST_STEP_CHUNK elements, so its fp32
temporaries stay a few hundred MB whatever the partition (FLUX.1-dev: 11.9e9 elements at one GPU). A chunk's
update is one function (_step_bf16_ / _step_8bit_) that Inductor compiles into one C++/OpenMP kernel (_fused_step:
one vectorized, parallel loop nest instead of ~40 passes of torch's ops over chunk-sized temporaries), or that runs
eagerly as torch's multi-threaded CPU ops where Inductor finds no C++ compiler, with compiled=False, or with the
environment variable FLUXZERO_HOST_OPTIM_EAGER=1 (the test suite's default). Both give bit-identical weights and
states (tests/train/test_host_optim.py). Everything compiles, the 8-bit lookups included; the 8-bit states' short
last block of a partition (< 256 values) steps eagerly.

Step times (compiled, eager, and the loop it replaced) and what was tried for the 8-bit lookups are in
benchmarks/RESULTS.md ("Figures behind code choices"). The 8-bit kernel is compiled at 128-bit vectors: its table
lookups are scalar gathers in Inductor's C++, and wider vectors only add lane loops. The first step compiles (a few
seconds from Inductor's disk cache, longer on a cold one).

Per chunk, in fp32: m and v updated as in torch's AdamW, the weight decayed and moved by the bias-corrected step,
then written back to bf16 by stochastic rounding (an AdamW step at fine-tuning lr is under half a bf16 ulp of
most weights: round-to-nearest loses it, see fluxzero.train.optim.optimizers). m and v are kept either
  "bf16"  in bf16, stochastically rounded too (v's EMA moves 0.1% a step at beta2 0.999, under half an ulp), or
  "8bit"  blockwise 8-bit with one fp32 scale per 256 values, signed / unsigned dynamic maps (torchao's AdamW8bit
          format and its create_dynamic_map, scale_tensor and dequant_with_qmap, compiled with the rest; a
          partition that is not a multiple of 256 gets a short last block). The nearest code comes from a 65536-entry
          table on the value's top 16 bits (nearest_codes, faster than torchao's eager quantizer on the CPU).
The update itself uses the unquantized fp32 m and v of this step, as torchao's does.

Libraries: torchao for the 8-bit format (above). Stochastic rounding is torchao's and fluxzero.train.optim.optimizers's bit
trick (add 16 random low bits, truncate) with the random bits from a counter-based hash of (state, step, element)
rather than from a generator, which on the CPU fills tensors serially; the noise is then a function of the
step alone, so resume is exact whatever else draws random numbers. Not DeepSpeedCPUAdam: it rounds bf16 masters to
nearest (most of a fine-tuning update is lost: tests/train/test_optim_quality.py) and needs a C++ build.

DeepSpeed 0.19.8 accepts this optimizer with offload only through fluxzero.train.ds_patches.accept_host_optimizer
(its bf16-master offload check asks for exactly DeepSpeedCPUAdam); `fp32_optimizer_states = False` answers the
other half of that check (base_optimizer._configure_master_weights). Build it with fluxzero.train.optim.optimizers.
build_optimizer, which checks torchao and, at the first step, that the tensors really are bf16 host partitions.
"""

from __future__ import annotations

import functools
import logging
import math
import os

import torch

from fluxzero.config.optim_modes import HOST_STEP_CHUNK, QUANT_BLOCK
from fluxzero.train.optim.rounding import mix32, noise_key, round_keyed
from fluxzero.train.optim.state import ExactStateMixin

log = logging.getLogger(__name__)

STATE_FORMATS = ("bf16", "8bit")
EAGER_ENV = "FLUXZERO_HOST_OPTIM_EAGER"  # "1": HostAdamW steps eagerly (the test suite: a compile is 10-30 s a process)
_SEED = 0x5EED  # the rounding noise's key is (this, the state's stream, the step, m / v / weights)


class HostAdamW(ExactStateMixin, torch.optim.Optimizer):
    """AdamW on bf16 host tensors: fp32 math chunk by chunk, stochastic rounding into the bf16 weights."""

    fp32_optimizer_states = False  # read by DeepSpeed's bf16_optimizer_states check: moments are not fp32

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        *,
        states="bf16",
        chunk=HOST_STEP_CHUNK,
        mode="cpu-bf16-sr",
        compiled: bool | None = None,
    ):
        if states not in STATE_FORMATS:
            raise ValueError(f"states must be one of {', '.join(STATE_FORMATS)}, got {states!r}")
        if chunk < QUANT_BLOCK or chunk % QUANT_BLOCK:
            raise ValueError(f"chunk must be a positive multiple of {QUANT_BLOCK}, got {chunk}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.states, self.chunk, self.mode = states, chunk, mode
        # step chunks with the compiled kernel where Inductor can build one (_fused_step); None: unless EAGER_ENV is 1
        self.compiled = os.environ.get(EAGER_ENV) != "1" if compiled is None else compiled
        self._fused_ran = False  # the compiled kernel has run once (its build succeeded)
        self._qmaps = _qmaps(mode) if states == "8bit" else None
        self._codes = {k: _code_tables(q) for k, q in self._qmaps.items()} if self._qmaps else None

    def _init_state(self, p: torch.Tensor, st: dict) -> None:
        st["step"] = torch.tensor(0.0)
        st["sr_stream"] = len(self.state)  # this state's rounding stream: the order states are made in
        if self.states == "bf16":
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
        else:
            blocks = -(-p.numel() // QUANT_BLOCK)
            for k in ("exp_avg", "exp_avg_sq"):  # scale 0: every code reads as 0.0 (as torchao's zeros)
                st[k + "_codes"] = torch.zeros(p.numel(), dtype=torch.uint8)
                st[k + "_scale"] = torch.zeros(blocks, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # torch.optim's contract: re-evaluate the loss with grad enabled
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    self._init_state(p, st)
                st["step"] += 1
                self._step_param(p, st, group, int(st["step"].item()))
        return loss

    def _step_param(self, p, st, group, t: int) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        # the step's scalars as one fp32 tensor: a compiled kernel takes them as data, so a new lr or step does not
        # recompile it (the values are what the Python floats round to in torch's fp32 kernels)
        h = torch.tensor(
            [1 - beta1, 1 - beta2, math.sqrt(1 - beta2**t), eps, 1 - lr * wd, -lr / (1 - beta1**t)], dtype=torch.float32
        )
        flat, grad = p.view(-1), p.grad.view(-1)
        draws = [mix32(_SEED, st["sr_stream"], t, what) for what in range(3)]  # m, v, weights: three draws a step
        fused = _fused_step(self.states) if self.compiled else None
        if self.states == "bf16":
            states = (st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1))
            tables = ()
        else:
            states = tuple(st[k] for k in ("exp_avg_codes", "exp_avg_scale", "exp_avg_sq_codes", "exp_avg_sq_scale"))
            tables = (self._qmaps[True], *self._codes[True], self._qmaps[False], *self._codes[False])
        for s in range(0, flat.numel(), self.chunk):
            e = min(flat.numel(), s + self.chunk)
            # the compiled kernel takes whole 256-value blocks; the 8-bit states' short last block (< 256 values,
            # at most one a partition) is stepped eagerly by the same function
            cut = e if self.states == "bf16" or fused is None else s + (e - s) // QUANT_BLOCK * QUANT_BLOCK
            for a, b, fn in ((s, cut, fused or _STEPS[self.states]), (cut, e, _STEPS[self.states])):
                if b > a:
                    keys = torch.tensor([noise_key(d, a) for d in draws], dtype=torch.int32)
                    args = (*_slices(self.states, (flat, grad, *states), a, b), h, keys, *tables)
                    if fn is fused and not self._fused_ran:
                        fused = self._first_fused_call(fused, args)
                    else:
                        fn(*args)

    def _first_fused_call(self, fused, args):
        """The compiled kernel's first call, where Inductor builds it. A build that fails (a compiler that is
        there but cannot build, missing headers) raises before the kernel touches a value: this step and the rest
        of the run then go eagerly (bit-identical results, slower), with one warning, instead of ending the run."""
        try:
            fused(*args)
            self._fused_ran = True
            return fused
        except Exception as e:  # noqa: BLE001 - any build failure: the eager function computes the same
            log.warning(
                "host_optim: the compiled host step could not be built (%s: %s); stepping eagerly, which is slower",
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "",
            )
            self.compiled = False
            _STEPS[self.states](*args)
            return None


# ---------------------------------------------------------------------------------------------------------
# one chunk's update: the same function eagerly and compiled
# ---------------------------------------------------------------------------------------------------------
def _step_bf16_(w, g, m, v, h, keys) -> None:
    """One chunk, bf16 moments, in place. Shape: w, g, m, v (n,) bf16; h (6,) fp32 = (1 - beta1, 1 - beta2,
    sqrt(1 - beta2^t), eps, 1 - lr * wd, -lr / (1 - beta1^t)); keys (3,) int32 (noise_key of m, v, weights)."""
    g32 = g.float()
    m32 = _ema(m.float(), g32, h[0])
    v32 = _ema(v.float(), g32 * g32, h[1])
    m.copy_(round_keyed(m32, keys[0]))
    v.copy_(round_keyed(v32, keys[1]))
    _move(w, m32, v32, h, keys[2])


def _step_8bit_(w, g, mc, ms, vc, vs, h, keys, qm, base_m, mid_m, qv, base_v, mid_v) -> None:
    """One chunk, 8-bit moments, in place. Shape: w, g (n,) bf16, codes mc, vc (n,) uint8, scales ms, vs
    (ceil(n / 256),) fp32, or w, g, mc, vc as (n / 256, 256) for whole blocks; qm / qv the signed / unsigned maps
    (256,) and base_*, mid_* their _code_tables (65536,); the rest as _step_bf16_. A short last block (1-D, n not a
    multiple of 256) is padded with zeros, which leave its absmax alone."""
    g32 = g.float()
    m32 = _ema(_dequant(mc, qm, ms), g32, h[0])
    v32 = _ema(_dequant(vc, qv, vs), g32 * g32, h[1])
    _quant_into(m32, mc, ms, base_m, mid_m)
    _quant_into(v32, vc, vs, base_v, mid_v)
    _move(w, m32, v32, h, keys[2])


def _ema(x, y, weight):
    """x + weight * (y - x): torch's lerp for a weight under 0.5, written out so eager and compiled round alike
    (eager lerp fuses the multiply-add on its vectorized body only; Inductor builds with -ffp-contract=off)."""
    return x + weight * (y - x)


def _move(w, m32, v32, h, key) -> None:
    """The weights decayed and moved by the bias-corrected step (torch's AdamW: w * (1 - lr wd) + addcdiv), then
    stochastically rounded back into `w`."""
    denom = v32.sqrt() / h[2] + h[3]
    w.copy_(round_keyed(w.float() * h[4] + h[5] * m32 / denom, key))


def _dequant(codes, qmap, scale):
    """torchao's dequant_with_qmap on codes of any length or (blocks, 256) (a short last block padded with code 0,
    then cut off)."""
    from torchao.optim.quant_utils import dequant_with_qmap

    n = codes.numel()
    pad = n % QUANT_BLOCK and QUANT_BLOCK - n % QUANT_BLOCK
    if pad:
        return dequant_with_qmap(torch.cat([codes, codes.new_zeros(pad)]), qmap, scale)[:n]
    return dequant_with_qmap(codes, qmap, scale)


def _quant_into(x, codes, scale, base, mid) -> None:
    """x (fp32) -> its 8-bit codes and per-block absmax scales (torchao's scale_tensor, then nearest_codes)."""
    from torchao.optim.quant_utils import scale_tensor

    n = x.numel()
    pad = n % QUANT_BLOCK and QUANT_BLOCK - n % QUANT_BLOCK
    xs, sc = scale_tensor(torch.nn.functional.pad(x, (0, pad)) if pad else x, QUANT_BLOCK)
    codes.copy_(nearest_codes(xs[:n] if pad else xs, base, mid))
    scale.copy_(sc)


_STEPS = {"bf16": _step_bf16_, "8bit": _step_8bit_}


def _slices(states: str, tensors: tuple, s: int, e: int) -> tuple:
    """Elements [s, e) of the weights, the gradient and the moments' storage (bf16 slices, or 8-bit codes and the
    scales of their blocks). Shape: 8-bit whole blocks as (blocks, 256) views: with the block a static inner
    dimension, Inductor's kernel indexes the scales without a division by a dynamic size (dequant 3x faster)."""
    if states == "bf16":
        return tuple(x[s:e] for x in tensors)
    whole = (e - s) % QUANT_BLOCK == 0
    blocks = slice(s // QUANT_BLOCK, -(-e // QUANT_BLOCK))
    return tuple(
        x[blocks] if x.dtype == torch.float32 else x[s:e].view(-1, QUANT_BLOCK) if whole else x[s:e] for x in tensors
    )


@functools.cache
def _fused_step(states: str):
    """_STEPS[states] compiled once for every chunk length (dynamic sizes) by Inductor's C++/OpenMP backend: one
    vectorized, parallel loop over the chunk instead of a pass (and a chunk-sized temporary) per op; or None,
    with one log line, where that backend has no C++ compiler (the eager function then steps every chunk)."""
    if not can_compile_cpu():
        return None
    # the 8-bit step at 128-bit vectors (SSE: 4 lanes) rather than the widest the CPU has: Inductor's C++ turns
    # each table lookup into a scalar loop over a vector's lanes through stack arrays (no vector gather), and at
    # AVX2's 8 lanes that cost more than the vector arithmetic saved (benchmarks/RESULTS.md); the same values at
    # any width
    opts = {"cpp.simdlen": 128} if states == "8bit" else {}
    return torch.compile(_STEPS[states], dynamic=True, fullgraph=True, options=opts)


@functools.cache
def can_compile_cpu() -> bool:
    """Whether Inductor can build CPU kernels here: the C++ compiler it would call exists (a path lookup, once)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
        return True
    except Exception as e:  # noqa: BLE001 - any failure to find one means: step eagerly
        log.warning("host_optim: no C++ compiler for Inductor (%s); HostAdamW steps eagerly, several times slower", e)
        return False


# ---------------------------------------------------------------------------------------------------------
# the 8-bit states' nearest-code tables
# ---------------------------------------------------------------------------------------------------------
def _code_tables(qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, mid): for each of the 65536 bf16 bit patterns (the top half of an fp32), the number of midpoints
    between neighbouring codes of `qmap` below every fp32 value with that top half, and the one midpoint inside
    that range (+inf if none). torchao's maps have at most one midpoint in any such range (checked here)."""
    mids = (qmap[1:] + qmap[:-1]) / 2
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    ends = [
        torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32).view(torch.float32) for b in (top, top | 0xFFFF)
    ]
    low, high = torch.minimum(*ends), torch.maximum(*ends)
    base = torch.searchsorted(mids, low, right=True)
    inside = torch.searchsorted(mids, high, right=True) - base
    if inside[torch.isfinite(low) & torch.isfinite(high)].max() > 1:
        raise AssertionError("a bf16 range holds two midpoints of the 8-bit map: nearest_codes needs a search")
    mid = torch.where(inside > 0, mids[base.clamp(max=mids.numel() - 1)], torch.tensor(float("inf")))
    return base.to(torch.uint8), mid


def nearest_codes(xs: torch.Tensor, base: torch.Tensor, mid: torch.Tensor) -> torch.Tensor:
    """The nearest code of each scaled value in [-1, 1] (ties up): torch.bucketize(xs, midpoints, right=True),
    through _code_tables: the value's top 16 bits pick a base code, one comparison adds the midpoint inside.
    Several times faster on the CPU than torchao's quantize_8bit_with_qmap (a branchless search written for
    compiled GPU kernels) or torch.bucketize (benchmarks/RESULTS.md); codes equal to bucketize's."""
    top = ((xs.view(torch.int32) >> 16) & 0xFFFF).view(-1)
    return (base.index_select(0, top) + (xs.view(-1) >= mid.index_select(0, top))).view(xs.shape)


def _qmaps(mode: str) -> dict[bool, torch.Tensor]:
    """{signed: map}: torchao's dynamic 8-bit maps (signed for m, unsigned for v), as its AdamW8bit uses them
    (build_optimizer checks that torchao is there first)."""
    from torchao.optim.quant_utils import create_dynamic_map

    return {signed: torch.tensor(create_dynamic_map(signed=signed), dtype=torch.float32) for signed in (True, False)}
