"""Optimizers for the memory-saving modes of `fluxzero.config.optim_modes`.

`build_optimizer(params, mode, lr, betas, eps, weight_decay)` returns a plain `torch.optim.Optimizer` that is
handed to `deepspeed.initialize(optimizer=...)` as a client optimizer. This module does not import DeepSpeed.

Why bf16 weights need stochastic rounding or Kahan compensation: an AdamW step moves a weight by about `lr`
(1e-5 in a fine-tune), while half a bf16 ulp of a weight of size 0.05 is 1.2e-4. Round-to-nearest throws
such an update away; stochastic rounding keeps it in expectation, Kahan compensation keeps the lost part in
a bf16 buffer and adds it back on the next step.

Libraries used: torchao's `_AdamW` / `AdamW8bit` with `bf16_stochastic_round=True` (torchao 0.18 ships the
bf16-state AdamW only under the underscore name; it is the same class its AdamW8bit is built on). Written here:
`KahanAdamW` (torch-optimi's `optimi.AdamW(kahan_sum=True)` was much faster than ours on the CPU,
benchmarks/RESULTS.md; switching needs a converter for the optimizer state of existing bf16-kahan checkpoints, so
ours stays for now) and `AdafactorSR` (Adafactor with stochastic rounding); `AdafactorSR` follows `torch.optim.Adafactor` step for step and a test holds
it to torch's within float rounding on fp32 tensors.

DEEPSPEED_FINDINGS: DeepSpeed 0.19.8, torch 2.13 CPU, torchao 0.18, one rank unless said; a client optimizer
from build_optimizer on nn.Sequential(Linear(64,128), GELU, Linear(128,64)) (benchmarks/archive/optim_modes_probe.py)
and on a 256 x 256 least-squares layer (tests/train/test_optim_deepspeed.py). "bf16 keys" = bf16.enabled +
bf16_master_weights_and_grads + bf16_optimizer_states (DeepSpeed accepts them at ZeRO 1-3 only, and without
bf16_optimizer_states it demands CPU offload with DeepSpeedCPUAdam).

  stage, config       wrapper                   what the client optimizer steps        SR applies  resume
  0, bf16 on          FP16_UnfusedOptimizer     per-tensor fp32 masters, shapes kept   no (fp32)   exact
  0, bf16 off, model  none (engine calls the    the model's own bf16 tensors (same     yes         exact
    cast to bf16      client optimizer)         storage), shapes kept
  1-2, bf16 on        DeepSpeedZeroOptimizer    one flat 1-D fp32 partition per group  no (fp32)   exact
  1-2, bf16 keys      DeepSpeedZeroOptimizer    one flat 1-D bf16 partition (a copy,   yes         exact
                                                not the weights' storage)
  3, bf16 keys        DeepSpeedZeroOptimizer_   flat 1-D bf16 partition, swapped into  yes         exact
                      Stage3                    param_groups only during step()
  1-3, 2 ranks        same                      half of the flat partition per rank    yes

- Acceptance: torch.optim.AdamW is on DeepSpeed's tested list; torchao's optimizers, KahanAdamW and
  AdafactorSR need "zero_allow_untested_optimizer": true at ZeRO 1-3 (not at 0).
- With optimizer CPU offload (ZeRO 2, bf16-kahan tried): a client optimizer is refused ("You are using
  ZeRO-Offload with a client provided optimizer") unless "zero_force_ds_cpu_optimizer": false; then with the
  bf16 keys DeepSpeed asserts "Master weights feature requires ZeRO-2 Offload with DeepSpeedCPUAdam", and
  with bf16.enabled alone it hands over fp32 partitions (our check stops it). The bf16 modes and DeepSpeed's
  optimizer offload do not combine: offload means DeepSpeedCPUAdam. (The cpu-* modes' HostAdamW, fluxzero.train.
  optim.host, is let through by fluxzero.train.ds_patches.accept_host_optimizer.)
- bf16 modes with bf16 on at ZeRO 0, or bf16.enabled alone at ZeRO 1-3, step fp32 masters: rounding does
  nothing and nothing is saved. The step pre-hook of build_optimizer raises OptimModeError then.
- Adafactor: at ZeRO 1-3 it sees one flat vector, so it is unfactored (a full variance: 2 B/param in bf16);
  factored (rows + columns) only at ZeRO 0, where shapes are kept.
- The flat partition is the whole of a rank's parameters (stage 3: one sub_group_size of them), so a step that
  does eager fp32 math on it at once needed ~36 B (KahanAdamW) / ~31 B (AdafactorSR) per partition element of
  temporaries (benchmarks/optim_step_memory.py; 27 B each now, per element stepped at once). Both step a flat
  tensor STEP_CHUNK (2^24) elements at a time, bit-identical to one piece on CPU
  (tests/train/test_optim_chunked.py). torchao's _AdamW / AdamW8bit need no
  chunking: one torch.compile'd kernel per tensor, under 1 B per element beyond the states (same benchmark).
- AdamW8bit quantizes a tensor of >= 4096 values that is a multiple of its 256-value block; a ZeRO flat
  partition that is not (the probe's 16576 = 64.75 x 256) silently gets bf16 states. A 65536-value partition
  was quantized (OptimState8bit). build_optimizer warns once when this happens.
- Checkpoints: torch's Optimizer.load_state_dict casts every floating state to its parameter's dtype, and
  DeepSpeed loads with a callable map_location, which torch refuses for torchao's 8-bit subclass
  ("Callable map_location not supported with _rebuild_wrapper_subclass"; seen at ZeRO 0). ExactStateMixin
  saves subclass states as their plain parts and restores saved dtypes; then save -> load into a fresh engine
  -> next step is bit-identical for every mode at every stage (probe and tests).

GRADIENT RELEASE (optimizer step fused into backward): the first attempt, below, failed under DeepSpeed's engine;
fluxzero.train.optim.fused_step (mode fused-adafactor-sr) answers each failure at ZeRO 0 (its docstring says how). Tried at ZeRO 0
(benchmarks/archive/grad_release_probe.py): one optimizer per parameter, stepped by a post-accumulate-grad hook that
then sets p.grad = None. Observed:
- The engine refuses backward without an optimizer ("must provide optimizer during init in order to use
  backward"); an SGD at lr 0 was given to it.
- 1 rank, no accumulation, no clipping: the weights equal the ordinary path (max diff 0.0), but after every
  engine.backward all 4 grads exist again, all zero: the engine's allreduce (buffered_allreduce_fallback)
  creates torch.zeros for every grad that is None, so the full gradient memory comes back each step.
- gradient_accumulation_steps 2: the hooks step on every micro-batch (32 steps for 4 engine steps), weights
  off by 6.2e-2 at lr 1e-2. gradient_clipping 1.0: the engine clips the zero grads, the hooks stepped
  unclipped (off by 6.0e-3).
- 2 ranks: each rank steps on its own un-reduced gradient before the engine's allreduce; after 4 steps rank 1's
  weights are 7.6e-2 from rank 0's (ordinary path: 0.0). Replicas diverge.
At ZeRO 1-3 it cannot be built at all from outside: the optimizer's parameters are DeepSpeed's flat partitions,
not the model's tensors; ZeRO 2-3 own the per-parameter grad hooks themselves (they copy each grad into a
reduce bucket and free it: reduce_ready_partitions_and_remove_grads), and a partition's gradient is only
complete after its bucket's reduce-scatter; the step, the global-norm clip and the overflow check all run in
engine.step on the whole partition. Gradient release needs the reduction and the step in one place, which is
DeepSpeed's optimizer, not a client optimizer.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable

import torch

from fluxzero.config.optim_modes import MODES, STEP_CHUNK, get_mode, trainable_modes
from fluxzero.train.optim.fused_step import FusedStep
from fluxzero.train.optim.rounding import mix32, noise_key, round_keyed, round_with_noise
from fluxzero.train.optim.state import ExactStateMixin

__all__ = [
    "build_optimizer",
    "KahanAdamW",
    "AdafactorSR",
    "FusedAdafactorSR",
    "stochastic_round_bf16",
    "OptimModeError",
]


class OptimModeError(ValueError):
    """A mode that cannot run as configured (missing package, wrong tensor dtype); the message says what to do."""


# ---------------------------------------------------------------------------------------------------------
# stochastic rounding
# ---------------------------------------------------------------------------------------------------------
def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round an fp32 tensor to bf16, up or down with probability proportional to the distance (unbiased).

    bf16 is the top 16 bits of fp32: add a uniform 16-bit integer to the low half, then truncate. Values that
    are already bf16 (low half zero) never change. Inf/NaN are left as they are.
    """
    return round_with_noise(x.float(), _sr_noise(x.shape, x.device, generator))


def _sr_noise(shape, device, generator=None) -> torch.Tensor:
    # on CPU torch draws one 32-bit number per element in order, so drawing a tensor piece by piece gives the
    # same values as drawing it whole: what keeps the chunked steps below bit-identical to unchunked ones
    return torch.randint(0, 1 << 16, shape, device=device, dtype=torch.int32, generator=generator)


def round_bf16_nearest(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the fp32 value bf16 holds for it (round to nearest, ties to even), computed on the bits: equal to
    `x.to(torch.bfloat16).float()` eagerly, and kept exact inside a compiled kernel. Inf/NaN pass through."""
    bits = x.float().contiguous().view(torch.int32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x.float())


def _store(p: torch.Tensor, value32: torch.Tensor, sr: bool, key: int | None = None) -> None:
    """p <- value32, stochastically rounded when p is bf16 and `sr` (noise keyed on `key`, else drawn)."""
    if not (sr and p.dtype == torch.bfloat16):
        p.copy_(value32)
    else:
        p.copy_(stochastic_round_bf16(value32) if key is None else round_keyed(value32.float(), key))


def _closure_loss(closure):
    """torch.optim's step contract: re-evaluate the loss with `closure` (grad enabled) when one is given."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _with_grads(opt: torch.optim.Optimizer):
    """(param group, parameter, its state) for every parameter with a gradient, in torch.optim's order."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                yield group, p, opt.state[p]


# ---------------------------------------------------------------------------------------------------------
# our own optimizers (KahanAdamW: torch-optimi has one too, see the module docstring)
# ---------------------------------------------------------------------------------------------------------
def _kahan_adamw_(p, g, m, v, comp, scalars, beta1: float, beta2: float, eps: float) -> None:
    """One KahanAdamW update of one (flat) tensor, in place: m, v (stochastically rounded when bf16), the weight
    and its Kahan carry. `scalars` is a 3-value fp32 tensor on p's device: lr / (1 - beta1^t),
    sqrt(1 - beta2^t), lr * weight_decay (a tensor, so the compiled kernel serves every step without a recompile).

    Compiled into one fused kernel per call (`_fused_kahan`, the CUDA path): none of the fp32 values below is
    materialised. Its arithmetic is `KahanAdamW._step_piece`'s, operation for operation (tests/train/
    test_optim_fused.py holds the two together); the noise is drawn with randint_like, which traces with a symbolic
    size, so the draws differ from the eager path's.
    """
    g = g.float()
    m32 = m.float().lerp(g, 1 - beta1)
    v32 = v.float().lerp(g.square(), 1 - beta2)
    # bf16 m and v are rounded stochastically: v's EMA moves 0.1% a step at beta2 0.999, under
    # half a bf16 ulp, so round-to-nearest stalls it (measured: weight change +2.4% at 400 steps)
    if m.dtype == torch.bfloat16:
        m.copy_(round_with_noise(m32, torch.randint_like(m32, 0, 1 << 16, dtype=torch.int32)))
        v.copy_(round_with_noise(v32, torch.randint_like(v32, 0, 1 << 16, dtype=torch.int32)))
    else:
        m.copy_(m32)
        v.copy_(v32)
    p32 = p.float()
    denom = (v32.sqrt() / scalars[1]).add(eps)
    update = -scalars[0] * m32 / denom - scalars[2] * p32
    # Kahan: the new weight is p + (update + carry); what bf16 cannot hold becomes the next carry
    exact = p32 + (update + comp.float())
    if p.dtype == torch.bfloat16:
        # the carry needs the weight as bf16 will hold it; written out in bits, because a compiled kernel may
        # keep `exact.to(bf16).float()` in fp32 (Inductor does not emulate intermediate casts by default), and
        # the carry would then be 0: every update under half an ulp lost, the trap this class exists to avoid
        held = round_bf16_nearest(exact)
        p.copy_(held)
        comp.copy_(exact - held)
    else:
        p.copy_(exact)
        comp.copy_(exact - p.float())


@functools.cache
def _fused_kahan():
    """`_kahan_adamw_` compiled once (dynamic sizes: flat tensors of any length share the kernel): about ten
    times the eager step's speed over FLUX.1-dev's weights on a GPU (benchmarks/RESULTS.md)."""
    return torch.compile(_kahan_adamw_, dynamic=True, fullgraph=True)


def _pieces(p: torch.Tensor, chunk: int | None) -> list:
    """Slices that step `p` `chunk` elements at a time: a flat (1-D) tensor, as ZeRO 1-3 hand one per rank, is
    cut up so the fp32 temporaries of a step stay chunk-sized; a shaped tensor (ZeRO 0: one layer) is whole."""
    n = p.numel()
    if p.dim() != 1 or chunk is None or n <= chunk:
        return [...]
    return [slice(i, min(i + chunk, n)) for i in range(0, n, chunk)]


def _check_chunk(chunk: int | None, multiple_of: int = 1) -> int | None:
    if chunk is not None and (chunk < 1 or chunk % multiple_of):
        raise ValueError(
            f"step_chunk must be a positive multiple of {multiple_of} elements or None (whole tensors), got {chunk}"
        )
    return chunk


class KahanAdamW(ExactStateMixin, torch.optim.Optimizer):
    """AdamW whose states live in the parameter's dtype and whose bf16 updates are Kahan-compensated.

    Math in fp32 each step; `comp` holds what rounding the weight to bf16 lost, and is added to the next
    update, so no update is lost however small. On fp32 parameters it is plain AdamW (comp stays zero).
    Every element's update depends only on that element, so a flat tensor is stepped `step_chunk` elements at a
    time (about 30 B of fp32 temporaries per element of a chunk, not of the whole ZeRO partition); the result
    does not depend on the chunk size (bit-identical on CPU, tests/train/test_optim_chunked.py).
    On CUDA tensors the update of each tensor is instead one compiled kernel with no temporaries (`fused=None`: on
    CUDA; True/False forces it), several times faster than the eager update (benchmarks/RESULTS.md, "Figures behind
    code choices").
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        *,
        step_chunk: int | None = STEP_CHUNK,
        fused: bool | None = None,
    ):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.step_chunk = _check_chunk(step_chunk)
        self.fused = fused

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        scalars = {}  # one small host-to-device copy per (group, device, step count), not one per tensor
        for group, p, st in _with_grads(self):
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
                st["comp"] = torch.zeros_like(p)
            st["step"] += 1
            t = st["step"].item()  # a CPU tensor: no device sync
            if p.is_cuda if self.fused is None else self.fused:
                beta1, beta2 = group["betas"]
                lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
                key = (id(group), p.device, t)
                if key not in scalars:
                    scalars[key] = torch.tensor(
                        [lr / (1 - beta1**t), math.sqrt(1 - beta2**t), lr * wd], dtype=torch.float32
                    ).to(p.device, non_blocking=True)
                _fused_kahan()(
                    p.view(-1),
                    p.grad.view(-1),
                    st["exp_avg"].view(-1),
                    st["exp_avg_sq"].view(-1),
                    st["comp"].view(-1),
                    scalars[key],
                    beta1,
                    beta2,
                    eps,
                )
                continue
            for i in _pieces(p, self.step_chunk):
                self._step_piece(group, t, p[i], p.grad[i], st["exp_avg"][i], st["exp_avg_sq"][i], st["comp"][i])
        return loss

    @staticmethod
    def _step_piece(group, t, p, grad, exp_avg, exp_avg_sq, comp):
        # Each temporary is dropped once used and the rest is done in place (the same IEEE operations as
        # -(lr / bc1) * m / denom - (lr * wd) * p32 and p32 + (update + comp)): 27 B per element measured, 44 with
        # every temporary kept to the end (benchmarks/optim_step_memory.py).
        # .float() of an fp32 tensor is that tensor, so nothing is done in place on g, v or p32.
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        g = grad.float()
        m = exp_avg.float().lerp_(g, 1 - beta1)
        v = exp_avg_sq.float().lerp_(g.square(), 1 - beta2)
        del g
        # bf16 m and v are rounded stochastically: v's EMA moves 0.1% a step at beta2 0.999, under half a bf16
        # ulp, so round-to-nearest stalls it (measured: weight change +2.4% at 400 steps). One draw of two
        # numbers per element, m's and v's side by side, so the random stream does not depend on the chunking.
        if exp_avg.dtype == torch.bfloat16:
            noise = _sr_noise(m.shape + (2,), m.device)
            exp_avg.copy_(round_with_noise(m, noise[..., 0]))
            exp_avg_sq.copy_(round_with_noise(v, noise[..., 1]))
            del noise
        else:
            exp_avg.copy_(m)
            exp_avg_sq.copy_(v)
        denom = v.sqrt().div_(math.sqrt(1 - beta2**t)).add_(eps)
        del v
        update = m.mul(-(lr / (1 - beta1**t))).div_(denom)
        del m, denom
        p32 = p.float()
        update.sub_(p32 * (lr * wd))
        # Kahan: the new weight is p + (update + carry); what bf16 cannot hold becomes the next carry
        exact = update.add_(comp.float()).add_(p32)
        del p32
        p.copy_(exact)
        comp.copy_(exact.sub_(p.float()))


# AdafactorSR's two whole-tensor norms are sums of fp64 squares over blocks of this many elements, then one sum of
# the block sums: the same blocks whatever the chunk size, so chunking leaves the norms (and the step) unchanged
_SUMSQ_BLOCK = 1 << 14


def _block_sumsq(x: torch.Tensor) -> torch.Tensor:
    """Shape: (n,) -> (ceil(n / _SUMSQ_BLOCK),) fp64 sums of squares (x's start must be a block boundary)."""
    x = x.reshape(-1)
    full = x.numel() // _SUMSQ_BLOCK * _SUMSQ_BLOCK
    parts = [x[:full].view(-1, _SUMSQ_BLOCK).double().square_().sum(dim=1)] if full else []
    if full < x.numel():
        parts.append(x[full:].double().square_().sum().view(1))
    return torch.cat(parts)


class AdafactorSR(ExactStateMixin, torch.optim.Optimizer):
    """torch.optim.Adafactor's algorithm with bf16 weights written back by stochastic rounding.

    Factored second moments (row and column means, fp32: they are O(rows + cols)) for tensors of two or more
    dimensions; a full variance in the parameter's dtype for vectors. A ZeRO stage 1-3 partition is a flat
    vector, so under ZeRO it is unfactored: see DEEPSPEED_FINDINGS. Such a vector is stepped `step_chunk`
    elements at a time, in two passes (the step size needs the norms of the whole weight and update before any
    element is written: the first pass sums their squares, the second recomputes the update and applies it);
    a factored tensor needs whole rows and columns and is stepped whole (ZeRO 0: one layer at a time).
    """

    def __init__(
        self,
        params,
        lr=1e-2,
        beta2_decay=-0.8,
        eps=(None, 1e-3),
        d=1.0,
        weight_decay=0.0,
        *,
        step_chunk: int | None = STEP_CHUNK,
        noise_seed: int | None = None,
    ):
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay))
        self.step_chunk = _check_chunk(step_chunk, _SUMSQ_BLOCK)
        # None: rounding noise from torch's generator (its state is in the trainer's checkpoint); an int: noise
        # keyed on (seed, the parameter's place in param_groups, its step), the same whatever order the tensors
        # are stepped in (fluxzero.train.optim.fused_step steps them in backward's order)
        self.noise_seed = noise_seed
        self._place = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group, p, _st in _with_grads(self):
            self.step_param(group, p)
        return loss

    @torch.no_grad()
    def step_param(self, group: dict, p: torch.Tensor, finite: torch.Tensor | None = None) -> None:
        """Step one parameter of `group` with its gradient (what step() does for each).

        finite: None, or a 0-d bool tensor on p's device; where it is False the weight and its second moments stay
        as they are (only the step count moves). The decision stays on the device: no host sync, so a step in
        backward (fluxzero.train.optim.fused_step) never stalls the queue of kernels behind it."""
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            if p.dim() > 1:
                st["row_var"] = p.new_zeros(p.shape[:-1] + (1,), dtype=torch.float32)
                st["col_var"] = p.new_zeros(p.shape[:-2] + (1, p.shape[-1]), dtype=torch.float32)
            else:
                st["variance"] = torch.zeros_like(p)
        # same order of operations as torch.optim.Adafactor's single-tensor path (torch 2.13)
        st["step"] += 1
        t = st["step"].item()  # a CPU tensor: no device sync
        key = None if self.noise_seed is None else mix32(self.noise_seed, self._place[p], int(t))
        if p.dim() > 1:
            self._step_factored(group, t, p, st, key, finite)
        else:
            self._step_flat(group, t, p, st["variance"], key, finite)

    @staticmethod
    def _eps1(group) -> float:
        # torch takes eps1 from the param's dtype; the math here is fp32, and bf16's eps (7.8e-3) would clamp
        # fine-tuning second moments (~1e-8) and shrink every update ~100-fold
        return torch.finfo(torch.float32).eps if group["eps"][0] is None else group["eps"][0]

    def _scalars(self, group, t, p) -> torch.Tensor:
        """fp64 (3,) on p's device: min(lr, t^-1/2), t^beta2_decay, the weight-decay factor. Tensors, so the
        compiled step serves every step without a recompile; one copy per (group, device, step, lr), not one per
        tensor: a copy from pageable host memory waits for the device's queue, the sync the fused step avoids."""
        lr, wd = group["lr"], group["weight_decay"]
        key = (id(group), p.device, t, lr, wd, group["beta2_decay"])
        cache = self.__dict__.setdefault("_scalar_cache", {})
        if key not in cache:
            if len(cache) > 64:  # a new step or lr: the old entries are done with
                cache.clear()
            cache[key] = torch.tensor(
                [min(lr, 1 / t**0.5), t ** group["beta2_decay"], 1 - lr * wd], dtype=torch.float64
            ).to(p.device)
        return cache[key]

    def _step_factored(self, group, t, p, st, key=None, finite=None):
        scalars = self._scalars(group, t, p)
        # compiled where the noise is keyed: a draw from torch's generator inside a compiled kernel would move
        # the stream the trainer's own draws come from
        args = (
            p,
            p.grad,
            st["row_var"],
            st["col_var"],
            scalars,
            finite,
            self._eps1(group),
            group["eps"][1],
            group["d"],
            group["weight_decay"] != 0,
        )
        new = _factored_update(args) if p.is_cuda and key is not None else _adafactor_factored(*args)
        # the rounding stays outside the compiled graph (its int32 hash is not Inductor-safe on CUDA), eager but
        # with no host sync
        _store(p, new, sr=True, key=key)

    def _step_flat(self, group, t, p, variance, key=None, finite=None):
        pieces = _pieces(p, self.step_chunk)
        scale = self._flat_scale(group, t, p, variance, pieces, finite)  # pass 1: nothing written
        for i in pieces:  # pass 2: the same update again, applied
            v, update = self._flat_update(group, t, p, variance, i, finite)
            if finite is not None:
                v = torch.where(finite, v, variance[i].float())
            variance[i].copy_(v)
            p32 = p[i].float()
            if group["weight_decay"] != 0:
                factor = 1 - group["lr"] * group["weight_decay"]
                p32.mul_(factor if finite is None else torch.where(finite, factor, 1.0).float())
            start = i.start if isinstance(i, slice) else 0
            _store(
                p[i], p32.addcmul_(update, scale.float()), sr=True, key=None if key is None else noise_key(key, start)
            )

    def _flat_update(self, group, t, p, variance, i, finite=None):
        """The new variance (fp32, not yet stored) and the update of piece `i` of a flat tensor."""
        g = p.grad[i].float()
        if finite is not None:
            g = torch.where(finite, g, 0.0)
        # out of place: .float() of an fp32 variance is the state itself, which pass 1 must leave as it is
        v = variance[i].float().lerp(g * g, t ** group["beta2_decay"])
        e1 = self._eps1(group)
        return v, v.clamp(min=e1 * e1).rsqrt_().mul_(g)

    def _flat_scale(self, group, t, p, variance, pieces, finite=None) -> torch.Tensor:
        """The step's scale (a 0-d fp64 tensor) from the norms of the whole weight and update, summed a piece at a
        time."""
        p_sq, u_sq = [], []
        for i in pieces:
            p_sq.append(_block_sumsq(p[i]))
            u_sq.append(_block_sumsq(self._flat_update(group, t, p, variance, i, finite)[1]))
        lr_t = min(group["lr"], 1 / t**0.5)
        return _scale(
            torch.cat(p_sq).sum().sqrt(), torch.cat(u_sq).sum().sqrt(), lr_t, group["eps"][1], group["d"], p.numel()
        )


def _scale(p_norm: torch.Tensor, u_norm: torch.Tensor, lr_t, eps2: float, d: float, n: int) -> torch.Tensor:
    """-alpha / denom as a 0-d fp64 tensor: torch's relative step size (RMS of the weight, at least eps2, times
    lr_t = min(lr, t^-1/2)) and update clipping (by the update's RMS over d). Tensors throughout: no host sync."""
    alpha = torch.clamp(p_norm.double() / n**0.5, min=eps2) * lr_t
    return -alpha / torch.clamp(u_norm.double() / (n**0.5 * d), min=1.0)


def _adafactor_factored(
    p, g, row_var, col_var, scalars, finite, e1: float, eps2: float, d: float, decay: bool
) -> torch.Tensor:
    """One AdafactorSR update of one tensor of two or more dimensions: the factored second moments (row and column
    means of g^2, fp32) in place, and the new weight returned in fp32 (the caller stores it, stochastically rounded
    when bf16). scalars: AdafactorSR._scalars. Where `finite` (a 0-d bool tensor, or None) is False, the gradient
    counts as zero and the states are kept: the weight comes back unchanged.

    Eager on the CPU; on CUDA compiled once per shape (`_compiled_factored`): the full-size variance and the other
    temporaries are never materialised, and nothing waits for the host."""
    g = g.float()
    if finite is not None:
        g = torch.where(finite, g, 0.0)
    p32 = p.float()
    p_norm = torch.linalg.vector_norm(p32)
    if decay:  # a tensor with a non-finite gradient keeps its weight: no decay either
        factor = scalars[2] if finite is None else torch.where(finite, scalars[2], 1.0)
        p32 = p32 * factor.float()
    w = scalars[1].float()
    row = row_var.lerp(torch.norm(g, dim=-1, keepdim=True).square().div(g.size(-1)), w)
    col = col_var.lerp(torch.norm(g, dim=-2, keepdim=True).square().div(g.size(-2)), w)
    if finite is not None:
        row, col = torch.where(finite, row, row_var), torch.where(finite, col, col_var)
    row_var.copy_(row)
    col_var.copy_(col)
    # the outer product as a broadcast multiply: the same values as torch's row_var @ col_var (one product each),
    # and no mm for Inductor's CUDA passes, which failed to build it ("mat2 must be a matrix")
    var = (row * col).div(row.mean(dim=-2, keepdim=True).clamp(min=e1))
    update = var.clamp(min=e1 * e1).rsqrt().mul(g)
    scale = _scale(p_norm, torch.linalg.vector_norm(update), scalars[0], eps2, d, p.numel())
    return p32.addcmul(update, scale.float())


# Graphs the compiled step may hold. Dynamo's default limit (8 per function) is below FLUX.1-dev's 13 weight shapes,
# and with fullgraph=True the 9th shape raises instead of running eagerly: the limit is raised for these calls only.
RECOMPILE_LIMIT = 64
_COMPILE_FAILED = False


@functools.cache
def _compiled_factored(backend: str = "inductor"):
    """`_adafactor_factored` compiled, called under a recompile limit of at least RECOMPILE_LIMIT: a graph per
    weight shape (FLUX.1-dev has 13) and per variant of the arguments that are not tensors."""
    import torch._dynamo  # loaded by torch.compile anyway; imported here for its config

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.7
    limit = config.patch(**{name: max(RECOMPILE_LIMIT, getattr(config, name))})
    return limit(torch.compile(_adafactor_factored, dynamic=False, fullgraph=True, backend=backend))


def _factored_update(args: tuple, backend: str = "inductor") -> torch.Tensor:
    """`_adafactor_factored(*args)` through its compiled graphs; eagerly once a build has failed (said once)."""
    if not _COMPILE_FAILED:
        try:
            return _compiled_factored(backend)(*args)
        except Exception as e:  # a compiler that cannot build it: the same math eagerly
            _compile_failed(e)
    return _adafactor_factored(*args)


def _compile_failed(e: Exception) -> None:
    global _COMPILE_FAILED
    _COMPILE_FAILED = True
    warnings.warn(
        f"the compiled Adafactor step could not be built ({type(e).__name__}: {str(e)[:200]}); stepping "
        f"eagerly (same math, slower)",
        stacklevel=3,
    )


class FusedAdafactorSR(FusedStep, AdafactorSR):
    """AdafactorSR stepped per parameter in backward (fluxzero.train.optim.fused_step): mode fused-adafactor-sr."""


# ---------------------------------------------------------------------------------------------------------
# the one entry point
# ---------------------------------------------------------------------------------------------------------
def _torchao_optim(mode: str):
    try:
        import torchao.optim
    except ImportError:
        raise OptimModeError(
            f"optimizer mode {mode!r} needs torchao: pip install -e '.[{MODES[mode].extra}]' in the fluxzero checkout"
        ) from None
    if not hasattr(torchao.optim, "_AdamW"):
        raise OptimModeError(
            f"optimizer mode {mode!r} needs torchao 0.18 or later (it has no bf16-state AdamW "
            f"before that): pip install -U -e '.[{MODES[mode].extra}]'"
        )
    return torchao.optim


def build_optimizer(
    params: Iterable,
    mode: str,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    allow_comparison_only: bool = False,
    noise_seed: int = 0,
) -> torch.optim.Optimizer:
    """The client optimizer for `mode` (a name in `fluxzero.config.optim_modes.MODES`).

    Modes whose master weights are bf16 check, at their first step, that the tensors they step really are
    bf16; otherwise DeepSpeed kept fp32 masters and the mode saves nothing (OptimModeError says which keys).
    `allow_comparison_only` admits "bf16-rtn", which loses most fine-tuning updates (tests compare with it).
    `noise_seed` keys the rounding noise of the fused modes (fluxzero.train.optim.fused_step), which step the tensors in
    backward's order; the others draw theirs from torch's generator.
    For Adafactor `betas` and `eps` are unused: it has no first moment; its epsilons are torch's defaults
    except eps1, which is fp32's (see AdafactorSR.step).
    """
    spec = get_mode(mode)
    if not spec.trainable and not allow_comparison_only:
        raise OptimModeError(
            f"optimizer mode {mode!r} is for comparison only ({spec.caveat}); "
            f"choose one of: {', '.join(trainable_modes())}"
        )
    builder = BUILDERS.get(spec.builder)
    if builder is None:  # a registry entry without a builder is a bug here, not a user error
        raise AssertionError(f"no optimizer for registered mode {mode!r} (builder {spec.builder!r})")
    opt = builder(list(params), spec, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, noise_seed=noise_seed)
    if spec.master_dtype == "bf16":
        opt.register_step_pre_hook(_check_bf16_once(mode, host=spec.needs_offload))
    opt.fluxzero_mode = mode
    return opt


# ---------------------------------------------------------------------------------------------------------
# one builder per OptimMode.builder: (params, mode, lr, betas, eps, weight_decay, noise_seed) -> the optimizer.
# Adafactor has no first moment: betas and eps are unused (see AdafactorSR.step for its epsilons).
# ---------------------------------------------------------------------------------------------------------
def _adamw(params, spec, lr, betas, eps, weight_decay, noise_seed):
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def _torchao_adamw(params, spec, lr, betas, eps, weight_decay, noise_seed):
    return _exact(_torchao_optim(spec.name)._AdamW)(
        params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bf16_stochastic_round=True
    )


def _torchao_adamw8bit(params, spec, lr, betas, eps, weight_decay, noise_seed):
    opt = _exact(_torchao_optim(spec.name).AdamW8bit)(
        params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bf16_stochastic_round=True
    )
    opt.register_step_post_hook(_warn_unquantized_once())
    return opt


def _kahan_adamw(params, spec, lr, betas, eps, weight_decay, noise_seed):
    return KahanAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, step_chunk=spec.step_chunk)


def _adafactor_sr(params, spec, lr, betas, eps, weight_decay, noise_seed):
    return AdafactorSR(params, lr=lr, weight_decay=weight_decay, step_chunk=spec.step_chunk)


def _fused_adafactor_sr(params, spec, lr, betas, eps, weight_decay, noise_seed):
    return FusedAdafactorSR(params, lr=lr, weight_decay=weight_decay, step_chunk=spec.step_chunk, noise_seed=noise_seed)


def _host_adamw(states: str):
    def build(params, spec, lr, betas, eps, weight_decay, noise_seed):
        from fluxzero.train.optim.host import HostAdamW

        if states == "8bit":
            _torchao_optim(spec.name)  # the 8-bit format is torchao's
        return HostAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, states=states, mode=spec.name)

    return build


BUILDERS = {
    "AdamW": _adamw,
    "torchao._AdamW": _torchao_adamw,
    "torchao.AdamW8bit": _torchao_adamw8bit,
    "KahanAdamW": _kahan_adamw,
    "AdafactorSR": _adafactor_sr,
    "FusedAdafactorSR": _fused_adafactor_sr,
    "HostAdamW": _host_adamw("bf16"),
    "HostAdamW8bit": _host_adamw("8bit"),
}


_EXACT: dict[type, type] = {}


def _exact(cls: type) -> type:
    """`cls` with ExactStateMixin (one subclass per library class, so pickling and isinstance keep working)."""
    if cls not in _EXACT:
        _EXACT[cls] = type(cls.__name__, (ExactStateMixin, cls), {"__module__": __name__, "__qualname__": cls.__name__})
    return _EXACT[cls]


def _warn_unquantized_once():
    done = False

    def hook(opt, args, kwargs):
        nonlocal done
        if done:
            return
        done = True
        plain = sum(
            p.numel()
            for p in opt.state
            if p.numel() >= 4096
            and "exp_avg" in opt.state[p]
            and type(opt.state[p]["exp_avg"]).__name__ != "OptimState8bit"
        )
        if plain:
            warnings.warn(
                f"adamw8bit-sr keeps bf16 states for {plain} values: tensors (under ZeRO, flat "
                f"partitions) whose size is not a multiple of {opt.block_size} cannot be quantized",
                stacklevel=2,
            )

    return hook


def _check_bf16_once(mode: str, host: bool = False):
    """At the first step: the tensors are bf16 (`host`: bf16 in host memory, DeepSpeed's offloaded partitions)."""
    checked = False

    def hook(opt, args, kwargs):
        nonlocal checked
        if checked:
            return
        kinds = {(p.dtype, p.device.type) for g in opt.param_groups for p in g["params"] if p.grad is not None}
        dtypes = {d for d, _ in kinds}
        if host and kinds - {(torch.bfloat16, "cpu")}:
            raise OptimModeError(
                f"optimizer mode {mode!r} steps bf16 master partitions in host memory, but was handed "
                f"{sorted(f'{d} on {dev}' for d, dev in kinds)}: set zero_optimization.offload_optimizer.device cpu "
                f"and bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer_states true (`fluxzero gen-config "
                f"--optimizer-mode {mode} --offload-optimizer cpu` writes them)"
            )
        if dtypes and dtypes != {torch.bfloat16}:
            raise OptimModeError(
                f"optimizer mode {mode!r} is stepping {sorted(map(str, dtypes))} tensors, so its bf16 rounding "
                "does nothing and it saves no memory: with ZeRO 1-3 set bf16.bf16_master_weights_and_grads and "
                "bf16.bf16_optimizer_states to true; at ZeRO 0 leave bf16 off and cast the model to bf16"
            )
        checked = True

    return hook
