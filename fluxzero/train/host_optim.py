"""HostAdamW: the optimizer of the cpu-* modes, AdamW stepped on the host on DeepSpeed's offloaded bf16 partitions.

With optimizer offload and `bf16_master_weights_and_grads` + `bf16_optimizer_states`, ZeRO 1-3 keep the master
partition and its gradient in bf16 in host memory and hand them to the client optimizer (one flat 1-D tensor per
group or ZeRO-3 sub-group). This optimizer steps them in chunks of HOST_STEP_CHUNK elements, so its fp32
temporaries stay a few hundred MB whatever the partition (FLUX.1-dev: 11.9e9 elements at one GPU); each chunk's
ops are torch's multi-threaded CPU kernels (intra-op threads: torch.get_num_threads()).

Per chunk, in fp32: m and v updated as in torch's AdamW, the weight decayed and moved by the bias-corrected step,
then written back to bf16 by stochastic rounding (an AdamW step at fine-tuning lr is under half a bf16 ulp of
most weights: round-to-nearest loses it, see fluxzero.train.optim). m and v are kept either
  "bf16"  in bf16, stochastically rounded too (v's EMA moves 0.1% a step at beta2 0.999, under half an ulp), or
  "8bit"  blockwise 8-bit with one fp32 scale per 256 values, signed / unsigned dynamic maps (torchao's AdamW8bit
          format and its create_dynamic_map, scale_tensor and dequant_with_qmap, called eagerly on chunks; a
          partition that is not a multiple of 256 gets a short last block). The nearest code comes from a 65536-entry
          table on the value's top 16 bits (nearest_codes: 20-40x faster than torchao's eager quantizer here).
The update itself uses the unquantized fp32 m and v of this step, as torchao's does.

Libraries: torchao for the 8-bit format (above). Stochastic rounding is torchao's and fluxzero.train.optim's bit
trick (add 16 random low bits, truncate) with the random bits from a counter-based hash of (state, step, element)
rather than from a generator, which on the CPU fills tensors serially (round_bf16 says the measurement); the
noise is then a function of the step alone, so resume is exact whatever else draws random numbers. Not DeepSpeedCPUAdam: it rounds bf16 masters to nearest (measured -78% weight change, +105%
loss against fp32 masters) and needs a C++ build.

DeepSpeed 0.19.8 accepts this optimizer with offload only through fluxzero.train.engine.accept_host_optimizer
(its bf16-master offload check asks for exactly DeepSpeedCPUAdam); `fp32_optimizer_states = False` answers the
other half of that check (base_optimizer._configure_master_weights). Build it with fluxzero.train.optim.
build_optimizer, which checks torchao and, at the first step, that the tensors really are bf16 host partitions.
"""
from __future__ import annotations

import math

import torch

from fluxzero.config.optim_modes import HOST_STEP_CHUNK, QUANT_BLOCK
from fluxzero.train.optim_state import ExactStateMixin
from fluxzero.train.rounding import counter_noise, mix32, round_with_noise

STATE_FORMATS = ("bf16", "8bit")
_SEED = 0x5EED  # the rounding noise's key is (this, the state's stream, the step, m / v / weights)


class HostAdamW(ExactStateMixin, torch.optim.Optimizer):
    """AdamW on bf16 host tensors: fp32 math chunk by chunk, stochastic rounding into the bf16 weights."""

    fp32_optimizer_states = False  # read by DeepSpeed's bf16_optimizer_states check: moments are not fp32

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, states="bf16",
                 chunk=HOST_STEP_CHUNK, mode="cpu-bf16-sr"):
        if states not in STATE_FORMATS:
            raise ValueError(f"states must be one of {', '.join(STATE_FORMATS)}, got {states!r}")
        if chunk < QUANT_BLOCK or chunk % QUANT_BLOCK:
            raise ValueError(f"chunk must be a positive multiple of {QUANT_BLOCK}, got {chunk}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.states, self.chunk, self.mode = states, chunk, mode
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
        step_size = lr / (1 - beta1**t)
        root_bc2 = math.sqrt(1 - beta2**t)
        flat, grad = p.view(-1), p.grad.view(-1)
        keys = [mix32(_SEED, st["sr_stream"], t, what) for what in range(3)]  # m, v, weights: three draws a step
        for s in range(0, flat.numel(), self.chunk):
            e = min(flat.numel(), s + self.chunk)
            g = grad[s:e].float()
            m = self._load(st, "exp_avg", s, e).lerp_(g, 1 - beta1)
            v = self._load(st, "exp_avg_sq", s, e).lerp_(g.mul_(g), 1 - beta2)
            del g
            self._save(st, "exp_avg", m, s, e, keys[0])
            self._save(st, "exp_avg_sq", v, s, e, keys[1])
            denom = v.sqrt_().div_(root_bc2).add_(eps)
            w = flat[s:e].float().mul_(1 - lr * wd).addcdiv_(m, denom, value=-step_size)
            flat[s:e].copy_(round_bf16(w, s, keys[2]))

    # --- the moments' storage: bf16, or 8-bit codes with a scale per QUANT_BLOCK values
    def _load(self, st: dict, key: str, s: int, e: int) -> torch.Tensor:
        if self.states == "bf16":
            return st[key].view(-1)[s:e].float()
        from torchao.optim.quant_utils import dequant_with_qmap

        codes = _padded(st[key + "_codes"], s, e)
        scale = st[key + "_scale"][s // QUANT_BLOCK:-(-e // QUANT_BLOCK)]
        return dequant_with_qmap(codes, self._qmaps[key == "exp_avg"], scale)[:e - s].clone()

    def _save(self, st: dict, key: str, x: torch.Tensor, s: int, e: int, draw: int) -> None:
        if self.states == "bf16":
            st[key].view(-1)[s:e].copy_(round_bf16(x, s, draw))
            return
        from torchao.optim.quant_utils import scale_tensor

        n = e - s
        pad = -n % QUANT_BLOCK  # a short last block: zeros do not change its absmax scale
        xs, scale = scale_tensor(torch.nn.functional.pad(x, (0, pad)) if pad else x, QUANT_BLOCK)
        st[key + "_codes"][s:e].copy_(nearest_codes(xs[:n], *self._codes[key == "exp_avg"]))
        st[key + "_scale"][s // QUANT_BLOCK:s // QUANT_BLOCK + scale.numel()].copy_(scale)


# ---------------------------------------------------------------------------------------------------------
# stochastic rounding with counter-based noise
# ---------------------------------------------------------------------------------------------------------
def round_bf16(x: torch.Tensor, start: int, key: int) -> torch.Tensor:
    """fp32 -> bf16 by stochastic rounding (fluxzero.train.optim.stochastic_round_bf16's bit trick: add 16 random
    low bits, truncate), the noise a hash of (key, element index start + i) instead of a generator's draws.

    torch's CPU generator (mt19937) fills a tensor serially: 17-22 ns a value on one thread however many cores,
    three draws a value a step, ~10 minutes a step for FLUX.1-dev's 11.9e9 values. The hash is torch's parallel
    integer kernels (6 ns a value on one thread here); and the noise depends only on (key, index), so neither
    chunking nor resume changes it.
    """
    return round_with_noise(x, counter_noise(x.numel(), mix32(key, start >> 32), "cpu", offset=start & 0xFFFFFFFF))


def _code_tables(qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, mid): for each of the 65536 bf16 bit patterns (the top half of an fp32), the number of midpoints
    between neighbouring codes of `qmap` below every fp32 value with that top half, and the one midpoint inside
    that range (+inf if none). torchao's maps have at most one midpoint in any such range (checked here)."""
    mids = (qmap[1:] + qmap[:-1]) / 2
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    ends = [torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32).view(torch.float32) for b in (top, top | 0xFFFF)]
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
    Measured on 4M values, one thread (2026-12): torchao's quantize_8bit_with_qmap (a branchless search written
    for compiled GPU kernels) 190 ns a value eagerly, torch.bucketize 52, this 5-9; codes equal to bucketize's."""
    top = (xs.view(torch.int32) >> 16) & 0xFFFF
    return base.index_select(0, top) + (xs >= mid.index_select(0, top))


def _padded(codes: torch.Tensor, s: int, e: int) -> torch.Tensor:
    """codes[s:e], padded with zeros to whole QUANT_BLOCK blocks (dequant_with_qmap reshapes by block)."""
    part = codes[s:e]
    pad = -(e - s) % QUANT_BLOCK
    return torch.cat([part, part.new_zeros(pad)]) if pad else part


def _qmaps(mode: str) -> dict[bool, torch.Tensor]:
    """{signed: map}: torchao's dynamic 8-bit maps (signed for m, unsigned for v), as its AdamW8bit uses them
    (build_optimizer checks that torchao is there first)."""
    from torchao.optim.quant_utils import create_dynamic_map

    return {signed: torch.tensor(create_dynamic_map(signed=signed), dtype=torch.float32) for signed in (True, False)}
