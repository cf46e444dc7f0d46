"""The run the memory model describes: byte constants, FLUX.1's parameter inventory, RunSpec (everything a
step's memory depends on), what a DeepSpeed config decides of it, and one line of the breakdown (Item).

Pure Python (no torch, no deepspeed).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from fluxzero.config import architecture, optim_modes
from fluxzero.config.architecture import linear_shapes
from fluxzero.config.deepspeed import view as ds_view
from fluxzero.config.deepspeed.adam_impl import OPTIMIZER_IMPLS
from fluxzero.config.deepspeed.check import CHECKPOINT_POLICIES, OFFLOAD_DEVICES
from fluxzero.config.ema import EmaConfig
from fluxzero.config.lora import DEFAULT_TARGETS, LoraConfig, lora_param_count
from fluxzero.config.models import ModelConfig, get_model_config
from fluxzero.dtypes import BYTES

GiB = 1024**3
PHASES = ("train", "step", "init")

PRECISION_BYTES = BYTES  # bytes per value of each training precision (fluxzero.dtypes)
# The caching allocator's reserve beyond the allocated peak, as a fraction of the per-step transients, by ZeRO
# stage (1 and 2 share one): refitted by benchmarks/fragmentation_fit.py (Estimate.fragmentation says on which runs)
FRAGMENTATION = {0: 0.19, 1: 0.33, 2: 0.33, 3: 0.8}
# fp32 optimizer states per parameter (Adam/AdamW: exp_avg + exp_avg_sq; SGD with momentum, Lion: one buffer)
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "lion": 4, "sgd": 4}
# estimate's --attention: what the model tells apart (flash / efficient: O(L) softmax statistics; math: O(L^2));
# a run file's auto and cudnn are read as flash
ATTENTION_KERNELS = ("flash", "efficient", "math")
# A quantized frozen LoRA base (the run file's lora.base_quant, one of config.lora.BASE_QUANTS): bytes per weight
# element of every nn.Linear of the base (int8, and fp8 / fp8-matmul e4m3), and per output channel its scale and
# zero point (an upper bound: int8 keeps an fp32 scale and an int8 zero point, fp8 and fp8-matmul an fp32 scale).
# Biases, norm scales and the adapters stay in the training dtype. Every quantized kind the run file accepts has
# a row here (tests/config/test_shared_facts.py).
BASE_QUANT_BYTES = {"int8": 1, "fp8": 1, "fp8-matmul": 1}
BASE_QUANT_CHANNEL_BYTES = 10
# How each kind multiplies, as estimate's line says it. The weight-only kinds (torchao) dequantize every weight for
# a bf16 matmul, and autograd saves that copy for the input's gradient (activations.py counts it); fp8-matmul
# (fluxzero.model.fp8_matmul) multiplies the e4m3 weight itself and saves nothing beyond it.
BASE_QUANT_MATMUL = {
    "int8": "torchao weight-only",
    "fp8": "torchao weight-only",
    "fp8-matmul": "FP8 matmuls, activations quantized per token",
}
WEIGHT_ONLY_QUANTS = frozenset({"int8", "fp8"})


# ---------------------------------------------------------------------------------------------------------
# Parameters, from the architecture (module by module, BFL names)
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamInventory:
    """Parameter counts of one FLUX.1 transformer. `modules` maps a module name to its own tensors' sizes."""

    total: int
    double_block: int  # one double-stream block
    single_block: int  # one single-stream block
    outside_blocks: int  # embedders and final layer
    largest_layer: int  # largest module's own parameters (DeepSpeed's `largest_layer_params`)
    tensor_sizes: tuple[int, ...]  # every parameter tensor in the model's parameters() order

    def persistent(self, threshold: int) -> int:
        """Elements ZeRO-3 keeps whole on every rank: tensors with fewer than `threshold` elements."""
        return sum(n for n in self.tensor_sizes if n < threshold)

    def sub_group_sizes(self, world_size: int, sub_group_size: int) -> list[int]:
        """Elements of each of ZeRO-3's optimizer sub-groups on one rank.

        stage3._create_fp16_sub_groups walks the parameters in order and closes a sub-group once its
        partitions reach sub_group_size, so a sub-group overshoots by up to one tensor's partition
        (ceil(numel / world_size) elements each).
        """
        sizes, run = [], 0
        for n in self.tensor_sizes:
            run += -(-n // world_size)
            if run >= sub_group_size:
                sizes.append(run)
                run = 0
        return sizes + [run] if run else sizes

    def largest_sub_group(self, world_size: int, sub_group_size: int) -> int:
        """Elements of ZeRO-3's largest optimizer sub-group on one rank (sub_group_sizes)."""
        return max(self.sub_group_sizes(world_size, sub_group_size), default=0)


@functools.lru_cache(maxsize=16)
def param_inventory(cfg: ModelConfig) -> ParamInventory:
    """The inventory of a model of shape `cfg`, from fluxzero.config.architecture's table (cached: --fit estimates
    hundreds of configurations of one model, and walking its ~1,000 modules each time was most of its time)."""
    double, single = architecture.double_block(cfg), architecture.single_block(cfg)
    outside = architecture.outside_blocks(cfg)
    modules = [lay for _, lay in architecture.layers(cfg)]  # ZeRO-3 cuts its optimizer sub-groups along this order
    return ParamInventory(
        total=architecture.num_params(cfg),
        double_block=architecture.block_params(double),
        single_block=architecture.block_params(single),
        outside_blocks=architecture.block_params(outside),
        largest_layer=max(lay.params for lay in modules),
        tensor_sizes=tuple(n for lay in modules for n in lay.tensors),
    )


def image_tokens(height: int, width: int) -> int:
    """Packed latent tokens of an image: VAE /8, then 2x2 patches -> (H/16) * (W/16)."""
    for name, v in (("height", height), ("width", width)):
        if v <= 0 or v % 16:
            raise ValueError(f"{name} must be a positive multiple of 16 pixels, got {v}")
    return (height // 16) * (width // 16)


# ---------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ZeroSettings:
    """DeepSpeed's communication settings that cost memory, each named as its zero_optimization key (and its
    DSOptions field); defaults are deepspeed 0.19.8's."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None  # None: DeepSpeed's default (True at stage 3 only)
    contiguous_gradients: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000

    @classmethod
    def from_ds_config(cls, ds: dict) -> ZeroSettings:
        return cls.from_view(ds_view.view(ds))

    @classmethod
    def from_view(cls, v: ds_view.DSView) -> ZeroSettings:
        """The settings a config writes (a value "auto" is left to the default)."""
        z = dict(v.zero_settings)
        values = {f.name: z[f.name] for f in dataclasses.fields(cls) if z.get(f.name, "auto") != "auto"}
        return cls(**{k: (v if isinstance(v, bool) else int(v)) for k, v in values.items()})


def run_options_from_ds_config(ds: dict, world_size: int | None = None, v: ds_view.DSView | None = None) -> dict:
    """RunSpec fields that a DeepSpeed config (gen-config's or hand-written) decides, read through its DSView.

    Absent keys take the values DeepSpeed and the trainer use for them (ZeRO stage 0, no activation
    checkpointing, fp32), not the estimate's own defaults; the micro batch comes from
    train_batch_size / (accumulation x world_size) when only those are given, and is left out when the
    config does not decide it (not set, "auto", or not dividing for this world size).
    Raises ds_view.DSConfigError (a ValueError) for a section of the wrong type, ValueError for a value of the
    wrong kind. `v`: the config's view when the caller has it (the trainer's, whose dict has lost its "fluxzero"
    section to DeepSpeed).
    """
    v = v if v is not None else ds_view.view(ds)
    out: dict = {
        "stage": v.stage,
        "precision": v.precision,
        "offload_optimizer": v.offload_optimizer,
        "offload_param": v.offload_param,
    }
    for ours in ("stage", "checkpoint_every"):
        if not (isinstance(getattr(v, ours), int) and not isinstance(getattr(v, ours), bool)):
            key = "zero_optimization.stage" if ours == "stage" else "fluxzero.activation_checkpointing.every_k_blocks"
            raise ValueError(f"{key} must be an integer, got {getattr(v, ours)!r}")
    if isinstance(v.micro_batch, int):
        out["micro_batch"] = v.micro_batch
    elif world_size and v.global_batch is not None:
        try:
            out["micro_batch"] = v.batch_for(world_size)[0]
        except (ds_view.DSConfigError, TypeError):
            pass  # does not divide: the estimate keeps its own micro batch and says so
    if v.optimizer is not None:
        out["optimizer"] = v.optimizer if v.optimizer in OPTIMIZER_STATE_BYTES else "adamw"
        out["optimizer_impl"] = v.optimizer_impl
    out["checkpoint_every"] = v.checkpoint_every  # the trainer checkpoints nothing without it
    if v.checkpoint_policy in CHECKPOINT_POLICIES:
        out["checkpoint_policy"] = v.checkpoint_policy
    if v.optimizer_mode is not None:
        out["optimizer_mode"] = v.optimizer_mode
        if v.trainer_casts_to_bf16:
            out["precision"] = "bf16"  # bf16 off in DeepSpeed: the trainer casts the model to bf16 itself
    if isinstance(v.offload_blocks, int) and not isinstance(v.offload_blocks, bool):
        out["offload_blocks"] = v.offload_blocks
    if v.checkpoint_impl == "deepspeed":
        out["cpu_checkpointing"] = v.cpu_checkpointing
    out["zero"] = ZeroSettings.from_view(v)
    for key in ("pin_offload_optimizer", "pin_offload_param"):  # without the section, the run's own default
        if getattr(v, key) is not None:
            out[key] = getattr(v, key)
    return out


# The command-line options that set a RunSpec field (`estimate`'s, and `gen-config`'s where --fit pins them), by
# option name: each is named as its field, but --zero-stage, which sets `stage` (the DSView's name for it)
OPTION_FIELDS = {
    "zero_stage": "stage",
    **{
        name: name
        for name in (
            "micro_batch",
            "precision",
            "offload_optimizer",
            "offload_param",
            "checkpoint_every",
            "checkpoint_policy",
            "optimizer",
            "optimizer_mode",
            "offload_blocks",
        )
    },
}


@dataclass(frozen=True)
class RunSpec:
    """Everything the memory of a step depends on. Sizes in GiB; height/width in pixels."""

    model: ModelConfig
    nodes: int = 1
    gpus_per_node: int = 1
    height: int = 512
    width: int = 512
    txt_len: int = 512
    micro_batch: int = 1
    precision: str = "bf16"
    stage: int = 2
    offload_optimizer: str = "none"
    offload_param: str = "none"
    checkpoint_every: int = 1  # 0 = off, 1 = every block, k = every k-th block (one index over both lists)
    # "full": a checkpointed block keeps its inputs; "selective": also its matmul and attention outputs
    checkpoint_policy: str = "full"
    cpu_checkpointing: bool = False  # deepspeed.checkpointing keeps checkpointed blocks' inputs in host memory
    optimizer: str = "adamw"
    optimizer_impl: str = "fused"  # "fused" (DeepSpeed FusedAdam / CPUAdam) | "torch" (torch AdamW, foreach: a
    # temp copy) | "torch-fused" (torch AdamW(fused=True): no temporaries). Both torch ones run unflattened at stage 0
    attention: str = "flash"  # "flash" / "efficient": O(L) softmax statistics; "math": O(L^2)
    zero: ZeroSettings = field(default_factory=ZeroSettings)
    zero_init: bool = True  # stage 3 builds the model partitioned (deepspeed.zero.Init)
    load_bytes: int = 4  # bytes per parameter of a tensor as read from the weights file (4: an fp32 file at worst)
    # offload buffers in page-locked memory (offload_*.pin_memory: gen-config writes true, DeepSpeed's default false)
    pin_offload_optimizer: bool = True
    pin_offload_param: bool = True
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    fragmentation: float | None = None  # (reserved - allocated) / per-step transients; None: see Estimate.fragmentation
    cuda_context_gib: float = 1.0  # CUDA context, cuBLAS workspace, NCCL buffers: outside the allocator
    device: str = "cuda"  # "cpu" only to compare with CPU measurements (rms_norm saves more there)
    optimizer_mode: str | None = None  # fluxzero.config.optim_modes name; None: DeepSpeed's optimizer, fp32 masters
    lora_rank: int = 0  # 0: full fine-tune; r: LoRA adapters of rank r on lora_targets, the base frozen
    lora_targets: str | tuple[str, ...] = DEFAULT_TARGETS  # a fluxzero.config.lora TARGET_PRESETS name or patterns
    lora_dropout: float = 0.0
    lora_type: str = "lora"  # what the adapters are (lora.type: lora, dora, lokr); their parameters differ per type
    lora_factor: int = -1  # lokr: lora.factor
    lora_decompose_both: bool = False  # lokr: lora.decompose_both
    ema: str | None = None  # None: no EMA; "fp32" | "bf16": EMA of the trained weights (fluxzero.config.ema)
    ema_device: str = "gpu"  # "gpu" | "cpu" (ema.device)
    base_quant: str | None = None  # None: the frozen LoRA base in the training dtype; else a BASE_QUANT_BYTES kind
    offload_blocks: int = 0  # fluxzero.offload_blocks: the last K blocks' weights in host memory (fused mode, LoRA)

    def __post_init__(self):  # noqa: C901
        if isinstance(self.model, str):
            object.__setattr__(self, "model", get_model_config(self.model))
        for f in ("nodes", "gpus_per_node", "micro_batch", "txt_len"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be at least 1, got {getattr(self, f)}")
        image_tokens(self.height, self.width)
        if self.precision not in PRECISION_BYTES:
            raise ValueError(f"precision must be one of {', '.join(PRECISION_BYTES)}, got {self.precision!r}")
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {self.stage}")
        for f in ("offload_optimizer", "offload_param"):
            if getattr(self, f) not in OFFLOAD_DEVICES:
                raise ValueError(f"{f} must be one of {', '.join(OFFLOAD_DEVICES)}, got {getattr(self, f)!r}")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError("offload_param needs ZeRO stage 3")
        if self.offload_optimizer == "nvme" and self.stage != 3:
            raise ValueError("NVMe optimizer offload needs ZeRO stage 3 in deepspeed 0.19.8")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATE_BYTES)}, got {self.optimizer!r}")
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"optimizer_impl must be one of {', '.join(OPTIMIZER_IMPLS)}, got {self.optimizer_impl!r}")
        if self.attention not in (*ATTENTION_KERNELS, "auto", "cudnn"):
            raise ValueError(f"attention must be flash, efficient, cudnn, auto or math, got {self.attention!r}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be 0 (off) or more, got {self.checkpoint_every}")
        if self.checkpoint_policy not in CHECKPOINT_POLICIES:
            raise ValueError(
                f"checkpoint_policy must be one of {', '.join(CHECKPOINT_POLICIES)}, got {self.checkpoint_policy!r}"
            )
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be cuda or cpu, got {self.device!r}")
        if self.optimizer_mode is not None:
            mode = optim_modes.get_mode(self.optimizer_mode)  # ValueError naming the modes
            if self.stage not in mode.zero_stages:
                raise ValueError(f"optimizer mode {mode.name} does not run at ZeRO stage {self.stage}")
            if not mode.offload_ok and self.offload_optimizer != "none":
                raise ValueError(
                    f"optimizer mode {mode.name} keeps bf16 masters on the accelerator, which deepspeed "
                    f"0.19.8 does not offload for it: use offload_optimizer none, a cpu-* mode or fp32"
                )
            if mode.needs_offload and self.offload_optimizer != "cpu":
                raise ValueError(f"optimizer mode {mode.name} steps in host memory: it needs offload_optimizer cpu")
            if mode.master_dtype == "bf16" and self.precision != "bf16":
                raise ValueError(f"optimizer mode {mode.name} trains in bf16, got precision {self.precision}")
            if mode.fused and self.lora_rank:
                raise ValueError(f"optimizer mode {mode.name} is for full fine-tunes, not a LoRA")
        blocks = self.model.depth + self.model.depth_single_blocks
        if not 0 <= self.offload_blocks <= blocks:
            raise ValueError(f"offload_blocks must be within 0-{blocks}, got {self.offload_blocks}")
        fused = self.optimizer_mode and optim_modes.get_mode(self.optimizer_mode).fused
        if self.offload_blocks and not fused and not self.lora_rank:
            raise ValueError(
                "offload_blocks streams blocks from host memory: it needs a fused optimizer mode or a LoRA"
            )
        if self.offload_blocks and self.lora_rank and (self.stage == 3 or self.lora_type != "lora"):
            raise ValueError("offload_blocks streams a plain LoRA's base at ZeRO stage 0, 1 or 2 only")
        if not self.lora_rank and self.lora_type != "lora":
            raise ValueError(f"lora_type {self.lora_type} needs adapters: set lora_rank above 0")
        if self.lora_rank:
            if isinstance(self.lora_targets, list):
                object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
            lora_config(self).check_model(self.model)  # validates rank and targets (ValueError naming the field)
        if self.base_quant is not None:
            if self.base_quant not in BASE_QUANT_BYTES:
                raise ValueError(
                    f"base_quant must be one of {', '.join(BASE_QUANT_BYTES)} or None, got {self.base_quant!r}"
                )
            if not self.lora_rank:
                raise ValueError("a quantized base (base_quant) is frozen: it needs a LoRA (lora_rank > 0)")
            if self.stage == 3:  # ZeRO-3 would partition and gather the quantized buffers: not supported
                raise ValueError(
                    "a quantized base (base_quant) needs ZeRO stage 0, 1 or 2 (stage 3 partitions "
                    "the base in the training dtype)"
                )
            if self.offload_blocks:
                raise ValueError("offload_blocks streams the base in the training dtype: it needs base_quant None")
        if self.ema not in (None, "fp32", "bf16"):
            raise ValueError(f"ema must be fp32, bf16 or None, got {self.ema!r}")
        if self.ema_device not in ("gpu", "cpu"):
            raise ValueError(f"ema_device must be gpu or cpu, got {self.ema_device!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def reference_tokens(self) -> int:
        """A FLUX.1 Kontext model's reference image tokens (the reference is cached at its target's size); 0 else."""
        return architecture.reference_tokens(self.model, image_tokens(self.height, self.width))

    @property
    def img_tokens(self) -> int:
        """Image tokens through the blocks: the target's, then a Kontext model's reference tokens."""
        return image_tokens(self.height, self.width) + self.reference_tokens

    @classmethod
    def from_run(
        cls, model, *, lora: LoraConfig | None = None, ema: EmaConfig | None = None, weights: bool = True, **fields
    ) -> RunSpec:
        """The spec of a run given as its records: the run file's `lora:` and `ema:` sections (None: none;
        section_fields), whether pretrained `weights` are read (each rank reads the file one tensor at a time, an
        fp32 file at worst: load_bytes), and any other RunSpec `fields` (what a DeepSpeed config decides:
        run_options_from_ds_config; the topology, image size and text length)."""
        return cls(model, load_bytes=4 if weights else 0, **section_fields(lora, ema), **fields)

    def replace(self, **changes) -> RunSpec:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Item:
    """One line of the breakdown. `phase`: resident (all step long), train (forward/backward peak only),
    step (optimizer step only), load (host, before deepspeed.initialize). `ds`: counted by DeepSpeed's own
    estimate_zero2/zero3_model_states_mem_needs."""

    name: str
    bytes: int
    where: str  # gpu | host | nvme
    phase: str
    note: str = ""
    ds: bool = False


def optim_mode(s: RunSpec):
    """The spec's OptimMode (fluxzero.config.optim_modes), or None for DeepSpeed's own optimizer."""
    return None if s.optimizer_mode is None else optim_modes.get_mode(s.optimizer_mode)


def streamed_blocks(s: RunSpec, inv: ParamInventory | None = None) -> list[int]:
    """Parameters of each streamed block (fluxzero.offload_blocks: the last K, double blocks then single ones)."""
    inv = inv or param_inventory(s.model)
    sizes = [inv.double_block] * s.model.depth + [inv.single_block] * s.model.depth_single_blocks
    return sizes[len(sizes) - s.offload_blocks :] if s.offload_blocks else []


def lora_config(s: RunSpec) -> LoraConfig | None:
    """The run file's `lora:` section of the spec (None for a full fine-tune); section_fields is the way there."""
    if not s.lora_rank:
        return None
    targets = s.lora_targets if isinstance(s.lora_targets, str) else list(s.lora_targets)
    return LoraConfig(
        rank=s.lora_rank,
        targets=targets,
        dropout=s.lora_dropout,
        type=s.lora_type,
        factor=s.lora_factor,
        decompose_both=s.lora_decompose_both,
        base_quant=s.base_quant or "none",
    )


def section_fields(lora: LoraConfig | None = None, ema: EmaConfig | None = None) -> dict:
    """The RunSpec fields of the run file's `lora:` and `ema:` sections (None: no such section); lora_config is
    the way back."""
    out: dict = {}
    if lora is not None:
        out.update(
            lora_rank=lora.rank,
            lora_targets=lora.targets if isinstance(lora.targets, str) else tuple(lora.targets),
            lora_dropout=lora.dropout,
            lora_type=lora.type,
            lora_factor=lora.factor,
            lora_decompose_both=lora.decompose_both,
            base_quant=None if lora.base_quant == "none" else lora.base_quant,
        )
    if ema is not None:
        out.update(ema=ema.dtype, ema_device=ema.device)
    return out


def base_bytes(s: RunSpec, inv: ParamInventory | None = None) -> int:
    """Bytes of the frozen LoRA base (0 for a full fine-tune): the training dtype, or with base_quant every
    linear's weight at BASE_QUANT_BYTES plus its per-channel scale and zero point."""
    inv = inv or param_inventory(s.model)
    frozen = inv.total - trained_params(s, inv)
    b = PRECISION_BYTES[s.precision]
    if s.base_quant is None or not frozen:
        return b * frozen
    shapes = linear_shapes(s.model).values()
    weights, channels = sum(i * o for i, o in shapes), sum(o for _, o in shapes)
    return BASE_QUANT_BYTES[s.base_quant] * weights + BASE_QUANT_CHANNEL_BYTES * channels + b * (frozen - weights)


def trained_params(s: RunSpec, inv: ParamInventory | None = None) -> int:
    """Parameters the optimizer steps: all of them, or the adapters' of lora_type (fluxzero.config.lora_param_count)."""
    lc = lora_config(s)
    if lc is None:
        return (inv or param_inventory(s.model)).total
    return lora_param_count(s.model, lc)
