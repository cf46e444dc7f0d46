"""Memory model of a fluxzero run: what every GPU and every host holds at the peak of a training step.

Pure Python (no torch, no deepspeed): `fluxzero estimate` and `gen-config --fit` answer instantly.

The model is an itemised sum, each item derived from FLUX.1's architecture or from what DeepSpeed 0.19.8
allocates (file and function named next to each formula):

  model states    bf16/fp16 parameters, gradients, fp32 master copy and optimizer states, per ZeRO stage
                  and offload choice; DeepSpeed's transient copies at the optimizer step
  communication   gradient reduction buckets, ZeRO-3 gathered ("live") and prefetched parameters,
                  parameters under the persistence threshold
  activations     tensors autograd saves for backward, counted tensor by tensor from fluxzero.model's
                  blocks (tests check the count against saved_tensors_hooks on the real model), block
                  inputs only for checkpointed blocks, plus one block's recompute and backward working set
  allocator       the caching allocator's fragmentation (reserved - allocated) and the CUDA context

A step has two memory peaks and the larger one decides: the end of forward / start of backward
(activations) and the optimizer step (fp32 gradient copies). Sizes are bytes; GiB = 2**30 bytes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from fluxzero.config import ds_view, optim_modes
from fluxzero.config.ds_view import checkpointed_blocks  # noqa: F401  (one definition; memory.checkpointed_blocks)
from fluxzero.config.lora import LoraConfig, linear_shapes, lora_param_count
from fluxzero.config.models import ModelConfig, get_model_config

GiB = 1024**3
PHASES = ("train", "step", "init")

PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# The caching allocator's reserve beyond the allocated peak, as a fraction of the per-step transients, by ZeRO
# stage (1 and 2 share one): refitted by benchmarks/fragmentation_fit.py (Estimate.fragmentation says on which runs)
FRAGMENTATION = {0: 0.19, 1: 0.33, 2: 0.33, 3: 0.8}
# fp32 optimizer states per parameter (Adam/AdamW: exp_avg + exp_avg_sq; SGD with momentum, Lion: one buffer)
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "lion": 4, "sgd": 4}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
OPTIMIZER_IMPLS = ("fused", "torch", "torch-fused")

# Usable GPU memory as torch reports it (total_memory), for `--gpu NAME`.
GPU_MEMORY_GIB = {
    "h200": 139.8, "h100": 79.1, "a100-80": 79.1, "a100-40": 39.4, "l40s": 44.4, "a6000": 47.5,
    "rtx4090": 23.6, "mi300x": 191.5,
}


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

    def largest_sub_group(self, world_size: int, sub_group_size: int) -> int:
        """Elements of ZeRO-3's largest optimizer sub-group on one rank.

        stage3._create_fp16_sub_groups walks the parameters in order and closes a sub-group once its
        partitions reach sub_group_size, so a sub-group overshoots by up to one tensor's partition
        (ceil(numel / world_size) elements each).
        """
        best = run = 0
        for n in self.tensor_sizes:
            run += -(-n // world_size)
            if run >= sub_group_size:
                best, run = max(best, run), 0
        return max(best, run)


def _linear(n_in: int, n_out: int, bias: bool = True) -> list[int]:
    return [n_in * n_out] + ([n_out] if bias else [])


def param_inventory(cfg: ModelConfig) -> ParamInventory:
    C, M, D = cfg.hidden_size, cfg.mlp_hidden_dim, cfg.head_dim
    stream = [_linear(C, 6 * C), _linear(C, 3 * C, cfg.qkv_bias), [D], [D], _linear(C, C),
              _linear(C, M), _linear(M, C)]  # mod.lin, attn.qkv, q/k norm scales, attn.proj, mlp.0, mlp.2
    double = stream + stream  # img_* and txt_*
    single = [_linear(C, 3 * C + M), _linear(C + M, C), [D], [D], _linear(C, 3 * C)]
    # in fluxzero.model.Flux's parameters() order: img_in, time_in, vector_in, guidance_in, txt_in, the blocks,
    # final_layer (ZeRO-3 cuts its optimizer sub-groups along this order)
    embed = [_linear(cfg.in_channels, C), _linear(256, C), _linear(C, C), _linear(cfg.vec_in_dim, C), _linear(C, C)]
    embed += [_linear(256, C), _linear(C, C)] if cfg.guidance_embed else []
    embed += [_linear(cfg.context_in_dim, C)]
    head = [_linear(C, cfg.out_channels), _linear(C, 2 * C)]
    outside = embed + head
    modules = embed + double * cfg.depth + single * cfg.depth_single_blocks + head
    n_double, n_single = sum(map(sum, double)), sum(map(sum, single))
    n_outside = sum(map(sum, outside))
    return ParamInventory(
        total=cfg.depth * n_double + cfg.depth_single_blocks * n_single + n_outside,
        double_block=n_double, single_block=n_single, outside_blocks=n_outside,
        largest_layer=max(map(sum, modules)),
        tensor_sizes=tuple(n for m in modules for n in m),
    )


# ---------------------------------------------------------------------------------------------------------
# Activations, from fluxzero.model.layers (per sample; L = L_txt + L_img, C hidden, M mlp hidden, H heads)
# ---------------------------------------------------------------------------------------------------------
def image_tokens(height: int, width: int) -> int:
    """Packed latent tokens of an image: VAE /8, then 2x2 patches -> (H/16) * (W/16)."""
    for name, v in (("height", height), ("width", width)):
        if v <= 0 or v % 16:
            raise ValueError(f"{name} must be a positive multiple of 16 pixels, got {v}")
    return (height // 16) * (width // 16)


def _rms_saved(L: int, cfg: ModelConfig, b: int, device: str) -> dict[str, int]:
    """What F.rms_norm saves for ONE of q/k, beyond its input (which is a view of the qkv projection).

    CUDA (torch >= 2.8): the fused kernel saves its input and the fp32 rstd per row.
    CPU: the composite saves the fp32 upcast input (the input itself if already fp32), rstd and the fp32
    normalised tensor (it is multiplied by the learned scale).
    """
    H = cfg.num_heads
    rstd = L * H * 4
    if device == "cuda":
        return {"rstd": rstd}
    upcast = 0 if b == 4 else L * cfg.hidden_size * 4
    return {"rstd": rstd, "fp32 upcast": upcast, "fp32 normalised": L * cfg.hidden_size * 4}


def _attention_saved(L: int, cfg: ModelConfig, b: int, attention: str, device: str,
                     v_separate: bool) -> dict[str, int]:
    """SDPA's saved tensors (v only when it is its own storage, as the double block's concatenation).

    flash / efficient: rotated q and k (new tensors), v, the output and logsumexp -- fp32 (H, L), O(L).
    math: q and k after scaling (new tensors), v and the softmax probabilities (H, L, L) -- O(L^2). On CPU
    (measured) it keeps fp32 copies of q, k and v (upcast from bf16/fp16) and fp32 probabilities instead.
    """
    C, H = cfg.hidden_size, cfg.num_heads
    v = {"v (concatenated)": L * C * b} if v_separate else {}
    if attention != "math":
        return {"q, k after RoPE": 2 * L * C * b, **v, "attention output": L * C * b, "logsumexp": L * H * 4}
    if device == "cpu":
        return {"q, k, v fp32 copies (math)": 3 * L * C * 4, "softmax probabilities (L^2, fp32)": H * L * L * 4}
    return {"q, k scaled (math)": 2 * L * C * b, **v, "softmax probabilities (L^2)": H * L * L * b}


def _ln_stats(L: int, b: int, device: str) -> int:
    return 2 * L * (4 if device == "cuda" else b)  # mean, rstd (fp32 on CUDA, input dtype on CPU)


def double_block_saved(cfg: ModelConfig, img_tokens: int, txt_tokens: int, b: int = 2, *,
                       device: str = "cuda", attention: str = "flash") -> dict[str, int]:
    """Bytes autograd saves inside one DoubleStreamBlock for one sample, not counting its inputs."""
    C, M = cfg.hidden_size, cfg.mlp_hidden_dim
    L = img_tokens + txt_tokens
    out: dict[str, int] = {}

    def add(k, v):
        out[k] = out.get(k, 0) + v

    for Ls in (img_tokens, txt_tokens):
        add("modulation (silu out, 6C chunk storage, 1+scale x2)", C * b + 6 * C * b + 2 * C * b)
        add("layer norms (stats)", 2 * _ln_stats(Ls, b, device))
        # norm1 out, modulated (qkv input), proj out, residual, norm2 out, modulated (mlp input), mlp out
        add("7 hidden-size tensors per stream", 7 * Ls * C * b)
        add("mlp hidden before/after GELU", 2 * Ls * M * b)
        if device == "cuda" or b == 4:
            add("qkv projection (kept by q/k norm input views)", 3 * Ls * C * b)
        for key, v in _rms_saved(Ls, cfg, b, device).items():
            add(f"q/k rms norm {key}", 2 * v)
    for key, v in _attention_saved(L, cfg, b, attention, device, v_separate=True).items():
        add(key, v)
    add("merged heads (proj inputs)", L * C * b)
    return out


def single_block_saved(cfg: ModelConfig, img_tokens: int, txt_tokens: int, b: int = 2, *,
                       device: str = "cuda", attention: str = "flash") -> dict[str, int]:
    """Bytes autograd saves inside one SingleStreamBlock for one sample, not counting its input."""
    C, M = cfg.hidden_size, cfg.mlp_hidden_dim
    L = img_tokens + txt_tokens
    out = {
        "modulation (silu out, 3C chunk storage, 1+scale)": C * b + 3 * C * b + C * b,
        "layer norm (stats)": _ln_stats(L, b, device),
        "norm out, modulated (linear1 input)": 2 * L * C * b,
        "linear1 output (kept by v and GELU input views)": L * (3 * C + M) * b,  # GELU output: only cat reads it
        "concat(attn, mlp) (linear2 input)": L * (C + M) * b,
        "linear2 output (gate)": L * C * b,
    }
    for key, v in _rms_saved(L, cfg, b, device).items():
        out[f"q/k rms norm {key}"] = 2 * v
    out.update(_attention_saved(L, cfg, b, attention, device, v_separate=False))
    return out


def block_backward_workspace(cfg: ModelConfig, img_tokens: int, txt_tokens: int, b: int = 2,
                             attention: str = "flash") -> int:
    """Activation gradients alive at once inside one block's backward, beyond its saved tensors (one sample).

    Backward starts at the last single block, where the stored activations are largest; its peak is
    linear2's backward: the gradient of the concat(attn, mlp) input (C + M), with the incoming and the
    accumulating hidden-size gradients (2C) -- plus linear2's weight gradient in flight, counted by the
    "gradient being produced" item. Measured on CPU with a live-storage tracker (tests): this is the
    single block's peak to a few percent. Math attention adds the (H, L, L) score gradient in fp32.
    """
    C, M, H = cfg.hidden_size, cfg.mlp_hidden_dim, cfg.num_heads
    L = img_tokens + txt_tokens
    ws = L * b * (C + M + 2 * C)
    if attention == "math":
        ws = max(ws, 2 * H * L * L * 4 + 4 * L * C * b)
    return ws


def outside_blocks_saved(cfg: ModelConfig, img_tokens: int, txt_tokens: int, b: int = 2) -> tuple[int, int]:
    """(embedders, head) bytes saved outside the blocks for one sample, small next to the blocks.

    Embedders (img_in, txt_in inputs, the fp32 RoPE table) live until backward reaches them; the head (final
    layer's norm input and output, linear input; prediction, target, noise, latents in fp32) is freed before
    backward reaches the blocks.
    """
    C, L = cfg.hidden_size, img_tokens + txt_tokens
    embed = img_tokens * cfg.in_channels * b + txt_tokens * cfg.context_in_dim * b + L * cfg.head_dim * 4
    head = L * C * b + 2 * img_tokens * C * b + 4 * img_tokens * cfg.in_channels * 4
    return embed, head


def checkpointed_split(cfg: ModelConfig, every: int) -> tuple[int, int]:
    """(double, single) blocks checkpointed. As fluxzero.train.engine.apply_activation_checkpointing: one index
    over double then single blocks, block i checkpointed iff i % k == 0."""
    if every <= 0:
        return 0, 0
    d = checkpointed_blocks(cfg.depth, every)
    return d, checkpointed_blocks(cfg.depth + cfg.depth_single_blocks, every) - d


# ---------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ZeroSettings:
    """DeepSpeed's communication settings that cost memory; defaults are deepspeed 0.19.8's."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None  # None: DeepSpeed's default (True at stage 3 only)
    contiguous_gradients: bool = True
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000

    @classmethod
    def from_ds_config(cls, ds: dict) -> "ZeroSettings":
        return cls.from_view(ds_view.view(ds))

    @classmethod
    def from_view(cls, v: ds_view.DSView) -> "ZeroSettings":
        z = dict(v.zero_settings)
        keys = {"reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
                "overlap_comm": "overlap_comm", "contiguous_gradients": "contiguous_gradients",
                "prefetch_bucket_size": "stage3_prefetch_bucket_size",
                "param_persistence_threshold": "stage3_param_persistence_threshold",
                "max_live_parameters": "stage3_max_live_parameters",
                "max_reuse_distance": "stage3_max_reuse_distance", "sub_group_size": "sub_group_size"}
        values = {ours: z[theirs] for ours, theirs in keys.items() if theirs in z and z[theirs] != "auto"}
        return cls(**{k: (v if isinstance(v, bool) else int(v)) for k, v in values.items()})


def run_options_from_ds_config(ds: dict, world_size: int | None = None) -> dict:
    """RunSpec fields that a DeepSpeed config (gen-config's or hand-written) decides, read through its DSView.

    Absent keys take the values DeepSpeed and the trainer use for them (ZeRO stage 0, no activation
    checkpointing, fp32), not the estimate's own defaults; the micro batch comes from
    train_batch_size / (accumulation x world_size) when only those are given, and is left out when the
    config does not decide it (not set, "auto", or not dividing for this world size).
    Raises ds_view.DSConfigError (a ValueError) for a section of the wrong type, ValueError for a value of the
    wrong kind.
    """
    v = ds_view.view(ds)
    out: dict = {"stage": v.stage, "precision": v.precision, "offload_optimizer": v.offload_optimizer,
                 "offload_param": v.offload_param}
    for ours in ("stage", "checkpoint_every"):
        if not (isinstance(getattr(v, ours), int) and not isinstance(getattr(v, ours), bool)):
            key = "zero_optimization.stage" if ours == "stage" else "fluxzero.activation_checkpointing.every_k_blocks"
            raise ValueError(f"{key} must be an integer, got {getattr(v, ours)!r}")
    if isinstance(v.micro_batch, int):
        out["micro_batch"] = v.micro_batch
    elif world_size and v.train_batch is not None:
        try:
            out["micro_batch"] = v.batch_for(world_size)[0]
        except (ds_view.DSConfigError, TypeError):
            pass  # does not divide: the estimate keeps its own micro batch and says so
    if v.optimizer is not None:
        out["optimizer"] = v.optimizer if v.optimizer in OPTIMIZER_STATE_BYTES else "adamw"
        out["optimizer_impl"] = v.optimizer_impl
    out["checkpoint_every"] = v.checkpoint_every  # the trainer checkpoints nothing without it
    if v.optimizer_mode is not None:
        out["optimizer_mode"] = v.optimizer_mode
        mode = optim_modes.MODES.get(v.optimizer_mode)
        if mode is not None and mode.master_dtype == "bf16" and v.stage == 0:
            out["precision"] = "bf16"  # bf16 off in DeepSpeed: the trainer casts the model to bf16 itself
    if v.checkpoint_impl == "deepspeed":
        out["cpu_checkpointing"] = v.cpu_checkpointing
    out["zero"] = ZeroSettings.from_view(v)
    return out


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
    cpu_checkpointing: bool = False  # deepspeed.checkpointing keeps checkpointed blocks' inputs in host memory
    optimizer: str = "adamw"
    optimizer_impl: str = "fused"  # "fused" (DeepSpeed FusedAdam / CPUAdam) | "torch" (torch AdamW, foreach: a
    # temp copy) | "torch-fused" (torch AdamW(fused=True): no temporaries). Both torch ones run unflattened at stage 0
    attention: str = "flash"  # "flash" / "efficient": O(L) softmax statistics; "math": O(L^2)
    zero: ZeroSettings = field(default_factory=ZeroSettings)
    zero_init: bool = True  # stage 3 builds the model partitioned (deepspeed.zero.Init)
    load_bytes: int = 4  # bytes per parameter of the host copy each rank loads before initialize
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    fragmentation: float | None = None  # (reserved - allocated) / per-step transients; None: see Estimate.fragmentation
    cuda_context_gib: float = 1.0  # CUDA context, cuBLAS workspace, NCCL buffers: outside the allocator
    device: str = "cuda"  # "cpu" only to compare with CPU measurements (rms_norm saves more there)
    optimizer_mode: str | None = None  # fluxzero.config.optim_modes name; None: DeepSpeed's optimizer, fp32 masters
    lora_rank: int = 0  # 0: full fine-tune; r: LoRA adapters of rank r on lora_targets, the base frozen
    lora_targets: str | tuple[str, ...] = "attention+mlp"  # a fluxzero.config.lora TARGET_PRESETS name or patterns
    lora_dropout: float = 0.0
    ema: str | None = None  # None: no EMA; "fp32" | "bf16": EMA of the trained weights (fluxzero.config.ema)
    ema_device: str = "gpu"  # "gpu" | "cpu" (ema.device)

    def __post_init__(self):
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
        if self.attention not in ("flash", "efficient", "math", "auto", "cudnn"):
            raise ValueError(f"attention must be flash, efficient, cudnn, auto or math, got {self.attention!r}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be 0 (off) or more, got {self.checkpoint_every}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be cuda or cpu, got {self.device!r}")
        if self.optimizer_mode is not None:
            mode = optim_modes.get_mode(self.optimizer_mode)  # ValueError naming the modes
            if self.stage not in mode.zero_stages:
                raise ValueError(f"optimizer mode {mode.name} does not run at ZeRO stage {self.stage}")
            if mode.master_dtype == "bf16" and self.offload_optimizer != "none":
                raise ValueError(f"optimizer mode {mode.name} keeps bf16 masters, which deepspeed 0.19.8 cannot "
                                 f"offload for a client optimizer: use offload_optimizer none or mode fp32")
            if mode.master_dtype == "bf16" and self.precision != "bf16":
                raise ValueError(f"optimizer mode {mode.name} trains in bf16, got precision {self.precision}")
        if self.lora_rank:
            if isinstance(self.lora_targets, list):
                object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
            lora_config(self)  # validates rank and targets (ValueError naming the field)
        if self.ema not in (None, "fp32", "bf16"):
            raise ValueError(f"ema must be fp32, bf16 or None, got {self.ema!r}")
        if self.ema_device not in ("gpu", "cpu"):
            raise ValueError(f"ema_device must be gpu or cpu, got {self.ema_device!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def img_tokens(self) -> int:
        return image_tokens(self.height, self.width)

    def replace(self, **changes) -> "RunSpec":
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


@dataclass
class Estimate:
    spec: RunSpec
    items: list[Item]

    def _sum(self, where: str, phases: tuple[str, ...], ds_only: bool = False) -> int:
        return sum(i.bytes for i in self.items if i.where == where and i.phase in phases and (i.ds or not ds_only))

    def gpu_phase(self, phase: str, ds_only: bool = False) -> int:
        """Allocated bytes per GPU at the peak of `phase`: "train" (forward/backward), "step" (optimizer
        step), or "init" (building the model and the engine, before any resident state exists)."""
        return self._sum("gpu", (phase,) if phase == "init" else ("resident", phase), ds_only)

    @property
    def gpu_allocated(self) -> int:
        """Predicted torch.cuda.max_memory_allocated() per rank."""
        return max(self.gpu_phase(p) for p in PHASES)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.gpu_phase)

    @property
    def gpu_resident(self) -> int:
        """Allocated bytes held all step long (model states, buckets): allocated once, never freed."""
        return self._sum("gpu", ("resident",))

    @property
    def fragmentation(self) -> float:
        """The caching allocator's reserve beyond the allocated peak, as a fraction of the per-step transients
        (peak allocated - resident): what is allocated and freed every step (activations, gathered
        parameters, gradients, the step's copies) leaves cached blocks that later requests of other sizes
        (or on other streams) cannot reuse. Model states are allocated once and do not fragment.

        Fitted on H200 runs, each regime on some runs and checked on others held out
        (benchmarks/fragmentation_fit.py: f minimises the largest relative error of the predicted reserved
        memory over the fit runs; results in benchmarks/results/2026-11-h200 and 2026-12-h200):
        - stage 0, 0.19: fit on flux-dev-lite's 512 px runs (lite1 #1-3, #7-9, #15, lite_after #1), held out
          the 1024 px ones (#4 +0.5%, #10 -8.0%). The step's per-tensor gradients and fp32 copies have the
          sizes of the fp32 model's tensors freed at engine start, so they mostly reuse those cached blocks;
        - stages 1-2, 0.33: fit on flux-dev-lite ZeRO-2 at 512 px with every block checkpointed at micro
          batch 1 and none at 16 (lite_z2 #1, #6), held out micro batch 8/16 checkpointed and 1/8 not (-1.5% to
          +8.7%). The former 0.8 (stage 3's, unmeasured here) was 10% high with checkpointing and 22-24% high
          without: at ZeRO-2 the step's flat copies reuse much of the activations' cached memory;
        - stage 3, 0.8: fit on flux-dev-lite on one GPU (lite1 #11-14), held out two GPUs and flux-dev
          (scale #1-2, dev2 #1, #2, #4, dev2b #1, dev2c #1: -8.8% to -0.1%). The step's copies are flat
          sub-groups and training's are tensor-sized activations and gathered parameters on their own
          streams: neither set reuses the other's cached blocks;
        - expandable_segments, 0.05: segments grow and shrink in place, little is stranded (not refitted).
        """
        if self.spec.fragmentation is not None:
            return self.spec.fragmentation
        if self.spec.expandable_segments:
            return 0.05
        return FRAGMENTATION[min(self.spec.stage, 2) if self.spec.stage < 3 else 3]

    @property
    def gpu_reserved(self) -> int:
        """Predicted torch.cuda.max_memory_reserved() per rank: resident states plus the transients with
        their fragmentation."""
        resident = self.gpu_resident
        return int(resident + (self.gpu_allocated - resident) * (1 + self.fragmentation))

    @property
    def gpu_total(self) -> int:
        """What the GPU must have: reserved plus the CUDA context outside PyTorch's allocator."""
        return self.gpu_reserved + int(self.spec.cuda_context_gib * GiB)

    def host_per_rank(self, ds_only: bool = False) -> int:
        """Host bytes of one rank: the larger of model loading and the run's resident host state."""
        running = self._sum("host", ("resident",), ds_only) + max(self._sum("host", (p,), ds_only) for p in PHASES)
        return max(self._sum("host", ("load",), ds_only), running)

    @property
    def host_per_node(self) -> int:
        return self.host_per_rank() * self.spec.gpus_per_node

    @property
    def nvme_per_node(self) -> int:
        return self._sum("nvme", ("resident",)) * self.spec.gpus_per_node

    def deepspeed_view(self) -> tuple[int, int]:
        """(GPU bytes per rank, host bytes per node) counted the way DeepSpeed's
        estimate_zero2/zero3_model_states_mem_needs count them: every model-state item DeepSpeed knows,
        all phases summed, host without its additional_buffer_factor."""
        gpu = sum(i.bytes for i in self.items if i.where == "gpu" and i.ds)
        return gpu, self.host_per_rank(ds_only=True) * self.spec.gpus_per_node

    def group(self, where: str = "gpu") -> list[Item]:
        return [i for i in self.items if i.where == where and i.bytes]


def estimate(spec: RunSpec) -> Estimate:
    """Itemised memory of one rank (GPU) and one node (host) for `spec`."""
    inv = param_inventory(spec.model)
    items = _model_state_items(spec, inv) + _communication_items(spec, inv) + _activation_items(spec)
    return Estimate(spec, items)


# Transient bytes per stepped element of one optimizer step beyond its states, by optimizer mode, on one flat
# 1-D tensor as ZeRO 1-3 hand it: measured on CPU by benchmarks/optim_step_memory.py (peak RSS over the steady
# state, 5e7 elements, 2026-12). fp32: torch.optim.AdamW(foreach=False), sqrt then divide (two fp32
# temporaries at once); the torchao modes (bf16-sr, adamw8bit-sr) run one torch.compile'd kernel per tensor
# (upper bound: the first step's peak, compile included); ours do their math in eager fp32: bf16-kahan keeps
# ~9 fp32 copies alive (g, m, v, p32, denom, update, the Kahan sum, stochastic-rounding noise), adafactor-sr ~8.
# A ZeRO-1/2 partition is one tensor, so their step costs 36 / 31 B per element of it at once.
MODE_STEP_TEMP = {"fp32": 8.0, "bf16-rtn": 8.0, "bf16-sr": 0.7, "bf16-kahan": 36.0, "adamw8bit-sr": 0.7,
                  "adafactor-sr": 31.0}


def optim_mode(s: RunSpec):
    """The spec's OptimMode (fluxzero.config.optim_modes), or None for DeepSpeed's own optimizer."""
    return None if s.optimizer_mode is None else optim_modes.get_mode(s.optimizer_mode)


def lora_config(s: RunSpec) -> LoraConfig | None:
    if not s.lora_rank:
        return None
    targets = s.lora_targets if isinstance(s.lora_targets, str) else list(s.lora_targets)
    return LoraConfig(rank=s.lora_rank, targets=targets, dropout=s.lora_dropout)


def trained_params(s: RunSpec, inv: ParamInventory | None = None) -> int:
    """Parameters the optimizer steps: all of them, or the LoRA adapters' (fluxzero.config.lora_param_count)."""
    lc = lora_config(s)
    if lc is None:
        return (inv or param_inventory(s.model)).total
    return lora_param_count(s.model, lc)


def _model_state_items(s: RunSpec, inv: ParamInventory) -> list[Item]:
    N, b = s.world_size, PRECISION_BYTES[s.precision]
    total = inv.total
    lora = lora_config(s) is not None
    # P: the parameters that train (gradients, master copy, optimizer states); the LoRA base is frozen
    P = trained_params(s, inv)
    frozen = total - P
    part = math.ceil(P / N)  # elements of one rank's partition
    mode = optim_mode(s)
    opt = OPTIMIZER_STATE_BYTES[s.optimizer]
    master_b = 4  # DeepSpeed's fp32 masters
    if mode is not None:  # the mode's own bytes (fluxzero.config.optim_modes), partitioned below as DeepSpeed does
        opt = mode.states if s.stage == 0 or mode.states_flat is None else mode.states_flat
        master_b = int(mode.master) if mode.master_dtype == "bf16" else 4
    bf16_master = mode is not None and mode.master_dtype == "bf16"
    off_opt, off_par = s.offload_optimizer != "none", s.offload_param != "none"
    opt_dev = {"none": "gpu", "cpu": "host", "nvme": "nvme"}[s.offload_optimizer]
    largest_trained = max(inv.tensor_sizes) if not lora else max(1, P // max(1, _adapted_linears(s)))
    items: list[Item] = []

    def add(name, nbytes, where="gpu", phase="resident", note="", ds=False):
        items.append(Item(name, int(nbytes), where, phase, note, ds))

    # --- parameters and gradients in the model's dtype
    what = "LoRA adapters" if lora else "parameters"
    if s.stage < 3:
        if lora:
            add("frozen base parameters (%s)" % s.precision, b * frozen, note="LoRA: no gradients, no optimizer "
                "states", ds=True)
        add(f"{what} (full, {s.precision})", b * P, note="every rank holds all of them below stage 3", ds=True)
    else:
        where = {"none": "gpu", "cpu": "host", "nvme": "nvme"}[s.offload_param]
        if lora:
            add("frozen base partition (%s)" % s.precision, b * math.ceil(frozen / N), where,
                note="ZeRO-3 partitions the frozen base too", ds=True)
        add(f"{what} partition ({s.precision})", b * part, where, note="1/N of the parameters", ds=True)
    overlap = s.zero.overlap_comm if s.zero.overlap_comm is not None else s.stage == 3
    if s.stage == 0:
        # made tensor by tensor in backward (the train phase counts what exists at its peak: "gradients made
        # in backward ..."), all present at the step, freed by zero_grad(set_to_none=True) after it
        add("gradients (full, %s)" % s.precision, b * P, phase="step", note="param.grad from backward to the step")
    elif not off_opt:
        add("gradient partition (%s)" % s.precision, b * part, ds=True,
            note="stage 1/2: grads_in_partition, then averaged_gradients; stage 3: grad_partitions_flat_buffer")
    if s.stage == 1:
        # Measured (benchmarks/zero1_grad_probe.py, real deepspeed 0.19.8 engines, 2 ranks): stage 1 holds a whole
        # gradient's worth until backward ends. Without overlap_comm every param.grad stays whole until the
        # epilogue reduces them (stage_1_and_2.reduce_gradients); with it, this rank's own gradients are copied
        # into its partition as they come, but the other ranks' parameters keep their param.grad until then.
        if overlap:
            add("gradients of the other ranks' partitions (%s)" % s.precision, b * (P - part), phase="train",
                note="stage 1 with overlap_comm: kept until backward ends (measured)")
        else:
            add("gradients (full, %s) until backward ends" % s.precision, b * P, phase="train",
                note="stage 1 without overlap_comm (measured)")

    # --- master copy and optimizer states
    mname = "bf16 master" if bf16_master else "fp32 master"
    sname = f"optimizer states ({mode.name})" if mode is not None else "optimizer states (fp32)"
    if s.stage == 0:
        if bf16_master:
            pass  # bf16 off in DeepSpeed, the model cast by the trainer: the optimizer steps the weights themselves
        elif b < 4:
            add("fp32 master parameters", 4 * P, note="DeepSpeed FP16_Optimizer (bf16/fp16 at stage 0)")
        add(sname, opt * P)
    else:
        add(f"{mname} partition", master_b * part, opt_dev, note="single_partition_of_fp32_groups", ds=True)
        add(sname.replace("states", "state partition"), opt * part, opt_dev, ds=True)

    # --- transient copies at the optimizer step
    if mode is not None:
        impl_temp = MODE_STEP_TEMP[mode.name]
        tnote = "benchmarks/optim_step_memory.py (CPU, flat partition)"
    else:
        impl_temp = 4 if s.optimizer_impl == "torch" else 0
        tnote = "_foreach_sqrt(exp_avg_sq)"
    if s.stage == 0:
        if bf16_master:
            # torch's optimizers loop over tensors: one tensor's working set at a time
            add("optimizer working set at step (one tensor)", impl_temp * largest_trained, phase="step", note=tnote)
        elif b < 4 and s.optimizer_impl == "fused" and mode is None:
            add("fp32 gradient copies at step", 8 * P, phase="step",
                note="FP16_Optimizer.step: list of p.grad.float() (4 B) flattened into one fp32 buffer (4 B)")
        elif b < 4:
            add("fp32 gradient copies at step", 4 * P, phase="step",
                note="FP16_UnfusedOptimizer.step: fp32_param.grad = p.grad.to(fp32) for every tensor, then one "
                     "optimizer step over all")
        if impl_temp and not bf16_master:
            add("optimizer temporary at step" if mode else "optimizer temporary (torch foreach)",
                impl_temp * (largest_trained if mode else P), phase="step", note=tnote)
    elif not off_opt:
        sg = part if s.stage < 3 else min(part, inv.largest_sub_group(N, s.zero.sub_group_size)) if not lora \
            else min(part, s.zero.sub_group_size)
        note = "stage_1_and_2.step: flatten(averaged_gradients) then .float()" if s.stage < 3 else \
            "stage3._prepare_fp32_grad_for_sub_group, one sub_group_size at a time"
        if not bf16_master:  # with bf16 masters .to(master dtype) returns the flattened copy itself
            add("fp32 gradient partition at step", 4 * sg, phase="step", note=note, ds=True)
        add("flattened %s gradient copy at step" % s.precision, b * sg, phase="step", note=note)
        if impl_temp:
            add("optimizer temporary at step" if mode else "optimizer temporary (torch foreach)", impl_temp * sg,
                phase="step", note=tnote)
    else:
        # The optimizer runs on the host; gradients travel there in fp32 during backward.
        add("fp32 gradient partition (offloaded)", 4 * part, opt_dev, ds=True,
            note="pinned buffers that receive the reduced gradients")
        if impl_temp:
            add("optimizer temporary at step (host)", impl_temp * (part if s.stage < 3 else min(
                part, s.zero.sub_group_size)), opt_dev, phase="step", note=tnote)
        if s.stage < 3:
            add("%s partition staging buffer" % s.precision, b * part, "host",
                note="param_buffer_of_bit16_for_cpu_offload_groups")
            add("gradient offload staging (largest tensor)", b * largest_trained,
                note="temp_grad_buffer_for_gpu_offload")
            add("gradient offload staging (largest tensor, pinned)", b * largest_trained, "host",
                note="temp_grad_buffer_for_cpu_offload")
    if off_opt and s.stage == 3 and b < 4:
        add("%s gradient partition (offloaded)" % s.precision, b * part, "host",
            note="grad_partitions_flat_buffer lives on the host with optimizer offload")
    if s.offload_optimizer == "nvme" or s.offload_param == "nvme":
        swap = min(part, s.zero.sub_group_size)
        add("NVMe swap buffers (pinned)", (4 + opt) * swap + (5 * 100_000_000 * b if off_par else 0), "host",
            note="one sub-group's fp32 master + states swapped in; parameters: buffer_count 5 x buffer_size 1e8")

    # --- EMA of the trained weights (fluxzero.train.ema.ShardedEMA): beside this rank's master partition
    if s.ema is not None:
        from fluxzero.config.ema import EmaConfig

        # ZeRO 1-3 partition the masters; at stage 0 gen-config's bf16 config gets FP16_UnfusedOptimizer, whole
        # masters on every rank (only DeepSpeed's BF16_Optimizer, with an fp32 grad_accum_dtype, would partition)
        partitioned = s.stage >= 1
        per = EmaConfig(dtype=s.ema).bytes_per_param(N, partitioned)
        where = "host" if s.ema_device == "cpu" else "gpu"
        add(f"EMA ({s.ema})", per * P, where, note=("1/N, like the master partition" if partitioned and N > 1
                                                    else "whole on every rank") + f", ema.device {s.ema_device}")

    # --- building the model and the engine (fluxzero.train.engine.build_engine): below stage 3 the model is born
    # in fp32 on the GPU; deepspeed.initialize casts it tensor by tensor, then the ZeRO-1/2 optimizer copies
    # the parameters into one flat buffer (on the GPU when it has room) and the FP16_Optimizer of stage 0
    # clones them twice more (flat copy, then its fp32 master).
    if bf16_master and s.stage == 0:
        add("building the engine", 4 * total + b * inv.largest_layer, phase="init",
            note="fp32 model, cast to bf16 by the trainer tensor by tensor (no master copy)")
    elif s.stage == 0 and b < 4 and s.optimizer_impl != "fused" or (s.stage == 0 and mode is not None):
        # torch AdamW is not a DeepSpeed FusedAdam: the engine wraps it in FP16_UnfusedOptimizer, whose
        # initialize_optimizer_states gives every tensor a zero bf16 and fp32 grad and runs one step (which
        # creates the states) before it frees the grads: the same 20 B/param as the steady-state step
        temp = 4 * P if s.optimizer_impl == "torch" and mode is None else 0
        add("building the engine", (b + 4 + b + 4 + opt) * P + b * frozen + temp, phase="init",
            note="params, fp32 master clones, zero bf16 + fp32 grads, optimizer states (FP16_UnfusedOptimizer)")
    elif s.stage == 0:
        add("building the engine", (8 if b < 4 else 4) * P + 4 * frozen, phase="init",
            note="fp32 model, bf16 cast, flat copy and fp32 master (FP16_Optimizer)")
    elif s.stage < 3:
        add("building the engine", max(4 * total + b * inv.largest_layer, b * total + b * P), phase="init",
            note="fp32 model cast to %s, then flattened (stage_1_and_2 __init__)" % s.precision)

    # --- host copy of the model while loading (each local rank, before deepspeed.initialize)
    zero_init = s.stage == 3 and s.zero_init
    loaded = inv.largest_layer if zero_init else total
    add("model load (%d B/param)" % s.load_bytes, s.load_bytes * loaded, "host", "load",
        note="largest layer at a time under zero.Init" if zero_init else "whole model on every local rank",
        ds=True)
    add("process (CUDA runtime, libraries)", 2 * GiB, "host", note="per rank; assumed typical RSS")
    return items


def _largest_trained_layer(s: RunSpec, inv: ParamInventory) -> int:
    """Elements of the largest gradient one layer makes at once (a LoRA adapter's A and B under LoRA)."""
    lc = lora_config(s)
    if lc is None:
        return inv.largest_layer
    import fnmatch

    shapes = linear_shapes(s.model)
    chosen = [sum(shapes[n]) for n in shapes if any(fnmatch.fnmatchcase(n, p) for p in lc.patterns)]
    return lc.rank * max(chosen, default=0)


def _adapted_linears(s: RunSpec) -> int:
    """How many linears the LoRA targets adapt (0 without LoRA)."""
    import fnmatch

    lc = lora_config(s)
    if lc is None:
        return 0
    shapes = linear_shapes(s.model)
    return len({n for p in lc.patterns for n in shapes if fnmatch.fnmatchcase(n, p)})


def _communication_items(s: RunSpec, inv: ParamInventory) -> list[Item]:
    b = PRECISION_BYTES[s.precision]
    z = s.zero
    items: list[Item] = []
    overlap = z.overlap_comm if z.overlap_comm is not None else s.stage == 3
    if s.stage == 0:
        items.append(Item("allreduce bucket", b * min(z.reduce_bucket_size, inv.total), "gpu", "train",
                          "engine.buffered_allreduce_fallback flattens one bucket"))
    elif s.stage in (1, 2):
        n = 2 if overlap else 1
        items.append(Item("gradient reduction buckets", n * b * z.reduce_bucket_size, "gpu", "train",
                          f"ipg buffers: reduce_bucket_size x {n} (overlap_comm={overlap}), freed when "
                          f"backward ends"))
        items.append(Item("gradient being produced", b * _largest_trained_layer(s, inv), "gpu", "train",
                          "one layer's full gradient before it is copied into a bucket"))
        # allgather_bucket_size costs nothing with NCCL: all_gather_into_tensor writes into the flat buffer.
    else:
        items.append(Item("gradient reduction bucket", b * z.reduce_bucket_size, "gpu", "resident",
                          "ipg bucket (reduce_bucket_size)"))
        items.append(Item("reduce-scatter staging", b * z.reduce_bucket_size // 2, "gpu", "train",
                          "half a bucket on average in flight"))
        unit = inv.largest_layer
        block = max(inv.double_block, inv.single_block)
        if s.checkpoint_every and z.max_reuse_distance >= block:
            unit = block  # recompute then backward reuses the whole block's params: not released in between
        prefetch = min(z.prefetch_bucket_size, max(0, z.max_live_parameters - unit))
        items.append(Item("live (gathered) parameters", b * (unit + prefetch), "gpu", "train",
                          "largest gather unit + prefetch bucket (capped by max_live_parameters)", ds=True))
        items.append(Item("gradient being produced", b * _largest_trained_layer(s, inv), "gpu", "train",
                          "one layer's full gradient before it enters the bucket", ds=True))
        persistent = inv.persistent(z.param_persistence_threshold)
        items.append(Item("persistent parameters", b * persistent, "gpu", "resident",
                          f"tensors under param_persistence_threshold={z.param_persistence_threshold}"))
    return items


def activation_bytes(s: RunSpec) -> dict[str, int]:
    """Per-rank activation bytes at the backward peak: what is stored for backward when it starts, the
    recompute of a checkpointed block net of what backward has freed before it, the backward working set.

    Backward walks the blocks in reverse (single blocks first). At block j, the inputs and (for blocks not
    checkpointed) saved tensors of blocks 0..j are still alive, block j's saved tensors are recomputed if it
    is checkpointed, and its working set is live; the peak is the largest such moment.
    """
    cfg, b, B = s.model, PRECISION_BYTES[s.precision], s.micro_batch
    I, T = s.img_tokens, s.txt_len
    L, C = I + T, cfg.hidden_size
    att = "math" if s.attention == "math" else "flash"
    d = sum(double_block_saved(cfg, I, T, b, device=s.device, attention=att).values())
    si = sum(single_block_saved(cfg, I, T, b, device=s.device, attention=att).values())
    lora_d, lora_s = lora_block_saved(s)
    d, si = d + lora_d, si + lora_s
    k = s.checkpoint_every
    kinds = [d] * cfg.depth + [si] * cfg.depth_single_blocks
    ckpt = [k > 0 and j % k == 0 for j in range(len(kinds))]
    x_in = 0 if s.cpu_checkpointing else L * C * b  # a checkpointed block's input (on the host with cpu_ckpt)
    kept = [(x_in if c else L * C * b + saved) for saved, c in zip(kinds, ckpt)]  # per block, one sample
    embed, head = outside_blocks_saved(cfg, I, T, b)
    stored = embed + sum(kept)  # alive when backward reaches the blocks (the head's tensors are freed by then)
    # At stage 0 every parameter's full gradient stays from the moment backward makes it until the step:
    # they grow block by block (the head's first) while the activations shrink, and the peak may come later
    inv = param_inventory(cfg)
    params = [inv.double_block] * cfg.depth + [inv.single_block] * cfg.depth_single_blocks
    if s.lora_rank:  # only the adapters get gradients: spread them over the blocks like the parameters
        params = [n * trained_params(s, inv) / inv.total for n in params]
    g_bytes = b if s.stage == 0 else 0
    grads = g_bytes * (inv.outside_blocks - _embedder_params(cfg))  # the head's, made before the blocks
    peak, alive = stored, stored
    both = B * stored + grads  # activations and gradients together
    for j in reversed(range(len(kinds))):
        moment = alive + (kinds[j] if ckpt[j] else 0)
        peak = max(peak, moment)
        both = max(both, B * moment + grads)
        alive -= kept[j]
        grads += g_bytes * params[j]
    # the forward's end holds the head instead of a working set: count the larger of the two
    workspace = max(block_backward_workspace(cfg, I, T, b, att), head)
    on_host = B * sum(L * C * b for c in ckpt if c) if s.cpu_checkpointing else 0
    return {"stored": B * stored, "recompute": B * (peak - stored), "workspace": B * workspace, "on_host": on_host,
            "grads_net": both - B * peak, "per_block_double": d, "per_block_single": si,
            "checkpointed": sum(ckpt)}


def lora_block_saved(s: RunSpec) -> tuple[int, int]:
    """(double, single) block bytes per sample that LoRA adapters add to what autograd saves.

    The base linears are frozen, so backward runs no weight-gradient matmul for them, but it still needs each
    adapted linear's input x for A's gradient (the same tensor the block saves already) and saves the
    adapter's own A x (rank values per token) for B's gradient; with dropout, the dropped-out copy of x too.
    """
    import fnmatch

    lc = lora_config(s)
    if lc is None:
        return 0, 0
    b, I, T = PRECISION_BYTES[s.precision], s.img_tokens, s.txt_len
    shapes = linear_shapes(s.model)
    out = [0, 0]
    for name, (n_in, _) in shapes.items():
        if not (name.startswith("double_blocks.0.") or name.startswith("single_blocks.0.")):
            continue
        if not any(fnmatch.fnmatchcase(name, p) for p in lc.patterns):
            continue
        single = name.startswith("single_blocks.")
        tokens = I + T if single else (T if ".txt_" in name else I)
        if name.endswith("_mod.lin") or name.endswith("modulation.lin"):
            tokens = 1  # the modulation reads one vector per sample
        out[single] += tokens * (lc.rank + (n_in if lc.dropout else 0)) * b
    return out[0], out[1]


def _embedder_params(cfg: ModelConfig) -> int:
    """Parameters of img_in, time_in, vector_in, guidance_in and txt_in: their gradients come last."""
    C = cfg.hidden_size
    n = cfg.in_channels * C + C + (256 * C + C) + (C * C + C) + (cfg.vec_in_dim * C + C) + (C * C + C)
    n += (256 * C + C) + (C * C + C) if cfg.guidance_embed else 0
    return n + cfg.context_in_dim * C + C


def _activation_items(s: RunSpec) -> list[Item]:
    a = activation_bytes(s)
    ck = f"{a['checkpointed']} of {s.model.depth + s.model.depth_single_blocks} blocks checkpointed"
    return [
        Item("activations saved for backward", a["stored"], "gpu", "train",
             f"micro batch {s.micro_batch}; {ck} (block inputs only for those)"),
        Item("gradients made in backward, net of activations freed", a["grads_net"], "gpu", "train",
             "stage 0: full gradients made before the backward peak, beyond the activations backward freed"),
        Item("one block's recompute", a["recompute"], "gpu", "train",
             "checkpointed block re-run in backward, net of what backward freed before it"),
        Item("backward working set", a["workspace"], "gpu", "train", "gradients alive inside one block"),
        Item("checkpointed block inputs (cpu_checkpointing)", a["on_host"], "host", "train",
             "deepspeed.checkpointing checkpoint_in_cpu"),
    ]


# ---------------------------------------------------------------------------------------------------------
# Tables and fitting
# ---------------------------------------------------------------------------------------------------------
STAGE_OFFLOAD_GRID: tuple[tuple[int, str, str], ...] = (
    (0, "none", "none"), (1, "none", "none"), (2, "none", "none"), (3, "none", "none"),
    (1, "cpu", "none"), (2, "cpu", "none"), (3, "cpu", "none"), (3, "cpu", "cpu"), (3, "nvme", "nvme"),
)


def table(spec: RunSpec, zero_by_stage: dict[int, ZeroSettings] | None = None) -> list[tuple[RunSpec, Estimate]]:
    """The same run over ZeRO stages 0-3 x offload choices (fastest first); `zero_by_stage` gives each stage's
    communication settings (default: the spec's own for every row)."""
    rows = []
    for st, oo, op in STAGE_OFFLOAD_GRID:
        try:  # a row the spec's optimizer mode cannot run (bf16 masters with offload) is left out
            rows.append(spec.replace(stage=st, offload_optimizer=oo, offload_param=op,
                                     zero=(zero_by_stage or {}).get(st, spec.zero)))
        except ValueError:
            continue
    return [(r, estimate(r)) for r in rows]


@dataclass(frozen=True)
class Hardware:
    gpu_memory_gib: float
    host_memory_gib: float | None = None  # per node; None = do not check
    nodes: int = 1
    gpus_per_node: int = 1

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
        return False, (f"GPU needs {need:.1f} GiB > {budget:.1f} GiB budget (peak at {where}; "
                       f"largest item: {top.name} {top.bytes / GiB:.1f} GiB)")
    if hw.host_memory_gib is not None:
        hbudget = hw.host_memory_gib * (1 - margin)
        hneed = est.host_per_node / GiB
        if hneed > hbudget:
            return False, f"host needs {hneed:.1f} GiB per node > {hbudget:.1f} GiB budget"
    return True, f"GPU {need:.1f} of {budget:.1f} GiB budget"


def throughput_proxy(spec: RunSpec) -> float:
    """Relative speed of a (micro batch, checkpointing) choice at fixed stage and offload.

    Recompute costs the forward of each checkpointed block again: a step is 3 forwards' worth of FLOPs,
    so time grows by (checkpointed fraction) / 3. Small micro batches underfill the GEMMs and amortise
    per-micro-step overheads (ZeRO-3 gathers, launches) badly: efficiency tokens / (tokens + 2048).
    """
    cfg = spec.model
    blocks = cfg.depth + cfg.depth_single_blocks
    frac = sum(checkpointed_split(cfg, spec.checkpoint_every)) / max(1, blocks)
    tokens = spec.micro_batch * (spec.img_tokens + spec.txt_len)
    return tokens / (tokens + 2048) / (1 + frac / 3)


@dataclass
class FitResult:
    spec: RunSpec | None
    estimate: Estimate | None
    reason: str  # which constraint decided, in sentences
    # stage, offload_optimizer, offload_param, micro_batch, checkpoint_every, optimizer_mode
    options: dict = field(default_factory=dict)


CHECKPOINT_CHOICES = (0, 8, 4, 2, 1)  # every k-th block: none, 1/8, 1/4, 1/2, all
# Optimizer modes --fit tries, best training quality first; None = DeepSpeed's own optimizer on fp32 masters
# (the reference). The order of the bf16 modes is the README's measured distance from fp32 masters (weight
# change off by 0.05% bf16-kahan, 3.0% adamw8bit-sr, 4.4% bf16-sr); adafactor-sr last: not AdamW's trajectory.
FIT_MODES: tuple[str | None, ...] = (None, "bf16-kahan", "adamw8bit-sr", "bf16-sr", "adafactor-sr")


def fit_grid(modes: tuple[str | None, ...] = (None,), fixed: dict | None = None,
             allow_nvme: bool = True) -> list[tuple[int, str, str, str | None]]:
    """(stage, optimizer offload, parameter offload, optimizer mode) in the order fit tries them.

    No offload with fp32 masters first; then the bf16-master modes without offload (same speed, less
    training fidelity: each prints its caveat); then offload, which runs the optimizer step on the CPU and
    moves states over PCIe every step (fp32 masters only: deepspeed 0.19.8 offloads bf16 masters only for its
    DeepSpeedCPUAdam); NVMe last. Within a level the lowest stage first.
    """
    fixed = fixed or {}
    rows = []
    for st, oo, op in STAGE_OFFLOAD_GRID:
        if oo == "none" and op == "none":
            continue
        rows.append((st, oo, op, None if None in modes else "fp32"))
    plain = [(st, oo, op) for st, oo, op in STAGE_OFFLOAD_GRID if oo == op == "none"]
    first = [(st, oo, op, m) for m in modes for st, oo, op in plain
             if m is None or optim_modes.get_mode(m).master_dtype == "fp32"]
    second = [(st, oo, op, m) for m in modes for st, oo, op in plain
              if m is not None and optim_modes.get_mode(m).master_dtype == "bf16"]
    if not any(optim_modes.get_mode(m).master_dtype == "fp32" for m in modes if m is not None) and None not in modes:
        rows = []  # only bf16-master modes asked for: nothing may offload
    out = []
    for st, oo, op, m in first + second + rows:
        if fixed.get("stage", st) != st or fixed.get("offload_optimizer", oo) != oo \
                or fixed.get("offload_param", op) != op or (not allow_nvme and "nvme" in (oo, op)):
            continue
        if m is not None and st not in optim_modes.get_mode(m).zero_stages:
            continue
        if (st, oo, op, m) not in out:
            out.append((st, oo, op, m))
    return out


def fit(base: RunSpec, hw: Hardware, margin: float = 0.10, max_micro_batch: int = 16,
        micro_batches: tuple[int, ...] | None = None, fixed: dict | None = None,
        zero_by_stage: dict[int, ZeroSettings] | None = None, allow_nvme: bool = True,
        modes: tuple[str | None, ...] = (None,), settings_for=None) -> FitResult:
    """The fastest configuration of `base` that fits `hw` with `margin`, and why.

    Order (each level dominates the next; `fit_grid`): no offload with fp32 masters, then the optimizer
    `modes` with bf16 masters without offload (best quality first), then optimizer offload, then parameter
    offload, then NVMe -- offload runs the optimizer step on the CPU and moves states over PCIe every step,
    slower than any other choice here; then the lowest ZeRO stage -- stage 3 re-gathers every parameter in
    forward, again in backward (and in recompute), 1.5x the traffic of stages 1-2, and stage 1/2 only add
    memory savings over 0; then, at that stage, the (micro batch, checkpointing) pair with the best
    `throughput_proxy` -- fewest checkpointed blocks unless a larger micro batch gains more, larger micro
    batch on ties.

    `fixed` pins any of stage, offload_optimizer, offload_param, micro_batch, checkpoint_every (what the user
    chose himself); `zero_by_stage` gives the communication settings each stage will really be written with.
    `settings_for(stage, offload_optimizer, offload_param, mode)`, when given, returns the RunSpec fields of the
    very config that row would be written as (gen-config builds it and reads it back with
    run_options_from_ds_config), or raises ValueError when it cannot be written (the row is skipped with that
    reason): what is modelled is what is written.
    """
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    fixed = dict(fixed or {})
    unknown = set(fixed) - {"stage", "offload_optimizer", "offload_param", "micro_batch", "checkpoint_every",
                            "optimizer_mode"}
    if unknown:
        raise ValueError(f"fit cannot pin {sorted(unknown)}")
    if "optimizer_mode" in fixed:
        modes = (fixed.pop("optimizer_mode"),)
    base = base.replace(nodes=hw.nodes, gpus_per_node=hw.gpus_per_node)
    micros = micro_batches or tuple(m for m in (1, 2, 4, 8, 16, 32, 64, 128) if m <= max_micro_batch)
    if "micro_batch" in fixed:
        micros = (fixed["micro_batch"],)
    if not micros:
        raise ValueError("no micro batch to try: raise the largest micro batch allowed")
    ckpts = (fixed["checkpoint_every"],) if "checkpoint_every" in fixed else CHECKPOINT_CHOICES
    grid = fit_grid(modes, fixed, allow_nvme)
    rejected: list[str] = []
    for st, oo, op, mode in grid:
        label = _label(st, oo, op) + (f", optimizer mode {mode}" if mode else "")
        precision = "bf16" if mode is not None and optim_modes.get_mode(mode).master_dtype == "bf16" \
            else base.precision
        row = {"stage": st, "offload_optimizer": oo, "offload_param": op, "optimizer_mode": mode,
               "precision": precision, "zero": (zero_by_stage or {}).get(st, base.zero)}
        if settings_for is not None:
            try:
                row.update(settings_for(st, oo, op, mode))
            except ValueError as e:
                rejected.append((st, oo, op, mode, f"not written ({e})"))
                continue
        try:
            stage_base = base.replace(**row)
        except ValueError as e:
            rejected.append((st, oo, op, mode, str(e)))
            continue
        fitting = []
        for ck in ckpts:
            for mb in micros:
                cand = stage_base.replace(micro_batch=mb, checkpoint_every=ck)
                est = estimate(cand)
                if not verdict(est, hw, margin)[0]:
                    break  # a larger micro batch will not fit either
                fitting.append((throughput_proxy(cand), mb, -_ckpt_count(cand), cand, est))
        if not fitting:
            smallest = stage_base.replace(micro_batch=micros[0], checkpoint_every=max(ckpts, key=_ckpt_rank))
            _, why = verdict(estimate(smallest), hw, margin)
            rejected.append((st, oo, op, mode, f"even micro batch {micros[0]} with "
                             f"{_ckpt_text(smallest.checkpoint_every)} does not fit ({why})"))
            continue
        fitting.sort(key=lambda t: t[:3], reverse=True)
        _, mb, _, spec, est = fitting[0]
        reason = _rejections(rejected) + [f"chose {label}: " + _why_choice(spec, est, hw, margin, micros, ckpts)]
        options = {"stage": st, "offload_optimizer": oo, "offload_param": op, "micro_batch": mb,
                   "checkpoint_every": spec.checkpoint_every, "optimizer_mode": mode}
        if mode is not None:
            m = optim_modes.get_mode(mode)
            reason.append(f"optimizer mode {mode} ({m.optimizer}): {m.caveat}"
                          + (f"; needs pip install 'fluxzero[{m.extra}]'" if m.extra else ""))
        return FitResult(spec, est, "\n".join(reason), options)
    if not grid:
        return FitResult(None, None, "nothing to try: the pinned stage and offload choices contradict each other")
    return FitResult(None, None, "\n".join(_rejections(rejected) + [_what_would_fit(base, hw, margin, micros[0], fixed,
                                                                         allow_nvme)]))


def _rejections(rows: list[tuple]) -> list[str]:
    """One line per (offload, mode) group of rejected rows: "ZeRO-0, 1: ..." with each stage's reason, the
    common beginning ("even micro batch 1 with ... does not fit") said once."""
    groups: dict[tuple, list[tuple[int, str]]] = {}
    for st, oo, op, mode, why in rows:
        groups.setdefault((oo, op, mode), []).append((st, why))
    out = []
    for (oo, op, mode), items in groups.items():
        label = _label(items[0][0], oo, op) + (f", optimizer mode {mode}" if mode else "")
        if len(items) == 1:
            out.append(f"{label}: {items[0][1]}")
            continue
        head = label.replace(f"ZeRO-{items[0][0]}", "ZeRO-" + "/".join(str(st) for st, _ in items), 1)
        prefix = items[0][1].split(" (")[0] + " ("
        if all(why.startswith(prefix) for _, why in items):
            out.append(f"{head}: {prefix[:-2]}: " + "; ".join(f"ZeRO-{st}: {why[len(prefix):-1]}"
                                                            for st, why in items))
        else:
            out.append(f"{head}: " + "; ".join(f"ZeRO-{st}: {why}" for st, why in items))
    return out


def _ckpt_rank(k: int) -> float:
    """Order checkpoint choices by memory saved: 1 (all) saves most, then 2, 4, ..., 0 (none) least."""
    return 0.0 if k == 0 else 1.0 / k


def _ckpt_count(spec: RunSpec) -> int:
    return sum(checkpointed_split(spec.model, spec.checkpoint_every))


def _label(stage: int, oo: str, op: str) -> str:
    off = [f"optimizer offload {oo}"] if oo != "none" else []
    off += [f"parameter offload {op}"] if op != "none" else []
    return f"ZeRO-{stage}" + (f" with {', '.join(off)}" if off else " without offload")


def _ckpt_text(k: int) -> str:
    if k in (0, 1):
        return {0: "no activation checkpointing", 1: "every block checkpointed"}[k]
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"every {k}{suffix} block checkpointed"


def _best_micro(spec: RunSpec, hw: Hardware, margin: float, micros: tuple[int, ...]) -> RunSpec | None:
    best = None
    for mb in micros:
        cand = spec.replace(micro_batch=mb)
        if not verdict(estimate(cand), hw, margin)[0]:
            break
        best = cand
    return best


def _why_choice(spec: RunSpec, est: Estimate, hw: Hardware, margin: float, micros: tuple[int, ...],
                ckpts: tuple[int, ...] = CHECKPOINT_CHOICES) -> str:
    text = (f"micro batch {spec.micro_batch}, {_ckpt_text(spec.checkpoint_every)}; predicted "
            f"{est.gpu_allocated / GiB:.1f} GiB allocated, {est.gpu_total / GiB:.1f} GiB with allocator slack "
            f"and CUDA context, of {hw.gpu_memory_gib * (1 - margin):.1f} GiB budget "
            f"({hw.gpu_memory_gib:g} GiB - {margin:.0%} margin)")
    bigger = [m for m in micros if m > spec.micro_batch]
    if bigger:
        fits, why = verdict(estimate(spec.replace(micro_batch=bigger[0])), hw, margin)
        text += f". Micro batch {bigger[0]} " + ("fits but is not faster" if fits else f"does not fit: {why}")
    else:
        text += f". Micro batch {spec.micro_batch} is the largest allowed"
    # checkpointing fewer blocks: the best micro batch it allows, and why that is not better
    for k in sorted((k for k in ckpts if _ckpt_rank(k) < _ckpt_rank(spec.checkpoint_every)),
                    key=_ckpt_rank, reverse=True):
        alt = _best_micro(spec.replace(checkpoint_every=k), hw, margin, micros)
        if alt is None:
            _, why = verdict(estimate(spec.replace(checkpoint_every=k, micro_batch=micros[0])), hw, margin)
            text += f". With {_ckpt_text(k)} not even micro batch {micros[0]} fits ({why})"
            break  # checkpointing still fewer blocks needs more memory still
        text += (f". With {_ckpt_text(k)} micro batch {alt.micro_batch} fits, estimated "
                 f"{throughput_proxy(alt) / throughput_proxy(spec):.0%} of this speed")
    return text


def _what_would_fit(base: RunSpec, hw: Hardware, margin: float, micro: int, fixed: dict | None = None,
                    allow_nvme: bool = True) -> str:
    """Nothing fits: say what would (another stage or offload than the pinned one, more GPUs, a lower
    resolution, a larger host). Suggestions keep the pins and never use NVMe unless it is allowed."""
    fixed = fixed or {}
    tips = []
    allowed = [(st, oo, op) for st, oo, op in STAGE_OFFLOAD_GRID if allow_nvme or "nvme" not in (oo, op)]
    pinned = [k for k in ("stage", "offload_optimizer", "offload_param") if k in fixed]
    if pinned:  # the pins may be all that stands in the way
        for st, oo, op in allowed:
            r = base.replace(stage=st, offload_optimizer=oo, offload_param=op, micro_batch=micro,
                             checkpoint_every=1)
            if verdict(estimate(r), hw, margin)[0]:
                tips.append(f"{_label(st, oo, op)} at this resolution (instead of the pinned "
                            f"{', '.join(f'{k} {fixed[k]}' for k in pinned)})")
                break
    keep_pins = [(st, oo, op) for st, oo, op in allowed if fixed.get("stage", st) == st
                 and fixed.get("offload_optimizer", oo) == oo and fixed.get("offload_param", op) == op]
    lean = base.replace(stage=3, micro_batch=micro, checkpoint_every=1, offload_optimizer="none",
                        offload_param="none")
    for gpus in (2, 4, 8, 16, 32, 64, 128, 256):
        if gpus <= base.world_size:
            continue
        gpn = min(gpus, max(base.gpus_per_node, 8))
        r = lean.replace(nodes=math.ceil(gpus / gpn), gpus_per_node=gpn)
        if verdict(estimate(r), dataclasses.replace(hw, nodes=r.nodes, gpus_per_node=gpn), margin)[0]:
            tips.append(f"{r.world_size} GPUs ({r.nodes} node(s) x {gpn}) with ZeRO-3, micro batch {micro}, "
                        f"every block checkpointed")
            break
    for px in (1024, 768, 512, 384, 256):
        if px * px >= base.height * base.width:
            continue
        for st, oo, op in keep_pins:
            r = base.replace(height=px, width=px, stage=st, offload_optimizer=oo, offload_param=op,
                             micro_batch=micro, checkpoint_every=1)
            if verdict(estimate(r), hw, margin)[0]:
                tips.append(f"{px}x{px} px with {_label(st, oo, op)}")
                break
        else:
            continue
        break
    full_off = estimate(base.replace(stage=3, offload_optimizer="cpu", offload_param="cpu", micro_batch=micro,
                                     checkpoint_every=1))
    if full_off.gpu_total / GiB <= hw.gpu_memory_gib * (1 - margin):
        tips.append(f"ZeRO-3 with CPU offload of parameters and optimizer, given "
                    f"{full_off.host_per_node / GiB / (1 - margin):.0f} GiB of host memory per node")
    if not allow_nvme:
        r = base.replace(stage=3, offload_optimizer="nvme", offload_param="nvme", micro_batch=micro,
                         checkpoint_every=1)
        if verdict(estimate(r), hw, margin)[0]:
            tips.append("ZeRO-3 with NVMe offload of parameters and optimizer (give a local NVMe folder with "
                        "--nvme-path)")
    return "nothing fits; it would with: " + ("; or ".join(tips) if tips else "a larger GPU")
