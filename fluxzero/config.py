"""Pure-Python configuration: model presets and their derived quantities.

No torch import here: `fluxzero gen-config`, `fluxzero estimate` and friends must stay instant.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a FLUX.1 transformer. Field names follow BFL's `FluxParams`."""

    name: str
    in_channels: int = 64  # 16 latent channels x 2x2 patch
    out_channels: int = 64
    vec_in_dim: int = 768  # CLIP-L pooled
    context_in_dim: int = 4096  # T5-XXL hidden
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19  # double-stream blocks
    depth_single_blocks: int = 38
    axes_dim: tuple[int, int, int] = (16, 56, 56)
    theta: int = 10_000
    qkv_bias: bool = True
    guidance_embed: bool = True

    def __post_init__(self):
        for f in ("in_channels", "out_channels", "vec_in_dim", "context_in_dim", "hidden_size", "num_heads"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model {self.name!r}: {f} must be positive, got {getattr(self, f)}")
        if self.depth < 0 or self.depth_single_blocks < 0:
            raise ValueError(f"model {self.name!r}: depth and depth_single_blocks must be >= 0")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model {self.name!r}: hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}"
            )
        if sum(self.axes_dim) != self.head_dim:
            raise ValueError(
                f"model {self.name!r}: axes_dim {self.axes_dim} must sum to the head dim {self.head_dim}"
            )
        if any(d % 2 for d in self.axes_dim):
            raise ValueError(f"model {self.name!r}: every entry of axes_dim {self.axes_dim} must be even (RoPE pairs)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def latent_channels(self) -> int:
        """Channels of the VAE latent before 2x2 packing (16 for FLUX.1)."""
        return self.in_channels // 4

    def num_params(self) -> int:
        """Parameter count of the transformer (flux-dev: 11,901,408,320), from the architecture alone."""
        C, M, D = self.hidden_size, self.mlp_hidden_dim, self.head_dim

        def linear(n_in: int, n_out: int, bias: bool = True) -> int:
            return n_in * n_out + (n_out if bias else 0)

        embed = linear(self.in_channels, C) + linear(self.context_in_dim, C)  # img_in, txt_in
        embed += linear(256, C) + linear(C, C) + linear(self.vec_in_dim, C) + linear(C, C)  # time_in, vector_in
        if self.guidance_embed:
            embed += linear(256, C) + linear(C, C)  # guidance_in
        stream = (linear(C, 6 * C) + linear(C, 3 * C, self.qkv_bias) + 2 * D  # mod, qkv, q/k norm scales
                  + linear(C, C) + linear(C, M) + linear(M, C))  # proj, mlp
        single = linear(C, 3 * C + M) + linear(C + M, C) + 2 * D + linear(C, 3 * C)  # linear1/2, norm, mod
        final = linear(C, self.out_channels) + linear(C, 2 * C)
        return embed + self.depth * 2 * stream + self.depth_single_blocks * single + final

    def flops_per_sample(self, img_tokens: int, txt_tokens: int) -> float:
        """Forward FLOPs of one sample (multiply-add = 2 FLOPs); training step is about 3x this.

        Counted: every linear layer on the tokens that pass through it, attention's QK^T and AV, and the
        per-sample work (modulation, embedders, final adaLN) once per sample. Not counted (memory-bound,
        < 1% at FLUX sizes): norms, RoPE, softmax, activations, biases, residual adds.
        With C hidden, M mlp hidden, I img tokens, T txt tokens, L = I + T:
          double block: 2 (I + T) (3C^2 + C^2 + 2CM)   qkv, proj, mlp per stream
                        + 4 L^2 C                      QK^T (2 L^2 D per head) + AV (the same), H heads
                        + 2 * 2 * 6 C^2                img and txt modulation, per sample
          single block: 2 L (C (3C + M) + (C + M) C) + 4 L^2 C + 2 * 3 C^2
          embedders:    2 I in C + 2 T ctx C + 2 (256 C + C^2) (time, guidance) + 2 (vec C + C^2)
          final layer:  2 I C out + 2 * 2 C^2
        """
        C, M, I, T = self.hidden_size, self.mlp_hidden_dim, img_tokens, txt_tokens
        L = I + T
        attn = 4 * L * L * C
        double = 2 * L * (4 * C * C + 2 * C * M) + attn + 2 * 2 * 6 * C * C
        single = 2 * L * (C * (3 * C + M) + (C + M) * C) + attn + 2 * 3 * C * C
        embed = 2 * I * self.in_channels * C + 2 * T * self.context_in_dim * C
        embed += 2 * (256 * C + C * C) * (2 if self.guidance_embed else 1) + 2 * (self.vec_in_dim * C + C * C)
        final = 2 * I * C * self.out_channels + 2 * 2 * C * C
        return float(self.depth * double + self.depth_single_blocks * single + embed + final)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


_FLUX_DEV = ModelConfig(name="flux-dev")

MODEL_PRESETS: dict[str, ModelConfig] = {
    "flux-dev": _FLUX_DEV,
    "flux-schnell": _FLUX_DEV.replace(name="flux-schnell", guidance_embed=False),
    # Full width (so per-block kernels and MFU are representative), a quarter of the depth: fits one GPU
    # with plain data parallelism and AdamW, for benchmarks.
    "flux-dev-lite": _FLUX_DEV.replace(name="flux-dev-lite", depth=5, depth_single_blocks=10),
    # Tiny presets for tests and the CPU quick start: every code path of the real model, in milliseconds.
    "flux-tiny": _FLUX_DEV.replace(
        name="flux-tiny", hidden_size=64, num_heads=4, axes_dim=(4, 6, 6), depth=2, depth_single_blocks=2,
        context_in_dim=64, vec_in_dim=32,
    ),
}
MODEL_PRESETS["flux-tiny-schnell"] = MODEL_PRESETS["flux-tiny"].replace(name="flux-tiny-schnell", guidance_embed=False)


def get_model_config(name: str) -> ModelConfig:
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(MODEL_PRESETS)}") from None


def reshaped(base: ModelConfig, *, depth: int | None = None, depth_single_blocks: int | None = None,
             hidden_size: int | None = None, num_heads: int | None = None) -> ModelConfig:
    """`base` with another block count or width (what-if sizing); RoPE axes follow the new head dim.

    Raises ValueError with one sentence when the shape cannot exist.
    """
    changes = {k: v for k, v in dict(depth=depth, depth_single_blocks=depth_single_blocks,
                                     hidden_size=hidden_size, num_heads=num_heads).items() if v is not None}
    if not changes:
        return base
    hidden, heads = changes.get("hidden_size", base.hidden_size), changes.get("num_heads", base.num_heads)
    if hidden % heads or (hidden // heads) % 2:
        raise ValueError(f"hidden size {hidden} / {heads} heads must give an even whole head dim")
    head_dim = hidden // heads
    if head_dim != base.head_dim:  # FLUX splits 128 as (16, 56, 56): keep the proportions, even entries
        side = 2 * max(1, round(head_dim * base.axes_dim[1] / base.head_dim / 2))
        if head_dim - 2 * side < 2:
            raise ValueError(f"head dim {head_dim} is too small for 3-axis RoPE")
        changes["axes_dim"] = (head_dim - 2 * side, side, side)
    desc = ", ".join(f"{k}={v}" for k, v in changes.items() if k != "axes_dim")
    return dataclasses.replace(base, name=f"{base.name} ({desc})", **changes)


# ---------------------------------------------------------------------------------------------------------
# Training run file (YAML -> TrainConfig). Loading YAML happens in fluxzero.train; this stays stdlib only.
# ---------------------------------------------------------------------------------------------------------
PRECISIONS = ("fp32", "bf16", "fp16")


def _check_types(obj, prefix: str = "") -> None:
    """Each field of a run-file dataclass has the type its annotation names (YAML gives `steps: abc` a str,
    `resume: maybe` a str that would read as true); ints are accepted where a float is expected."""
    for f in dataclasses.fields(obj):
        value, kind = getattr(obj, f.name), str(f.type)
        if value is None and "None" in kind:
            continue
        if kind.startswith("int"):
            ok, want = isinstance(value, int) and not isinstance(value, bool), "a whole number"
        elif kind.startswith("float"):
            ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
            if ok:
                setattr(obj, f.name, float(value))
        elif kind.startswith("bool"):
            ok, want = isinstance(value, bool), "true or false"
        elif kind.startswith("str"):
            if isinstance(value, os.PathLike):  # Python callers may pass paths
                value = os.fspath(value)
                setattr(obj, f.name, value)
            ok, want = isinstance(value, str), "text" + (" or null" if "None" in kind else "")
        else:
            continue
        if not ok:
            raise ValueError(f"{prefix}{f.name} must be {want}, got {value!r}")


def _did_you_mean(unknown: list, names) -> str:
    import difflib

    hints = [f"{m[0]!r} for {k!r}" for k in unknown
             if (m := difflib.get_close_matches(str(k), sorted(names), n=1, cutoff=0.6))]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


@dataclass
class FlowConfig:
    """Rectified-flow options: how timesteps are drawn and shifted, and the guidance value fed to the model."""

    timestep_sampling: str = "logit_normal"  # "uniform" | "logit_normal" (SD3's best in its ablation)
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: str = "resolution"  # "none" | "fixed" (factor shift_value) | "resolution" (BFL's mu schedule)
    shift_value: float = 3.0
    # Guidance-distilled models (FLUX.1-dev) take a guidance input. 1.0 asks for the plain conditional
    # velocity, which is exactly what the training target noise - x0 is; a larger value would teach the
    # model that "guided" means "unguided" and wash out the distilled guidance. Ignored for schnell.
    guidance: float = 1.0

    def __post_init__(self):
        _check_types(self, "flow.")
        if self.timestep_sampling not in ("uniform", "logit_normal"):
            raise ValueError(f"flow.timestep_sampling must be 'uniform' or 'logit_normal', got {self.timestep_sampling!r}")
        if self.shift not in ("none", "fixed", "resolution"):
            raise ValueError(f"flow.shift must be 'none', 'fixed' or 'resolution', got {self.shift!r}")
        if self.logit_std <= 0:
            raise ValueError(f"flow.logit_std must be positive, got {self.logit_std}")
        if self.shift_value <= 0:
            raise ValueError(f"flow.shift_value must be positive, got {self.shift_value}")


@dataclass
class TrainConfig:
    """One training run, as written in the YAML run file (command-line `key=value` overrides on top)."""

    deepspeed: str  # DeepSpeed JSON config (from `fluxzero gen-config`)
    data: str  # shard directory, or a synthetic spec "synthetic:n=64,hw=32x32,..."
    output_dir: str  # checkpoints/, tensorboard/, metrics.jsonl, export
    model: str = "flux-tiny"  # preset name
    weights: str | None = None  # pretrained safetensors file or diffusers folder; None = random init
    micro_batch: int = 1  # must equal the DeepSpeed config's train_micro_batch_size_per_gpu
    grad_accum: int = 1  # must equal gradient_accumulation_steps
    precision: str = "fp32"  # must match the DeepSpeed config's bf16 / fp16 sections
    steps: int = 0  # optimizer steps; 0 = run `epochs` epochs
    epochs: int = 1
    stop_after: int = 0  # stop (with a checkpoint) after this step although the schedule runs to `steps`
    seed: int = 0
    # lr schedule on the DeepSpeed optimizer's lr, used when the DeepSpeed config has no "scheduler"
    warmup_steps: int = 0  # linear warmup
    lr_decay: str = "constant"  # "constant" | "cosine" | "linear" after warmup
    min_lr_ratio: float = 0.0
    checkpoint_every: int = 0  # steps; 0 = only at the end
    keep_checkpoints: int = 0  # keep the newest N checkpoints, deleting older ones after each save; 0 = all
    log_every: int = 1
    resume: bool = True  # continue from output_dir/checkpoints/latest when it exists
    export_format: str | None = "bfl"  # export the final weights: "bfl" | "diffusers" | "comfyui" | None
    export_dtype: str = "bf16"
    attention: str = "auto"  # fluxzero.model.math.set_attention_backend
    num_workers: int = 0
    flow: FlowConfig = dataclasses.field(default_factory=FlowConfig)

    def __post_init__(self):
        if isinstance(self.flow, dict):
            self.flow = FlowConfig(**self.flow)
        _check_types(self)
        get_model_config(self.model)
        for f in ("deepspeed", "data", "output_dir"):
            if not getattr(self, f).strip():
                raise ValueError(f"{f} is empty; set it to a path (output_dir holds checkpoints, logs and export)")
        for f in ("deepspeed", "data", "output_dir", "weights"):  # `~/runs` means the home folder, as in a shell
            if getattr(self, f):
                setattr(self, f, os.path.expanduser(getattr(self, f)))
        for f in ("micro_batch", "grad_accum", "epochs", "log_every"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be at least 1, got {getattr(self, f)}")
        for f in ("steps", "stop_after", "warmup_steps", "checkpoint_every", "keep_checkpoints", "num_workers"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be 0 or more, got {getattr(self, f)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.lr_decay not in ("constant", "cosine", "linear"):
            raise ValueError(f"lr_decay must be 'constant', 'cosine' or 'linear', got {self.lr_decay!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.export_format not in (None, "bfl", "diffusers", "comfyui"):
            raise ValueError(f"export_format must be bfl, diffusers, comfyui or null, got {self.export_format!r}")
        if self.export_dtype not in ("bf16", "fp32"):
            raise ValueError(f"export_dtype must be bf16 or fp32, got {self.export_dtype!r}")
        if self.attention not in ("auto", "flash", "efficient", "cudnn", "math"):
            raise ValueError(f"attention must be auto, flash, efficient, cudnn or math, got {self.attention!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown run-file keys {unknown}{_did_you_mean(unknown, names)}; valid keys: "
                             f"{', '.join(sorted(names))}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                         and f.name not in d)
        if missing:
            raise ValueError(f"the run file must set {', '.join(missing)}")
        flow = d.get("flow") or {}
        if not isinstance(flow, dict):
            raise ValueError("flow must be a mapping of flow options")
        fnames = {f.name for f in dataclasses.fields(FlowConfig)}
        if set(flow) - fnames:
            unknown = sorted(set(flow) - fnames)
            raise ValueError(f"unknown flow keys {unknown}{_did_you_mean(unknown, fnames)}; valid keys: "
                             f"{', '.join(sorted(fnames))}")
        return cls(**{**d, "flow": FlowConfig(**flow)})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def global_batch(self, world_size: int) -> int:
        return self.micro_batch * self.grad_accum * world_size

    def total_steps(self, batches_per_epoch: int) -> int:
        """Optimizer steps of the whole run: `steps`, or `epochs` over a loader of batches_per_epoch."""
        return self.steps or max(1, self.epochs * batches_per_epoch // self.grad_accum)

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Multiplier on the optimizer's base lr for optimizer step `step` (0-based): warmup, then decay."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.lr_decay == "constant":
            return 1.0
        span = max(1, total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.lr_decay == "linear":
            decay = 1.0 - progress
        else:
            import math

            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay

    def check_deepspeed(self, ds: dict, world_size: int, source: str = "the DeepSpeed config") -> None:
        """Raise ValueError naming the field when the DeepSpeed config contradicts this run file."""
        def get(key):
            v = ds.get(key, "auto")
            return None if v == "auto" else v

        mb, ga, tb = get("train_micro_batch_size_per_gpu"), get("gradient_accumulation_steps"), get("train_batch_size")
        if mb is not None and mb != self.micro_batch:
            raise ValueError(f"{source} has train_micro_batch_size_per_gpu {mb} but the run file has micro_batch "
                             f"{self.micro_batch}; make them equal")
        if ga is not None and ga != self.grad_accum:
            raise ValueError(f"{source} has gradient_accumulation_steps {ga} but the run file has grad_accum "
                             f"{self.grad_accum}; make them equal")
        if tb is not None and tb != self.global_batch(world_size):
            raise ValueError(f"{source} has train_batch_size {tb} but micro_batch {self.micro_batch} x grad_accum "
                             f"{self.grad_accum} x world size {world_size} = {self.global_batch(world_size)}; "
                             f"fix train_batch_size or launch {tb // (self.micro_batch * self.grad_accum) or 1} ranks")
        ds_precision = ("bf16" if (ds.get("bf16") or {}).get("enabled")
                        else "fp16" if (ds.get("fp16") or {}).get("enabled") else "fp32")
        if ds_precision != self.precision:
            raise ValueError(f"{source} trains in {ds_precision} but the run file has precision {self.precision}; "
                             f"make them agree")
        if "gradient_clipping" not in ds:
            raise ValueError(f"{source} does not set gradient_clipping; set it explicitly (DeepSpeed 0.19.8 "
                             f"silently defaults to 1.0; 0.0 turns clipping off)")
        if "optimizer" not in ds:
            raise ValueError(f"{source} has no optimizer section; add one (e.g. from `fluxzero gen-config`)")
        if "scheduler" in ds and (self.warmup_steps or self.lr_decay != "constant"):
            raise ValueError(f"{source} has a scheduler and the run file sets warmup_steps/lr_decay; keep one lr "
                             f"schedule (gen-config --scheduler none, or drop warmup_steps and lr_decay)")
