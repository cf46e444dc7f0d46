"""Optimizer modes for a full fine-tune: each one object (OptimMode) that says what it keeps per parameter and
where, what DeepSpeed needs, which ZeRO stages and offload it runs with, its caveat, where --fit tries it and which
builder makes it (pure).

No torch import: gen-config (fluxzero.config.deepspeed.build), the checker (ds_check), the memory model
(memory/model_states.py, memory/fit.py) read this registry; `fluxzero.train.optim.optimizers.build_optimizer` builds each
mode through `BUILDERS[mode.builder]`. Adding a mode is an entry in MODES (and a builder there when no existing
one fits). The DeepSpeed behaviour behind the fields below was measured with real engines (see the
DEEPSPEED_FINDINGS table in fluxzero.train.optim.optimizers's docstring).

Bytes are per trained parameter, steady state, for one data-parallel rank before ZeRO partitioning divides
`grads` (stage 2-3), `master` and `states` (stage 1-3) and `weights` (stage 3) by the world size.
  weights  the bf16 copy the forward pass reads
  grads    the gradient DeepSpeed keeps (bf16 under `bf16.enabled`; 0 for a fused mode, which steps and drops each
           gradient in backward)
  master   the tensor the optimizer steps when it is not `weights` itself (fp32 masters, or DeepSpeed's own
           bf16 flat partition under bf16_master_weights_and_grads: measured not to alias the weights); at
           ZeRO 0 with bf16 off the bf16 modes step the weights themselves (master 0)
  states   optimizer states (AdamW m and v, Kahan carry, 8-bit blocks with their fp32 scales, Adafactor rows)
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Elements of a flat tensor (ZeRO 1-3 hand the optimizer one per rank and group) that the eager bf16 optimizers
# (`step_chunk` below) do their fp32 math on at once: 2^24 x their ~30 B of temporaries per element is 0.5 GiB,
# whatever the partition size, and 715 chunks for FLUX.1-dev's 12B parameters keep the launches few.
STEP_CHUNK = 1 << 24

# DeepSpeed "bf16" section keys that make ZeRO 1-3 hand the client optimizer bf16 partitions (0.19.8)
BF16_MASTER_KEYS = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
# The host modes (optimizer_offload "cpu", fluxzero.train.optim.host) step a partition this many elements at a
# time, so their fp32 temporaries are bounded whatever the partition; a multiple of QUANT_BLOCK
HOST_STEP_CHUNK = 1 << 22
QUANT_BLOCK = 256  # values per fp32 scale of the 8-bit states (torchao's AdamW8bit default block)


@dataclass(frozen=True)
class OptimMode:
    name: str
    optimizer: str  # what build_optimizer returns, in words
    weights: float
    grads: float
    master: float
    states: float
    master_dtype: str  # dtype of the tensors the optimizer steps: "fp32" or "bf16"
    zero_stages: tuple[int, ...]  # stages where the mode trains as intended
    ds_bf16: dict = field(default_factory=dict)  # the DeepSpeed "bf16" section it needs at ZeRO 1-3
    stage0: str = ""  # how it runs at ZeRO stage 0
    extra: str | None = None  # pip extra of fluxzero that brings the package it needs
    caveat: str = ""  # one line on training quality
    master_stage0: float | None = None  # master at ZeRO 0 when it differs (bf16 modes: the weights themselves)
    states_flat: float | None = None  # states at ZeRO 1-3 when flat partitions change them (None: same)
    trainable: bool = True  # False: comparison only, refused for training
    step_chunk: int | None = None  # a flat (1-D) tensor is stepped this many elements at a time; None: whole
    # seconds one optimizer step takes per 1e9 stepped elements on the GPU --fit's speed proxy models
    # (benchmarks/optim_step_speed.py measures it; figures in benchmarks/RESULTS.md); None: not measured. The
    # proxy pays it once per micro batch.
    step_s_per_billion: float | None = None
    where: str = "all on the accelerator"
    # "cpu": steps DeepSpeed's offloaded bf16 partitions in host memory, so it needs optimizer offload to cpu
    # (fluxzero.train.optim.host); "none": runs where ZeRO keeps the partitions, offload refused for bf16 masters
    optimizer_offload: str = "none"
    # True: each parameter is stepped during backward as soon as its gradient is complete (fluxzero.train.
    # optim.fused_step), so no whole-model gradient buffer exists (`grads` 0: one tensor's gradient at a time) and the
    # weights of the last fluxzero.offload_blocks blocks may live in host memory (fluxzero.train.block_stream)
    fused: bool = False
    trajectory: str = "AdamW"  # the update rule it follows, as --fit names it: "AdamW" or "Adafactor"
    # False: its optimizer states cannot be split per parameter, which DeepSpeed's universal checkpoint
    # (checkpoint.load_universal, a resume at another world size) needs; such a config is refused up front
    universal_checkpoint: bool = True
    # gen-config's defaults for a full fine-tune in this mode where DSOptions' (AdamW's) would not train: lr,
    # weight_decay; an option given on the command line, and a LoRA's defaults, win
    defaults: dict = field(default_factory=dict)
    # the key of fluxzero.train.optim.optimizers.BUILDERS that builds its optimizer
    builder: str = ""
    # True: its optimizer class is torch.optim.AdamW, one deepspeed 0.19.8's ZeRO supports (ZERO_SUPPORTED_OPTIMIZERS);
    # the others' classes need zero_allow_untested_optimizer at ZeRO 1-3
    zero_tested: bool = False
    # transient bytes per stepped element of one optimizer step beyond its states (STEP_TEMP_NOTE); None: a host
    # mode, whose chunked step the memory model counts itself
    step_temp: float | None = None
    # place in --fit's order after DeepSpeed's AdamW on fp32 masters (FIT_ORDER_NOTE): lower is tried first;
    # None: --fit never chooses it
    fit_rank: int | None = None

    @property
    def offload_ok(self) -> bool:
        """Whether it runs with DeepSpeed's optimizer offload: fp32 masters (DeepSpeed's own CPU Adam, or a client
        optimizer on fp32 partitions) and the host modes; the other bf16-master modes step on the accelerator."""
        return self.master_dtype == "fp32" or self.optimizer_offload == "cpu"

    @property
    def needs_offload(self) -> bool:
        return self.optimizer_offload == "cpu"

    def __post_init__(self):
        if self.master_dtype not in ("fp32", "bf16"):
            raise ValueError(f"optimizer mode {self.name!r}: master_dtype must be 'fp32' or 'bf16'")
        if not set(self.zero_stages) <= {0, 1, 2, 3}:
            raise ValueError(f"optimizer mode {self.name!r}: zero_stages must be within 0-3")
        if self.fused and self.zero_stages != (0,):
            raise ValueError(f"optimizer mode {self.name!r}: a fused mode runs at ZeRO stage 0 only")
        if self.optimizer_offload not in ("none", "cpu"):
            raise ValueError(f"optimizer mode {self.name!r}: optimizer_offload must be 'none' or 'cpu'")
        if not self.builder:
            raise ValueError(
                f"optimizer mode {self.name!r}: name its builder (fluxzero.train.optim.optimizers.BUILDERS)"
            )
        if (self.step_temp is None) != self.needs_offload:
            raise ValueError(f"optimizer mode {self.name!r}: step_temp is given for every mode but the host ones")

    @property
    def total(self) -> float:
        """Bytes per parameter at ZeRO 1-3 before partitioning (ZeRO 0: see `bytes_at`)."""
        return sum(self.bytes_at(1).values())

    def bytes_at(self, stage: int) -> dict[str, float]:
        """{weights, grads, master, states} bytes per parameter at `stage`, before partitioning."""
        zero0 = stage == 0
        master = self.master_stage0 if zero0 and self.master_stage0 is not None else self.master
        states = self.states_flat if not zero0 and self.states_flat is not None else self.states
        return {"weights": self.weights, "grads": self.grads, "master": master, "states": states}

    def ds_bf16_section(self, stage: int) -> dict:
        """The DeepSpeed "bf16" section for this mode at `stage` ({} = bf16 off: the model is cast by us)."""
        if stage not in self.zero_stages:
            raise ValueError(
                f"optimizer mode {self.name!r} does not run at ZeRO stage {stage}; "
                f"use stage {' or '.join(map(str, self.zero_stages))}"
            )
        if self.master_dtype == "fp32":
            return {"enabled": True}
        return dict(self.ds_bf16) if stage > 0 else {}


# One optimizer step over FLUX.1-dev's 11.90e9 bf16 weights on the GPU the speed proxy models, seconds
# (optim_step_speed.py; benchmarks/RESULTS.md, "Full fine-tune at --fit's choice, the optimizer step"):
# bf16-kahan is one compiled kernel per tensor, bf16-sr torchao's. adamw8bit-sr is not measured: torchao's same
# compiled per-tensor step with 8-bit states, taken at bf16-sr's figure. AdafactorSR (fused-adafactor-sr, and
# adafactor-sr, the same per-tensor step after backward): what --fit's four full fine-tunes at 512 px took per step
# beyond the proxy's compute (benchmarks/RESULTS.md, "--fit's full fine-tunes on the cards users own"), with the
# step running eagerly.
_STEP_S = {
    m: s / 11.90
    for m, s in (
        ("bf16-kahan", 0.131),
        ("bf16-sr", 0.467),
        ("adamw8bit-sr", 0.467),
        ("adafactor-sr", 1.14),
        ("fused-adafactor-sr", 1.14),
    )
}

# STEP_TEMP_NOTE: transient bytes per stepped element of one optimizer step beyond its states, on one flat 1-D
# tensor as ZeRO 1-3 hand it: measured on CPU by benchmarks/optim_step_memory.py (peak RSS over the steady state,
# 5e7 elements). fp32: torch.optim.AdamW(foreach=False), sqrt then divide (two fp32 temporaries at once); the
# torchao modes (bf16-sr, adamw8bit-sr) run one torch.compile'd kernel per tensor (upper bound: the first step's
# peak, compile included; the second step's is under 0.1 B); ours do their math in eager fp32, a mode's
# `step_chunk` elements of a flat tensor at a time, so these bytes are per element of one chunk: the larger of two
# runs (a 5e7 tensor in 2^24 chunks, the peak 385 / 478 MiB for bf16-kahan, 523 / 459 MiB for adafactor-sr:
# glibc's reuse of freed chunks moves it); 27 B per element for a whole 5e7 tensor, as shaped tensors are stepped
# at ZeRO 0. On CUDA bf16-kahan's update is one compiled kernel per tensor and holds none of these: an upper bound.
_ADAMW_TEMP, _TORCHAO_TEMP, _KAHAN_TEMP, _ADAFACTOR_TEMP = 8.0, 0.7, 30.0, 33.0

# FIT_ORDER_NOTE: --fit tries the bf16 modes by training quality first: docs/optimizer-modes.md's measured distance
# from fp32 masters (weight change off by 0.05% bf16-kahan, 3.0% adamw8bit-sr, 4.4% bf16-sr); the Adafactor
# modes after them (not AdamW's trajectory), fused-adafactor-sr before adafactor-sr so that it wins wherever it
# fits a larger micro batch (no gradient buffer, blocks streamed from the host when the GPU is short); the host
# modes last (the step runs on the CPU).

# 8-bit AdamW: two uint8 states plus one fp32 scale per 256-value block each (torchao's default block)
_ADAMW8BIT_STATES = 2 * (1 + 4 / QUANT_BLOCK)

# Adafactor's lr is relative (torch.optim.Adafactor, AdafactorSR): a tensor's step is at most lr x RMS(tensor)
# (Adafactor clips the update's RMS to 1 before scaling it), where AdamW's is about lr itself. FLUX.1 fine-tunes
# with Adafactor step each weight by about 1e-5..5e-5 (kohya sd-scripts' flux_train.py example: Adafactor with
# relative_step=False, scale_parameter=False, so lr is the step itself, --learning_rate 5e-5; its AdamW example
# 1e-5); FLUX.1's block linears are 3072 or more wide, RMS about 1/sqrt(3072) = 0.018, so lr 1e-3 steps them
# ~2e-5. AdamW's 1e-5 here would step them ~2e-7: the weights barely move. Weight decay multiplies every weight by
# 1 - lr x wd a step, 100-fold AdamW's at this lr, so it is off (sd-scripts' Adafactor runs without it too).
_ADAFACTOR_DEFAULTS = {"lr": 1e-3, "weight_decay": 0.0}

_STAGE0_BF16 = (
    "bf16 off in the DeepSpeed config and the model cast to bf16 by us: the engine steps the "
    "client optimizer on the model's own bf16 parameters (no master copy, shapes kept)"
)

MODES: dict[str, OptimMode] = {
    m.name: m
    for m in (
        OptimMode(
            "fp32",
            "torch.optim.AdamW on DeepSpeed's fp32 masters",
            weights=2,
            grads=2,
            master=4,
            states=8,
            master_dtype="fp32",
            zero_stages=(0, 1, 2, 3),
            stage0="bf16 on: DeepSpeed's bf16 wrapper keeps per-tensor fp32 masters",
            where="accelerator; DeepSpeed's optimizer offload (its CPU Adam) can put master and states on CPU",
            caveat="the reference: every update is kept",
            builder="AdamW",
            zero_tested=True,
            step_temp=_ADAMW_TEMP,
        ),
        OptimMode(
            "bf16-rtn",
            "torch.optim.AdamW on bf16 tensors, round-to-nearest",
            weights=2,
            grads=2,
            master=2,
            states=4,
            master_dtype="bf16",
            zero_stages=(0, 1, 2, 3),
            ds_bf16=BF16_MASTER_KEYS,
            stage0=_STAGE0_BF16,
            master_stage0=0,
            caveat="loses updates below half a bf16 ulp: at lr 1e-5 the weights barely move",
            trainable=False,
            builder="AdamW",
            zero_tested=True,
            step_temp=_ADAMW_TEMP,
        ),
        OptimMode(
            "bf16-sr",
            "torchao _AdamW(bf16_stochastic_round=True), bf16 m and v",
            weights=2,
            grads=2,
            master=2,
            states=4,
            master_dtype="bf16",
            zero_stages=(0, 1, 2, 3),
            ds_bf16=BF16_MASTER_KEYS,
            stage0=_STAGE0_BF16,
            master_stage0=0,
            step_s_per_billion=_STEP_S["bf16-sr"],
            extra="lowmem",
            caveat="unbiased weight updates, but torchao rounds bf16 m and v to nearest: v's "
            "EMA stalls and steps come out a few % larger (+4.4% weight change "
            "measured at 400 steps)",
            builder="torchao._AdamW",
            step_temp=_TORCHAO_TEMP,
            fit_rank=3,
        ),
        OptimMode(
            "bf16-kahan",
            "KahanAdamW (ours): bf16 m, v and Kahan carry",
            weights=2,
            grads=2,
            master=2,
            states=6,
            master_dtype="bf16",
            zero_stages=(0, 1, 2, 3),
            ds_bf16=BF16_MASTER_KEYS,
            stage0=_STAGE0_BF16,
            master_stage0=0,
            step_chunk=STEP_CHUNK,
            step_s_per_billion=_STEP_S["bf16-kahan"],
            caveat="the carry keeps every weight update and m, v are stochastically rounded: closest to fp32 "
            "masters (0.05% at 400 steps), at 2 bytes more than bf16-sr",
            builder="KahanAdamW",
            step_temp=_KAHAN_TEMP,
            fit_rank=1,
        ),
        OptimMode(
            "adamw8bit-sr",
            "torchao AdamW8bit(bf16_stochastic_round=True)",
            weights=2,
            grads=2,
            master=2,
            states=_ADAMW8BIT_STATES,
            master_dtype="bf16",
            zero_stages=(0, 1, 2, 3),
            ds_bf16=BF16_MASTER_KEYS,
            stage0=_STAGE0_BF16,
            master_stage0=0,
            extra="lowmem",
            step_s_per_billion=_STEP_S["adamw8bit-sr"],
            universal_checkpoint=False,  # 8-bit blocks slice only at 256 values (train.ds_patches.keep_block_states_whole)
            caveat="8-bit blockwise m and v; a tensor (ZeRO: a flat partition) under 4096 values or not a "
            "multiple of 256 keeps bf16 states instead",
            builder="torchao.AdamW8bit",
            step_temp=_TORCHAO_TEMP,
            fit_rank=2,
        ),
        OptimMode(
            "adafactor-sr",
            "AdafactorSR (ours): torch.optim.Adafactor's algorithm, stochastic rounding",
            weights=2,
            grads=2,
            master=2,
            states=0.0,
            states_flat=2,
            master_dtype="bf16",
            zero_stages=(0, 1, 2, 3),
            ds_bf16=BF16_MASTER_KEYS,
            stage0=_STAGE0_BF16,
            master_stage0=0,
            step_chunk=STEP_CHUNK,
            trajectory="Adafactor",
            defaults=_ADAFACTOR_DEFAULTS,
            caveat="no momentum and relative step sizes: not AdamW's trajectory; factored only at ZeRO 0 "
            "(ZeRO 1-3 flatten tensors, so its variance becomes full-size)",
            builder="AdafactorSR",
            step_s_per_billion=_STEP_S["adafactor-sr"],
            step_temp=_ADAFACTOR_TEMP,
            fit_rank=5,
        ),
        # Fused into backward: AdafactorSR's step per tensor in a post-accumulate-grad hook, no gradient buffer
        OptimMode(
            "fused-adafactor-sr",
            "FusedAdafactorSR (ours): AdafactorSR stepped per tensor during backward",
            weights=2,
            grads=0,
            master=2,
            states=0.0,
            master_dtype="bf16",
            zero_stages=(0,),
            stage0=_STAGE0_BF16 + "; each tensor stepped in backward (no gradient buffer), the last "
            "fluxzero.offload_blocks blocks streamed from host memory",
            master_stage0=0,
            fused=True,
            trajectory="Adafactor",
            step_chunk=STEP_CHUNK,
            defaults=_ADAFACTOR_DEFAULTS,
            where="accelerator; with fluxzero.offload_blocks K the bf16 weights of the last K blocks in pinned "
            "host memory, streamed to the accelerator one block ahead",
            caveat="Adafactor's trajectory (adafactor-sr's, stepped per tensor with keyed rounding noise); no "
            "gradient accumulation and no global-norm clipping (Adafactor clips each update's RMS)",
            builder="FusedAdafactorSR",
            step_s_per_billion=_STEP_S["fused-adafactor-sr"],
            step_temp=_ADAFACTOR_TEMP,
            fit_rank=4,
        ),  # AdafactorSR's code, per tensor
        # On the host: DeepSpeed's optimizer offload with bf16 master partitions and gradients, stepped by HostAdamW
        OptimMode(
            "cpu-bf16-sr",
            "HostAdamW (ours) on the host: bf16 m and v, stochastic rounding",
            weights=2,
            grads=2,
            master=2,
            states=4,
            master_dtype="bf16",
            zero_stages=(1, 2, 3),
            ds_bf16=BF16_MASTER_KEYS,
            optimizer_offload="cpu",
            where="master, gradients and states in host memory (optimizer offload cpu)",
            # a universal-checkpoint load gives HostAdamW m, v and step but not its rounding stream (sr_stream), which
            # a step needs: DeepSpeed's loader knows only torch's Adam keys
            universal_checkpoint=False,
            caveat="m, v and weights stochastically rounded: within 1% of fp32 masters at 400 steps; the step "
            "runs on the CPU",
            builder="HostAdamW",
            fit_rank=6,
        ),
        OptimMode(
            "cpu-adamw8bit-sr",
            "HostAdamW (ours) on the host: 8-bit m and v (torchao's format), stochastic rounding",
            weights=2,
            grads=2,
            master=2,
            states=_ADAMW8BIT_STATES,
            master_dtype="bf16",
            zero_stages=(1, 2, 3),
            ds_bf16=BF16_MASTER_KEYS,
            optimizer_offload="cpu",
            extra="lowmem",
            where="master, gradients and 8-bit states in host memory (optimizer offload cpu)",
            # DeepSpeed's ds_to_universal reads each partition's exp_avg / exp_avg_sq, which 8-bit codes and scales are not
            universal_checkpoint=False,
            caveat="8-bit blockwise m and v: a few % from fp32 masters, 2 B/param less host memory than "
            "cpu-bf16-sr; the step runs on the CPU",
            builder="HostAdamW8bit",
            fit_rank=7,
        ),
    )
}


def trainable_modes() -> tuple[str, ...]:
    """The modes a run may use (not the comparison-only ones)."""
    return tuple(n for n, m in MODES.items() if m.trainable)


def fit_modes() -> tuple[str, ...]:
    """The modes --fit tries, in its order (FIT_ORDER_NOTE)."""
    return tuple(
        m.name for m in sorted((m for m in MODES.values() if m.fit_rank is not None), key=lambda m: m.fit_rank)
    )


def trainer_casts_to_bf16(mode_name: str | None, stage: int) -> bool:
    """A bf16-master optimizer mode at ZeRO 0: bf16 is off in the DeepSpeed config (DeepSpeed's bf16 wrapper would
    keep fp32 masters), so the model is born in bf16, cast by the trainer, and the client optimizer steps those
    weights themselves. The one statement of this rule: DSView, the memory model and the trainer call it."""
    mode = MODES.get(mode_name) if isinstance(mode_name, str) else None
    return mode is not None and mode.master_dtype == "bf16" and stage == 0 and stage in mode.zero_stages


def trained_precision(mode_name: str | None, precision: str) -> str:
    """The precision a run trains in: bf16 under a bf16-master mode (its masters are the model's weights), else
    `precision`. ValueError for an unknown mode."""
    return "bf16" if mode_name is not None and get_mode(mode_name).master_dtype == "bf16" else precision


def get_mode(name: str) -> OptimMode:
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown optimizer mode {name!r}; choose one of: {', '.join(MODES)}") from None
