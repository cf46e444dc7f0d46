"""Hardware, the fit verdict and the search: a table over ZeRO stages and offload, whether an estimate fits a
GPU (and host) with a margin, and `fit`, the fastest configuration that does, with the reasons in sentences.

Pure Python (no torch, no deepspeed): `gen-config --fit` answers instantly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from fluxzero.config import optim_modes
from fluxzero.config.deepspeed import adam_impl
from fluxzero.config.deepspeed import build as ds_config
from fluxzero.config.deepspeed.check import CHECKPOINT_POLICIES
from fluxzero.config.deepspeed.view import DSConfigError
from fluxzero.config.lora import BASE_QUANTS, DEFAULT_TARGETS
from fluxzero.config.models import get_model_config
from fluxzero.plan.activations import checkpointed_split
from fluxzero.plan.breakdown import Estimate, estimate
from fluxzero.plan.model_states import stream_traffic
from fluxzero.plan.spec import (
    BASE_QUANT_MATMUL,
    OPTION_FIELDS,
    PRECISION_BYTES,
    WEIGHT_ONLY_QUANTS,
    GiB,
    RunSpec,
    ZeroSettings,
    run_options_from_ds_config,
    streamed_blocks,
)

# Usable GPU memory as torch reports it (total_memory), for `--gpu NAME`.
GPU_MEMORY_GIB = {
    "h200": 139.8,
    "h100": 79.1,
    "a100-80": 79.1,
    "a100-40": 39.4,
    "l40s": 44.4,
    "a6000": 47.5,
    "rtx4090": 23.6,
    "rtx3090": 23.6,
    "rtx4080": 15.7,
    "mi300x": 191.5,
}
# The --gpu names with FP8 tensor cores that lora.base_quant fp8-matmul multiplies on (NVIDIA compute capability
# 8.9+: Ada, Hopper; fluxzero.model.fp8_matmul.MIN_CAPABILITY). The others: A100 8.0, A6000 and RTX 3090 8.6, and
# MI300X, whose FP8 is another e4m3 variant (e4m3fnuz) than the layer's.
GPU_FP8_MATMUL = frozenset({"h200", "h100", "l40s", "rtx4090", "rtx4080"})


def gpu_quant_problem(gpu: str | None, base_quant: str | None) -> str | None:
    """One sentence saying why `--gpu gpu` cannot train a `base_quant` base, or None where it can (or no --gpu)."""
    if gpu is None or base_quant != "fp8-matmul" or gpu in GPU_FP8_MATMUL:
        return None
    return (
        f"--base-quant fp8-matmul needs FP8 tensor cores (Ada or Hopper: {', '.join(sorted(GPU_FP8_MATMUL))}), "
        f"which --gpu {gpu} lacks; use --base-quant fp8 (weight-only) or int8"
    )


# ---------------------------------------------------------------------------------------------------------
# Tables and fitting
# ---------------------------------------------------------------------------------------------------------
STAGE_OFFLOAD_GRID: tuple[tuple[int, str, str], ...] = (
    (0, "none", "none"),
    (1, "none", "none"),
    (2, "none", "none"),
    (3, "none", "none"),
    (1, "cpu", "none"),
    (2, "cpu", "none"),
    (3, "cpu", "none"),
    (3, "cpu", "cpu"),
    (3, "nvme", "nvme"),
)


def table(spec: RunSpec, zero_by_stage: dict[int, ZeroSettings] | None = None) -> list[tuple[RunSpec, Estimate]]:
    """The same run over ZeRO stages 0-3 x offload choices (fastest first); `zero_by_stage` gives each stage's
    communication settings (default: the spec's own for every row)."""
    rows = []
    for st, oo, op in STAGE_OFFLOAD_GRID:
        try:  # a row the spec's optimizer mode cannot run (bf16 masters with offload) is left out
            rows.append(
                spec.replace(
                    stage=st, offload_optimizer=oo, offload_param=op, zero=(zero_by_stage or {}).get(st, spec.zero)
                )
            )
        except ValueError:
            continue
    return [(r, estimate(r)) for r in rows]


@dataclass(frozen=True)
class Hardware:
    gpu_memory_gib: float
    host_memory_gib: float | None = None  # per node; None = do not check
    nodes: int = 1
    gpus_per_node: int = 1
    # FP8 tensor cores (a --gpu in GPU_FP8_MATMUL): fit may then choose a LoRA's fp8-matmul base; False where the
    # GPU is unknown (--gpu-memory alone)
    fp8_matmul: bool = False

    def __post_init__(self):
        if self.gpu_memory_gib <= 0:
            raise ValueError(f"gpu memory must be positive, got {self.gpu_memory_gib} GiB")
        if self.host_memory_gib is not None and self.host_memory_gib <= 0:
            raise ValueError(f"host memory must be positive, got {self.host_memory_gib} GiB")


def verdict(est: Estimate, hw: Hardware, margin: float) -> tuple[bool, str]:
    """(fits, reason): GPU total within (1 - margin) x capacity, host likewise when known."""
    budget = hw.gpu_memory_gib * (1 - margin)
    need = est.gpu_total / GiB
    if need > budget:
        phases = (est.peak_phase,) if est.peak_phase == "init" else ("resident", est.peak_phase)
        top = max(est.group("gpu"), key=lambda i: i.bytes if i.phase in phases else 0)
        where = {"train": "forward/backward", "step": "the optimizer step", "init": "engine start"}[est.peak_phase]
        return False, (
            f"GPU needs {need:.1f} GiB > {budget:.1f} GiB budget (peak at {where}; "
            f"largest item: {top.name} {top.bytes / GiB:.1f} GiB)"
        )
    if hw.host_memory_gib is not None:
        hbudget = hw.host_memory_gib * (1 - margin)
        hneed = est.host_per_node / GiB
        if hneed > hbudget:
            return False, f"host needs {hneed:.1f} GiB per node > {hbudget:.1f} GiB budget"
    return True, f"GPU {need:.1f} of {budget:.1f} GiB budget"


# The forward + backward rate the modes' measured step times (OptimMode.step_s_per_billion) are set against, from
# the same GPU: --fit's FLUX.1-dev run (mb 16, every block recomputed) took 3.01 s a step, 0.13 s of it the
# optimizer (benchmarks/RESULTS.md, "Full fine-tune at --fit's choice"): 2.88 s for 16 x 4/3 samples' worth of FLOPs.
# 3 x forward FLOPs per sample (flux-dev at 512 px: 21.50e12 by ModelConfig.flops_per_sample) x 4/3 (recompute):
_FWD_BWD_FLOPS_PER_S = 16 * (1 + 1 / 3) * 3 * 21.50e12 / 2.88  # ~478e12 FLOP/s


# Host <-> GPU bandwidth of pinned copies in each direction while both directions run (one block comes in as the
# last one's update goes out): --fit's speed proxy for streamed blocks (fluxzero.offload_blocks), as
# benchmarks/copy_bandwidth.py measures it on a PCIe 5 host (benchmarks/RESULTS.md, "Host <-> GPU copies")
PCIE_BYTES_PER_S = 44e9


STREAM_TOLERANCE = 0.9

# Why fp8-matmul beats the streamed bf16 base, as the reason text cites it. Measured on one NVIDIA H200, 2026-12-05,
# torch 2.11.0+cu130, deepspeed 0.19.8: `benchmarks/capped_runs.py --set fit --cases
# fit-lora16-512px-24gb-fp8mm,fit-lora16-512px-24gb --memory-cap-gib 23.6 --steps 12 --warmup 4` (FLUX.1-dev rank-16
# LoRA, 512 px, micro batch 8, every block checkpointed, allocator capped at 23.6 GiB): the fp8-matmul base (ZeRO-0,
# nothing streamed) 7.39 samples/s, peak 18.68 GiB allocated (predicted 18.60), host RSS 2.7 GiB; the bf16 base with
# its last 40 blocks streamed (what --fit writes for --gpu-memory 24) 6.31 samples/s, 18.92 GiB, host RSS 14.2 GiB.
FP8_MATMUL_MEASURED = (
    "measured 7.39 samples/s and 2.7 GiB host RSS against 6.31 and 14.2 GiB for the bf16 base with its last 40 "
    "blocks streamed (FLUX.1-dev rank-16 LoRA, 512 px, micro batch 8, every block checkpointed, 23.6 GiB cap; one "
    "NVIDIA H200, 2026-12-05, torch 2.11.0+cu130, deepspeed 0.19.8; benchmarks/RESULTS.md)"
)

# The share of a block's forward time that selective checkpointing recomputes: the pointwise ops and row reductions
# (norms, modulation, RoPE, GELU, gates), memory-bound next to the matmuls and attention it keeps. Assumed, for the
# throughput proxy's ranking; benchmarks/defaults_speed.py --cases policy measures the
# three policies' step times.
SELECTIVE_RECOMPUTE_SHARE = 0.1


def offload_choices(spec: RunSpec) -> tuple[int, ...]:
    """Streamed block counts --fit tries: 0 and every 4th up to all blocks for a fused mode, and for a plain LoRA on
    a base in the training dtype below ZeRO-3 (its frozen base streamed: measured 5.60 samples/s on a 16 GB cap,
    where the int8 base fits only micro batch 1, 1.58; benchmarks/RESULTS.md); else the spec's."""
    fused = spec.optimizer_mode is not None and optim_modes.get_mode(spec.optimizer_mode).fused
    plain_lora = spec.lora_rank and spec.lora_type == "lora" and not spec.base_quant and spec.stage < 3
    if not (fused or plain_lora):
        return (spec.offload_blocks,)
    n = spec.model.depth + spec.model.depth_single_blocks
    return tuple(sorted({0, n, *range(4, n, 4)}))


def throughput_proxy(spec: RunSpec) -> float:
    """Relative speed (samples/s on one H200-class GPU) of a (micro batch, checkpointing) choice at fixed stage,
    offload and optimizer mode.

    Recompute costs the forward of each checkpointed block again: a step is 3 forwards' worth of FLOPs,
    so time grows by (checkpointed fraction) / 3; selective checkpointing recomputes SELECTIVE_RECOMPUTE_SHARE of it. Small micro batches underfill the GEMMs and amortise
    per-micro-step overheads (ZeRO-3 gathers, launches) badly: efficiency tokens / (tokens + 2048). The optimizer
    step is paid once per micro batch here (no accumulation): a mode whose step is measured adds its time
    (OptimMode.step_s_per_billion over this rank's partition), so a small micro batch no longer looks free.
    Without the step term this proxy ranked bf16-sr at micro batch 4 without recompute above micro batch 16 with
    every block recomputed, which measured faster (benchmarks/RESULTS.md).
    """
    cfg = spec.model
    blocks = cfg.depth + cfg.depth_single_blocks
    frac = sum(checkpointed_split(cfg, spec.checkpoint_every, spec.offload_blocks)) / max(1, blocks)
    if spec.checkpoint_policy == "selective":  # streamed blocks are recomputed whole all the same
        streamed = min(spec.offload_blocks, blocks)
        frac = (frac * blocks - streamed) / max(1, blocks) * SELECTIVE_RECOMPUTE_SHARE + streamed / max(1, blocks)
    tokens = spec.micro_batch * (spec.img_tokens + spec.txt_len)
    per_sample = 3 * cfg.flops_per_sample(spec.img_tokens, spec.txt_len) / _FWD_BWD_FLOPS_PER_S
    compute = spec.micro_batch * per_sample * (1 + frac / 3) * (tokens + 2048) / tokens
    stepped = cfg.num_params() / (1 if spec.stage == 0 else spec.nodes * spec.gpus_per_node)
    gpu_step = spec.offload_optimizer == "none" and not spec.lora_rank
    rate = optim_modes.get_mode(spec.optimizer_mode).step_s_per_billion if spec.optimizer_mode else None
    step = (rate or 0.0) * stepped / 1e9 if gpu_step else 0.0
    # streamed blocks come in twice (forward, recompute) on one copy engine while the update goes out on the other,
    # one block ahead of the compute: the slower of the two sets the pace
    transfer = 2 * PRECISION_BYTES[spec.precision] * sum(streamed_blocks(spec)) / PCIE_BYTES_PER_S
    return spec.micro_batch / (max(compute, transfer) + step)


@dataclass
class FitResult:
    spec: RunSpec | None
    estimate: Estimate | None
    reason: str  # which constraint decided, in sentences
    # stage, offload_optimizer, offload_param, micro_batch, checkpoint_every, optimizer_mode
    options: dict = field(default_factory=dict)
    rejected: tuple[str, ...] = ()  # the reason's first lines: the faster rows passed over, and why


CHECKPOINT_CHOICES = (0, 8, 4, 2, 1)  # every k-th block: none, 1/8, 1/4, 1/2, all
# Optimizer modes --fit tries, best training quality first: None = DeepSpeed's own optimizer on fp32 masters (the
# reference), then the modes by their fit_rank (fluxzero.config.optim_modes, FIT_ORDER_NOTE says why that order)
FIT_MODES: tuple[str | None, ...] = (None, *optim_modes.fit_modes())
# The RunSpec fields fit can pin (`fixed`): what the user chose himself is kept, fit chooses the rest
FIT_PINS = (
    "stage",
    "offload_optimizer",
    "offload_param",
    "micro_batch",
    "checkpoint_every",
    "checkpoint_policy",
    "optimizer_mode",
    "base_quant",
    "offload_blocks",
)


def fit_grid(
    modes: tuple[str | None, ...] = (None,), fixed: dict | None = None, allow_nvme: bool = True
) -> list[tuple[int, str, str, str | None]]:
    """(stage, optimizer offload, parameter offload, optimizer mode) in the order fit tries them.

    No offload with fp32 masters first; then the bf16-master modes without offload (same speed, less
    training fidelity: each prints its caveat); then offload, which runs the optimizer step on the CPU and
    moves states over PCIe every step: at each offload choice fp32 masters (DeepSpeed's CPU Adam) first, then the
    host modes (cpu-*: bf16 masters, gradients and states in host memory, our AdamW on the CPU, slower than
    DeepSpeed's CPU Adam; the other bf16 modes never offload); NVMe last. Within a level the lowest stage first.
    """
    fixed = fixed or {}
    specs = {m: optim_modes.get_mode(m) for m in modes if m is not None}
    fp32_ok = None in modes or any(m.master_dtype == "fp32" for m in specs.values())
    host = [m for m in modes if m is not None and specs[m].needs_offload]
    rows = []
    for st, oo, op in STAGE_OFFLOAD_GRID:
        if oo == "none" and op == "none":
            continue
        if fp32_ok:
            rows.append((st, oo, op, None if None in modes else "fp32"))
        rows += [(st, oo, op, m) for m in host if oo == "cpu"]
    plain = [(st, oo, op) for st, oo, op in STAGE_OFFLOAD_GRID if oo == op == "none"]
    first = [(st, oo, op, m) for m in modes for st, oo, op in plain if m is None or specs[m].master_dtype == "fp32"]
    second = [
        (st, oo, op, m)
        for m in modes
        for st, oo, op in plain
        if m is not None and specs[m].master_dtype == "bf16" and not specs[m].needs_offload
    ]
    out = []
    for st, oo, op, m in first + second + rows:
        if (
            fixed.get("stage", st) != st
            or fixed.get("offload_optimizer", oo) != oo
            or fixed.get("offload_param", op) != op
            or (not allow_nvme and "nvme" in (oo, op))
        ):
            continue
        if m is not None and st not in specs[m].zero_stages:
            continue
        if (st, oo, op, m) not in out:
            out.append((st, oo, op, m))
    return out


def lora_grid(
    fixed: dict | None = None, allow_nvme: bool = True, quants: tuple[str | None, ...] = (None, "int8")
) -> list[tuple[int, str, str, str | None]]:
    """(stage, optimizer offload, parameter offload, base quantization) in the order fit tries them for a LoRA.

    The base in the training dtype without offload first (lowest stage first; ZeRO-3 partitions the frozen base
    over the GPUs); then a quantized base without offload (torchao weight-only int8: half the base's bytes, each
    weight dequantized for its matmuls, and the adapters' training off the bf16 base's by the quantization error);
    then parameter offload of the bf16 base, which moves the whole base over PCIe in forward, in recompute and in
    backward every step (slower than dequantizing); NVMe last. Optimizer offload alone is never tried: a
    LoRA's optimizer states are a few hundred MB.
    """
    fixed = fixed or {}
    rows = [(st, "none", "none", None) for st in (0, 1, 2, 3)]
    rows += [(st, "none", "none", q) for q in quants if q is not None for st in (0, 1, 2)]
    rows += [(3, "none", "cpu", None), (3, "cpu", "cpu", None), (3, "nvme", "nvme", None)]
    return [
        (st, oo, op, q)
        for st, oo, op, q in rows
        if (q in quants)
        and fixed.get("stage", st) == st
        and fixed.get("offload_optimizer", oo) == oo
        and fixed.get("offload_param", op) == op
        and (allow_nvme or "nvme" not in (oo, op))
    ]


def _row_label(st: int, oo: str, op: str, mode: str | None, quant: str | None) -> str:
    return zero_label(st, oo, op) + (f", optimizer mode {mode}" if mode else "") + (f", {quant} base" if quant else "")


def fit(
    base: RunSpec,
    hw: Hardware,
    margin: float = 0.10,
    max_micro_batch: int = 16,
    micro_batches: tuple[int, ...] | None = None,
    fixed: dict | None = None,
    zero_by_stage: dict[int, ZeroSettings] | None = None,
    allow_nvme: bool = True,
    modes: tuple[str | None, ...] = (None,),
    settings_for=None,
    quants: tuple[str | None, ...] = (None, "int8"),
) -> FitResult:
    """The fastest configuration of `base` that fits `hw` with `margin`, and why.

    Order (each level dominates the next; `fit_grid`, for a LoRA `lora_grid`): no offload with fp32 masters,
    then the optimizer `modes` with bf16 masters without offload (best quality first), then optimizer offload,
    then parameter offload, then NVMe -- offload runs the optimizer step on the CPU and moves states over PCIe
    every step, slower than any other choice here; then the lowest ZeRO stage -- stage 3 re-gathers every
    parameter in forward, again in backward (and in recompute), 1.5x the traffic of stages 1-2, and stage 1/2
    only add memory savings over 0; then, at that stage, the (micro batch, checkpointing) pair with the best
    `throughput_proxy` -- fewest checkpointed blocks unless a larger micro batch gains more, larger micro
    batch on ties. A LoRA (base.lora_rank) tries its base in the training dtype before a quantized one
    (`quants`), and compiled blocks wherever the trainer compiles a LoRA (below ZeRO-3).

    `fixed` pins any of stage, offload_optimizer, offload_param, micro_batch, checkpoint_every, optimizer_mode,
    base_quant (what the user chose himself); `zero_by_stage` gives the communication settings each stage will
    really be written with. `settings_for(stage, offload_optimizer, offload_param, mode)`, when given, returns
    the RunSpec fields of the very config that row would be written as (gen-config builds it and reads it back
    with run_options_from_ds_config), or raises ValueError when it cannot be written (the row is skipped with
    that reason): what is modelled is what is written.

    On a GPU with FP8 tensor cores (`hw.fp8_matmul`) a plain LoRA whose base quantization is not pinned gets the
    fp8-matmul base (nothing streamed) where the choice above streams blocks of the bf16 base, offloads its
    parameters, quantizes it weight-only (int8) or finds nothing, and the fp8-matmul base fits (against a streamed
    bf16 base: at no smaller micro batch, the measured comparison's terms, FP8_MATMUL_MEASURED). A bf16 base that
    fits whole stays: the reference numerics.
    """
    search = dict(
        margin=margin,
        max_micro_batch=max_micro_batch,
        micro_batches=micro_batches,
        fixed=fixed,
        zero_by_stage=zero_by_stage,
        allow_nvme=allow_nvme,
        modes=modes,
        settings_for=settings_for,
    )
    first = _fit(base, hw, quants=quants, **search)
    fixed = fixed or {}
    if (
        not hw.fp8_matmul
        or not base.lora_rank
        or base.lora_type != "lora"  # the trainer quantizes the base under a plain LoRA only
        or "base_quant" in fixed
        or fixed.get("offload_blocks")  # streaming pinned: the bf16 base
        or "fp8-matmul" in quants
    ):
        return first
    o = first.options
    if first.spec is None:
        over = "nothing else fitting (neither the bf16 nor a weight-only quantized base)"
    elif o["offload_blocks"]:
        over = f"the bf16 base with its last {o['offload_blocks']} blocks streamed from host memory"
    elif o["offload_param"] != "none":
        over = f"the bf16 base with parameter offload {o['offload_param']}"
    elif o["base_quant"]:
        over = f"the {o['base_quant']} base (weight-only, dequantized for each matmul)"
    else:
        return first  # the bf16 base fits whole
    why = (
        f"chosen on an FP8 GPU over {over}: {FP8_MATMUL_MEASURED}; --base-quant none keeps the bf16 base, "
        "--base-quant int8 the int8 base"
    )
    fp8 = _fit(base, hw, quants=("fp8-matmul",), quant_reason=why, **search)
    if fp8.spec is None or (o.get("offload_blocks") and fp8.spec.micro_batch < first.spec.micro_batch):
        return first
    return dataclasses.replace(fp8, reason="\n".join([*first.rejected, fp8.reason]))


def _fit(  # noqa: C901
    base: RunSpec,
    hw: Hardware,
    margin: float = 0.10,
    max_micro_batch: int = 16,
    micro_batches: tuple[int, ...] | None = None,
    fixed: dict | None = None,
    zero_by_stage: dict[int, ZeroSettings] | None = None,
    allow_nvme: bool = True,
    modes: tuple[str | None, ...] = (None,),
    settings_for=None,
    quants: tuple[str | None, ...] = (None, "int8"),
    quant_reason: str | None = None,
) -> FitResult:
    """fit's search over the rows of the base quantizations `quants`; `quant_reason` says why an unpinned quantized
    base was chosen (default: the bf16 base does not fit without parameter offload)."""
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    fixed = dict(fixed or {})
    unknown = set(fixed) - set(FIT_PINS)
    if unknown:
        raise ValueError(f"fit cannot pin {sorted(unknown)}")
    if "optimizer_mode" in fixed:
        modes = (fixed.pop("optimizer_mode"),)
    pinned_quant = "base_quant" in fixed
    if pinned_quant:
        quants = (fixed.pop("base_quant"),)
    base = base.replace(nodes=hw.nodes, gpus_per_node=hw.gpus_per_node)
    micros = micro_batches or tuple(m for m in (1, 2, 4, 8, 16, 32, 64, 128) if m <= max_micro_batch)
    if "micro_batch" in fixed:
        micros = (fixed["micro_batch"],)
    if not micros:
        raise ValueError("no micro batch to try: raise the largest micro batch allowed")
    ckpts = (fixed["checkpoint_every"],) if "checkpoint_every" in fixed else CHECKPOINT_CHOICES
    policies = (fixed["checkpoint_policy"],) if "checkpoint_policy" in fixed else CHECKPOINT_POLICIES
    if policies == ("selective",):  # a pinned selective policy needs blocks to checkpoint
        ckpts = tuple(k for k in ckpts if k) or (1,)
    if base.lora_rank:  # a LoRA steps a few hundred MB of adapters: DeepSpeed's AdamW unless a mode is pinned
        mode = modes[0] if len(modes) == 1 else None
        grid = [(st, oo, op, mode, q) for st, oo, op, q in lora_grid(fixed, allow_nvme, quants)]
    else:
        grid = [(st, oo, op, m, None) for st, oo, op, m in fit_grid(modes, fixed, allow_nvme)]
    rejected: list[tuple] = []
    closest = None  # (label, spec) of the last row rejected by memory: the grid's leanest that was estimated
    for st, oo, op, mode, quant in grid:
        label = _row_label(st, oo, op, mode, quant)
        precision = optim_modes.trained_precision(mode, base.precision)
        row = {
            "stage": st,
            "offload_optimizer": oo,
            "offload_param": op,
            "optimizer_mode": mode,
            "precision": precision,
            "zero": (zero_by_stage or {}).get(st, base.zero),
            "base_quant": quant,
        }
        if settings_for is not None:
            try:
                row.update(settings_for(st, oo, op, mode))
            except ValueError as e:
                rejected.append((st, oo, op, mode, quant, f"not written ({e})"))
                continue
        try:
            stage_base = base.replace(**row)
        except ValueError as e:
            rejected.append((st, oo, op, mode, quant, str(e)))
            continue
        fitting = []
        try:
            streams = (fixed["offload_blocks"],) if "offload_blocks" in fixed else offload_choices(stage_base)
            stage_base = stage_base.replace(offload_blocks=streams[0])
        except ValueError as e:
            rejected.append((st, oo, op, mode, quant, str(e)))
            continue
        for k in streams:  # fewest streamed blocks first: each one streamed costs transfers
            every = True
            pairs = [(c, p) for c in ckpts for p in (policies if c else ("full",))]
            if base.lora_rank and k and (1, "full") in pairs:
                pairs = [(1, "full")]  # a LoRA streams its base on a small card: every block recomputed anyway
            for ck, policy in pairs:
                for mb in micros:
                    cand = stage_base.replace(
                        micro_batch=mb, checkpoint_every=ck, checkpoint_policy=policy, offload_blocks=k
                    )
                    est = estimate(cand)
                    if not verdict(est, hw, margin)[0]:
                        every = False
                        break  # a larger micro batch will not fit either
                    fitting.append((throughput_proxy(cand), mb, -_ckpt_count(cand), -k, cand, est))
            if every:
                break  # all fit with fewer streamed blocks: streaming more is only slower
        if not fitting:
            smallest = stage_base.replace(
                micro_batch=micros[0],
                checkpoint_every=max(ckpts, key=_ckpt_rank),
                checkpoint_policy=policies[-1] if "full" not in policies else "full",
                offload_blocks=streams[-1],
            )
            _, why = verdict(estimate(smallest), hw, margin)
            closest = (label, smallest)
            rejected.append(
                (
                    st,
                    oo,
                    op,
                    mode,
                    quant,
                    f"even micro batch {micros[0]} with "
                    f"{checkpointing_text(smallest.checkpoint_every, smallest.checkpoint_policy)} does not fit "
                    f"({why})",
                )
            )
            continue
        # the fewest streamed blocks within STREAM_TOLERANCE of the fastest: what streaming costs is PCIE_BYTES_PER_S's
        # assumption, so more blocks on the host must buy a clear gain; then speed, micro batch, least recompute
        fastest = max(t[0] for t in fitting)
        _, mb, _, _, spec, est = max(
            (t for t in fitting if t[0] >= STREAM_TOLERANCE * fastest), key=lambda t: (t[3], *t[:3])
        )
        passed_over = _rejections(rejected)
        reason = [*passed_over, f"chose {label}: " + _why_choice(spec, est, hw, margin, micros, ckpts)]
        options = {
            "stage": st,
            "offload_optimizer": oo,
            "offload_param": op,
            "micro_batch": mb,
            "checkpoint_every": spec.checkpoint_every,
            "checkpoint_policy": spec.checkpoint_policy,
            "optimizer_mode": mode,
            "offload_blocks": spec.offload_blocks,
        }
        if base.lora_rank:
            options["base_quant"] = quant
        # Compiled blocks below ZeRO-3, written out so the JSON says what runs: measured faster for a FLUX.1-dev
        # LoRA (the same config eager and compiled) and, together with the loader defaults, for a full fine-tune
        # (benchmarks/RESULTS.md). The trainer refuses compile with a LoRA under ZeRO-3, and a full
        # fine-tune there is not measured compiled. Compiled kernels save no more for backward than eager ones,
        # so the estimate (eager) bounds them.
        options["compile"] = st < 3
        if options["compile"]:
            measured = (
                "a rank-16 FLUX.1-dev LoRA: 3.48 -> 4.65"
                if base.lora_rank
                else "a full fine-tune of flux-dev-lite: 11.5 -> 15.3"
            )
            reason.append(
                f"compiled blocks (fluxzero.compile.blocks): the trainer's default below ZeRO-3 ({measured} "
                f"samples/s measured)"
            )
        if quant is not None:
            needs = ", pip install -e '.[lowmem]'" if quant in WEIGHT_ONLY_QUANTS else "; needs an Ada or Hopper GPU"
            why = (
                "pinned by --base-quant"
                if pinned_quant
                else quant_reason or "the bf16 base does not fit without parameter offload, which is slower"
            )
            reason.append(
                f"{quant} base: set lora.base_quant: {quant} in the run file ({BASE_QUANT_MATMUL[quant]}{needs}); "
                f"{why}; the exported LoRA applies to the bf16 base"
            )
        if mode is not None:
            m = optim_modes.get_mode(mode)
            reason.append(
                f"optimizer mode {mode} ({m.optimizer}; {m.trajectory}'s trajectory): {m.caveat}"
                + (f"; needs pip install -e '.[{m.extra}]'" if m.extra else "")
            )
        if spec.offload_blocks:
            moved = stream_traffic(spec)
            reason.append(
                f"the last {spec.offload_blocks} blocks streamed from host memory (fluxzero.offload_blocks"
                f" {spec.offload_blocks}, recomputed in backward): per micro batch "
                + ", ".join(f"{what} {n / 1e9:.1f} GB" for what, n in moved)
            )
        return FitResult(spec, est, "\n".join(reason), options, tuple(passed_over))
    if not grid:
        return FitResult(None, None, "nothing to try: the pinned stage and offload choices contradict each other")
    return FitResult(None, None, _what_would_fit(base, hw, margin, micros[0], fixed, allow_nvme, rejected, closest))


def _rejections(rows: list[tuple]) -> list[str]:
    """One line per (offload, mode) group of rejected rows: "ZeRO-0, 1: ..." with each stage's reason, the
    common beginning ("even micro batch 1 with ... does not fit") said once."""
    groups: dict[tuple, list[tuple[int, str]]] = {}
    for st, oo, op, mode, quant, why in rows:
        groups.setdefault((oo, op, mode, quant), []).append((st, why))
    out = []
    for (oo, op, mode, quant), items in groups.items():
        label = _row_label(items[0][0], oo, op, mode, quant)
        if len(items) == 1:
            out.append(f"{label}: {items[0][1]}")
            continue
        head = label.replace(f"ZeRO-{items[0][0]}", "ZeRO-" + "/".join(str(st) for st, _ in items), 1)
        prefix = items[0][1].split(" (")[0] + " ("
        if all(why.startswith(prefix) for _, why in items):
            out.append(
                f"{head}: {prefix[:-2]}: " + "; ".join(f"ZeRO-{st}: {why[len(prefix) : -1]}" for st, why in items)
            )
        else:
            out.append(f"{head}: " + "; ".join(f"ZeRO-{st}: {why}" for st, why in items))
    return out


def _ckpt_rank(k: int) -> float:
    """Order checkpoint choices by memory saved: 1 (all) saves most, then 2, 4, ..., 0 (none) least."""
    return 0.0 if k == 0 else 1.0 / k


def _ckpt_count(spec: RunSpec) -> int:
    return sum(checkpointed_split(spec.model, spec.checkpoint_every, spec.offload_blocks))


def zero_label(stage: int, oo: str, op: str) -> str:
    """The ZeRO stage and its offloads in words ("ZeRO-2 with optimizer offload cpu")."""
    off = [f"optimizer offload {oo}"] if oo != "none" else []
    off += [f"parameter offload {op}"] if op != "none" else []
    return f"ZeRO-{stage}" + (f" with {', '.join(off)}" if off else " without offload")


def checkpointing_text(k: int, policy: str = "full") -> str:
    """Activation checkpointing of every k-th block with `policy`, in words ("every 2nd block checkpointed")."""
    sel = " selectively (matmul and attention outputs kept)" if policy == "selective" else ""
    if k in (0, 1):
        return {0: "no activation checkpointing", 1: f"every block checkpointed{sel}"}[k]
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"every {k}{suffix} block checkpointed{sel}"


def _best_micro(spec: RunSpec, hw: Hardware, margin: float, micros: tuple[int, ...]) -> RunSpec | None:
    best = None
    for mb in micros:
        cand = spec.replace(micro_batch=mb)
        if not verdict(estimate(cand), hw, margin)[0]:
            break
        best = cand
    return best


def _why_choice(
    spec: RunSpec,
    est: Estimate,
    hw: Hardware,
    margin: float,
    micros: tuple[int, ...],
    ckpts: tuple[int, ...] = CHECKPOINT_CHOICES,
) -> str:
    text = (
        f"micro batch {spec.micro_batch}, {checkpointing_text(spec.checkpoint_every, spec.checkpoint_policy)}; predicted "
        f"{est.gpu_allocated / GiB:.1f} GiB allocated, {est.gpu_total / GiB:.1f} GiB with allocator slack "
        f"and CUDA context, of {hw.gpu_memory_gib * (1 - margin):.1f} GiB budget "
        f"({hw.gpu_memory_gib:g} GiB - {margin:.0%} margin)"
    )
    bigger = [m for m in micros if m > spec.micro_batch]
    if bigger:
        fits, why = verdict(estimate(spec.replace(micro_batch=bigger[0])), hw, margin)
        text += f". Micro batch {bigger[0]} " + ("fits but is not faster" if fits else f"does not fit: {why}")
    else:
        text += f". Micro batch {spec.micro_batch} is the largest allowed"
    if spec.checkpoint_every and spec.checkpoint_policy == "full":  # keeping the matmul outputs: why not
        alt = _best_micro(spec.replace(checkpoint_policy="selective"), hw, margin, micros)
        text += (
            f". Selectively: not even micro batch {micros[0]} fits"
            if alt is None
            else f". Selectively: micro batch {alt.micro_batch} fits, estimated "
            f"{throughput_proxy(alt) / throughput_proxy(spec):.0%} of this speed"
        )
    # checkpointing fewer blocks: the best micro batch it allows, and why that is not better
    for k in sorted(
        (k for k in ckpts if _ckpt_rank(k) < _ckpt_rank(spec.checkpoint_every)), key=_ckpt_rank, reverse=True
    ):
        alt = _best_micro(spec.replace(checkpoint_every=k), hw, margin, micros)
        if alt is None:
            _, why = verdict(estimate(spec.replace(checkpoint_every=k, micro_batch=micros[0])), hw, margin)
            text += f". With {checkpointing_text(k)} not even micro batch {micros[0]} fits ({why})"
            break  # checkpointing still fewer blocks needs more memory still
        text += (
            f". With {checkpointing_text(k)} micro batch {alt.micro_batch} fits, estimated "
            f"{throughput_proxy(alt) / throughput_proxy(spec):.0%} of this speed"
        )
    return text


def _what_would_fit(  # noqa: C901
    base: RunSpec,
    hw: Hardware,
    margin: float,
    micro: int,
    fixed: dict | None = None,
    allow_nvme: bool = True,
    rejected: list[tuple] | None = None,
    closest=None,
) -> str:
    """Nothing fits: a few lines, what was closest and what would fit -- the pinned choice alone standing in
    the way, more GPUs, more host memory, NVMe, a lower resolution, a LoRA instead of a full fine-tune. Each
    says the flag to change; suggestions keep the pins and never use NVMe unless it is allowed."""
    fixed = fixed or {}
    budget = f"{hw.gpu_memory_gib * (1 - margin):.1f} GiB GPU budget"
    if hw.host_memory_gib is not None:
        budget += f" and {hw.host_memory_gib * (1 - margin):.1f} GiB host budget per node"
    lines = [
        f"nothing fits {base.world_size} GPU(s) of {hw.gpu_memory_gib:g} GiB ({budget}, {base.height}x{base.width} px)."
    ]
    if rejected:  # the last row tried is the leanest (offload, or NVMe when allowed)
        st, oo, op, mode, quant, why = rejected[-1]
        lines.append(f"The leanest tried, {_row_label(st, oo, op, mode, quant)}: {why}.")
    tips = []

    def fits(spec, hardware=hw) -> bool:
        return verdict(estimate(spec), hardware, margin)[0]

    lean = dict(micro_batch=micro, checkpoint_every=1)
    allowed = [(st, oo, op) for st, oo, op in STAGE_OFFLOAD_GRID if allow_nvme or "nvme" not in (oo, op)]
    pinned = [k for k in ("stage", "offload_optimizer", "offload_param") if k in fixed]
    if pinned:  # the pins may be all that stands in the way
        for st, oo, op in allowed:
            if _try(base, stage=st, offload_optimizer=oo, offload_param=op, **lean) and fits(
                _try(base, stage=st, offload_optimizer=oo, offload_param=op, **lean)
            ):
                tips.append(
                    f"{zero_label(st, oo, op)} instead of the pinned {', '.join(f'{k} {fixed[k]}' for k in pinned)}"
                )
                break
    zero3 = _try(base, stage=3, offload_optimizer="none", offload_param="none", base_quant=None, **lean)
    for gpus in (2, 4, 8, 16, 32, 64, 128, 256):
        if zero3 is None or gpus <= base.world_size:
            continue
        gpn = min(gpus, max(base.gpus_per_node, 8))
        r = zero3.replace(nodes=math.ceil(gpus / gpn), gpus_per_node=gpn)
        if fits(r, dataclasses.replace(hw, nodes=r.nodes, gpus_per_node=gpn)):
            tips.append(
                f"more GPUs: {r.world_size} ({r.nodes} node(s) x {gpn}) with ZeRO-3, micro batch {micro}, "
                f"every block checkpointed (--world-size {r.world_size}, or --nodes/--gpus-per-node)"
            )
            break
    # more host memory: the leanest host of the optimizer modes tried with both offloads (the host modes keep bf16
    # masters and small states there), so the --host-memory it names is one --fit then fits
    modes = list(dict.fromkeys(m for st, oo, op, m, _, _ in rejected or () if (st, oo, op) == (3, "cpu", "cpu")))
    leanest = None
    for mode in modes or [base.optimizer_mode]:
        r = _try(
            base, stage=3, offload_optimizer="cpu", offload_param="cpu", base_quant=None, optimizer_mode=mode, **lean
        )
        e = estimate(r) if r is not None else None
        if (
            e is not None
            and e.gpu_total / GiB <= hw.gpu_memory_gib * (1 - margin)
            and (leanest is None or e.host_per_node < leanest[1].host_per_node)
        ):
            leanest = (mode, e)
    if leanest is not None:
        mode, e = leanest
        leanest = (
            f"ZeRO-3 with CPU offload of parameters and optimizer{f', optimizer mode {mode}' if mode else ''}",
            e,
        )
    # a fused mode streaming blocks: the fewest streamed blocks that fit the GPU need the least host memory
    for mode in dict.fromkeys(m for _, _, _, m, _, _ in rejected or () if m and optim_modes.get_mode(m).fused):
        r = _try(
            base, stage=0, offload_optimizer="none", offload_param="none", base_quant=None, optimizer_mode=mode, **lean
        )
        for k in offload_choices(r) if r is not None else ():
            e = estimate(r.replace(offload_blocks=k))
            if e.gpu_total / GiB <= hw.gpu_memory_gib * (1 - margin):
                if leanest is None or e.host_per_node < leanest[1].host_per_node:
                    leanest = (f"ZeRO-0, optimizer mode {mode} with the last {k} blocks streamed from host memory", e)
                break
    if (
        leanest is not None
        and hw.host_memory_gib is not None
        and leanest[1].host_per_node / GiB > hw.host_memory_gib * (1 - margin)
    ):
        label, e = leanest
        need = math.ceil(e.host_per_node / GiB / (1 - margin))
        tips.append(f"more host memory: {label}, given {need} GiB of host memory per node (--host-memory {need})")
    nvme = _try(base, stage=3, offload_optimizer="nvme", offload_param="nvme", base_quant=None, **lean)
    if not allow_nvme and nvme is not None and fits(nvme):
        tips.append(
            "NVMe: ZeRO-3 with NVMe offload of parameters and optimizer (give a local NVMe folder with --nvme-path)"
        )
    keep_pins = [
        (st, oo, op)
        for st, oo, op in allowed
        if fixed.get("stage", st) == st
        and fixed.get("offload_optimizer", oo) == oo
        and fixed.get("offload_param", op) == op
    ]
    for px in (1024, 768, 512, 384, 256):
        if px * px >= base.height * base.width:
            continue
        r = next(
            (
                r
                for st, oo, op in keep_pins
                if (r := _try(base, height=px, width=px, stage=st, offload_optimizer=oo, offload_param=op, **lean))
                is not None
                and fits(r)
            ),
            None,
        )
        if r is not None:
            tips.append(
                f"a lower resolution: {px}x{px} px with {zero_label(r.stage, r.offload_optimizer, r.offload_param)}"
                f" (--resolution {px})"
            )
            break
    if not base.lora_rank:
        lora = fit(
            base.replace(lora_rank=16, lora_targets=DEFAULT_TARGETS),
            hw,
            margin,
            micro_batches=(micro,),
            allow_nvme=allow_nvme,
        )
        if lora.spec is not None:
            o = lora.options
            tips.append(
                f"a LoRA instead of a full fine-tune: rank 16 fits with "
                f"{_row_label(o['stage'], o['offload_optimizer'], o['offload_param'], None, o['base_quant'])}"
                f", predicted {lora.estimate.gpu_total / GiB:.1f} GiB (--lora-rank 16)"
            )
    if not tips:
        return "\n".join(lines + [_more_memory(closest, hw, margin)])
    return "\n".join(lines + ["It would fit with:"] + [f"  - {t}" for t in tips])


def _more_memory(closest: tuple[str, RunSpec] | None, hw: Hardware, margin: float) -> str:
    """The GPU and host memory the leanest row tried needs, each named only where it is short."""
    if closest is None:
        return "It would fit a larger GPU."
    label, spec = closest
    est = estimate(spec)
    needs = []
    if est.gpu_total / GiB > hw.gpu_memory_gib * (1 - margin):
        gpu = math.ceil(est.gpu_total / GiB / (1 - margin))
        card = next((name for name, gib in sorted(GPU_MEMORY_GIB.items(), key=lambda kv: kv[1]) if gib >= gpu), None)
        needs.append(f"a GPU of {gpu} GiB or more (--gpu-memory {gpu}{f', e.g. --gpu {card}' if card else ''})")
    if hw.host_memory_gib is not None and est.host_per_node / GiB > hw.host_memory_gib * (1 - margin):
        host = math.ceil(est.host_per_node / GiB / (1 - margin))
        needs.append(f"{host} GiB of host memory per node (--host-memory {host})")
    if not needs:
        return "It would fit a larger GPU."
    return (
        f"It would fit with {' and '.join(needs)}: {label}, micro batch {spec.micro_batch}, "
        f"{checkpointing_text(spec.checkpoint_every, spec.checkpoint_policy)}."
    )


def _try(base: RunSpec, **changes) -> RunSpec | None:
    """base.replace(**changes), or None where that run cannot be (a mode that cannot offload, say)."""
    try:
        return base.replace(**changes)
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------------------
# gen-config --fit: the search over the configs gen-config can write, and what it says
# ---------------------------------------------------------------------------------------------------------
# The gen-config options that set a fit pin (by their RunSpec fields, OPTION_FIELDS): what the user set himself is
# kept, --fit chooses the rest
GEN_CONFIG_PINS = {option: name for option, name in OPTION_FIELDS.items() if name in FIT_PINS}
# Host memory that common machines have per GPU: a 24 GB desktop card usually sits in a 64 GB machine, cloud
# GPU instances give 60-250 GB per GPU. Without --host-memory a choice that needs more says so on its last line.
COMMON_HOST_GIB_PER_GPU = 64
# --base-quant: the run file's lora.base_quant kinds, or auto: --fit chooses int8 for a LoRA when bf16 does not fit
# (fp8 is the same size with fewer mantissa bits, so --fit never prefers it), and on a GPU with FP8 tensor cores
# (Hardware.fp8_matmul) fp8-matmul where the bf16 base would be streamed or offloaded, or int8 chosen (fit,
# FP8_MATMUL_MEASURED); a bf16 base that fits whole stays, the reference numerics. Pinned, each is modelled as asked.
BASE_QUANT_CHOICES = ("auto", *BASE_QUANTS)


@dataclass(frozen=True)
class FitRequest:
    """What gen-config --fit is asked: the hardware, and the RunSpec fields of the run (height, width, txt_len,
    lora_rank, lora_targets: the image size and the LoRA, rank 0 a full fine-tune)."""

    hardware: Hardware
    run: dict = field(default_factory=dict)
    margin: float = 0.10
    max_micro_batch: int = 16
    base_quant: str = "auto"  # one of BASE_QUANT_CHOICES

    @property
    def lora_rank(self) -> int:
        return self.run.get("lora_rank", 0)


@dataclass
class GenConfigFit:
    """fit_gen_config's answer: `overrides` (DSOptions fields to write) when something fits, the lines to print
    (the choice, why, the predicted peak, host memory), and a last-line warning for an unchecked host."""

    result: FitResult
    overrides: dict
    lines: list[str]
    host_warning: str | None = None


def gen_config_zero(model: str, stage: int) -> ZeroSettings:
    """The communication settings `fluxzero gen-config` writes by default for this model and stage."""
    try:
        return ZeroSettings.from_ds_config(ds_config.build(ds_config.options_from(None, model=model, zero_stage=stage)))
    except ds_config.DSConfigError:
        return ZeroSettings()


def fit_gen_config(opts, given: dict, req: FitRequest) -> GenConfigFit:  # noqa: C901
    """Run --fit over the configs gen-config can write from `opts` (a DSOptions with the user's options
    applied; `given`: the fields the user gave, pinned). Raises ValueError (one sentence) for a request that
    cannot be searched; result.spec is None when nothing fits (the lines then say what would)."""
    hw = req.hardware
    world = hw.nodes * hw.gpus_per_node

    def row_options(stage, oo, op, mode):
        """The gen-config options of one fit row: what --fit writes if it chooses that row."""
        impl = given.get("adam_impl", opts.adam_impl)
        if "adam_impl" not in given:  # DeepSpeed's CPU Adam only with optimizer offload, never without
            impl = adam_impl.impl_for_offload(impl, oo)
        if mode is not None:
            impl = "torch"  # the mode's client optimizer replaces DeepSpeed's AdamW
        nvme = "nvme" in (oo, op)
        fused = mode is not None and optim_modes.get_mode(mode).fused
        extra = {"gradient_clipping": 0.0} if fused and "gradient_clipping" not in given else {}
        return opts.replace(
            zero_stage=stage,
            offload_optimizer=oo,
            offload_param=op,
            optimizer_mode=mode,
            adam_impl=impl,
            nvme_path=opts.nvme_path if nvme else None,
            offload_blocks=opts.offload_blocks if fused else 0,
            **extra,
        )

    def settings_for(stage, oo, op, mode) -> dict:
        """RunSpec fields of the very config that row writes, read back as `estimate --ds-config` reads it."""
        try:
            cfg = ds_config.build(row_options(stage, oo, op, mode))
        except DSConfigError as e:  # a row the combination rules refuse (fp8 at ZeRO-3): not written
            raise ValueError("; ".join(e.problems)) from None
        fields = run_options_from_ds_config(cfg, world)
        return {
            k: v
            for k, v in fields.items()
            if k not in ("micro_batch", "checkpoint_every", "checkpoint_policy", "offload_blocks")
        }

    micros = None
    if opts.global_batch is not None:
        micros = tuple(
            m
            for m in (1, 2, 4, 8, 16, 32, 64, 128)
            if m <= req.max_micro_batch and opts.global_batch % (m * world) == 0
        )
        if not micros:
            raise ValueError(
                f"no micro batch up to {req.max_micro_batch} divides global batch {opts.global_batch} over {world} GPUs"
            )
    pins = {GEN_CONFIG_PINS[k]: v for k, v in given.items() if k in GEN_CONFIG_PINS}
    if opts.checkpoint_impl == "deepspeed":  # deepspeed.checkpointing recomputes whole blocks only
        pins.setdefault("checkpoint_policy", "full")
    if req.base_quant != "auto":
        if req.base_quant != "none" and not req.lora_rank:
            raise ValueError(f"--base-quant {req.base_quant} quantizes the frozen base of a LoRA: add --lora-rank")
        pins["base_quant"] = None if req.base_quant == "none" else req.base_quant
    # a given --adam-impl decides the optimizer offload: DeepSpeed builds FusedAdam only without it and its
    # CPU Adam only with it; it also rules out the optimizer modes (their client optimizer replaces it)
    modes = FIT_MODES
    if given.get("adam_impl") in ("fused", "cpu"):
        modes = (None,)
    if given.get("adam_impl") == "fused":
        pins.setdefault("offload_optimizer", "none")
    elif given.get("adam_impl") == "cpu" and "offload_optimizer" not in pins:
        pins["offload_optimizer"] = "nvme" if opts.nvme_path and pins.get("stage") == 3 else "cpu"
    base = RunSpec(
        get_model_config(opts.model),
        precision=opts.precision,
        optimizer_impl=adam_impl.optimizer_impl(opts.adam_impl),
        **req.run,
    )
    result = fit(
        base,
        hw,
        margin=req.margin,
        max_micro_batch=req.max_micro_batch,
        micro_batches=micros,
        fixed=pins,
        allow_nvme=opts.nvme_path is not None,
        modes=modes,
        settings_for=settings_for,
    )
    # gen-config often runs off the training nodes, so this machine's memory is no default: without
    # --host-memory the host is not checked, and the host memory the choice needs is printed beside it
    host = hw.host_memory_gib
    notes = (
        []
        if host is not None
        else ["host memory not given: not checked (pass --host-memory with the training nodes' memory per node)"]
    )
    if result.spec is None:
        return GenConfigFit(result, {}, notes + result.reason.split("\n"))
    need = result.estimate.host_per_node / GiB
    host_line = f"host memory: the choice needs {need:.1f} GiB per node" + (
        f" of {host * (1 - req.margin):.1f} GiB budget" if host is not None else " (not checked: pass --host-memory)"
    )
    warning = None
    common = COMMON_HOST_GIB_PER_GPU * hw.gpus_per_node
    if host is None and need > common:
        warning = (
            f"warning: this config needs {need:.0f} GiB of host memory per node, more than the {common} GiB "
            f"common machines have for {hw.gpus_per_node} GPU(s); pass --host-memory with yours to fit "
            f"within it"
        )
    o = result.options
    chosen = row_options(o["stage"], o["offload_optimizer"], o["offload_param"], o["optimizer_mode"])
    out = {theirs: o[ours] for theirs, ours in GEN_CONFIG_PINS.items()}
    out["adam_impl"] = chosen.adam_impl
    if chosen.gradient_clipping != opts.gradient_clipping:  # a fused mode cannot clip (row_options)
        out["gradient_clipping"] = chosen.gradient_clipping
    if o.get("compile") is not None and "compile" not in given:
        out["compile"] = o["compile"]
    return GenConfigFit(result, out, notes + result.reason.split("\n") + [host_line], warning)
