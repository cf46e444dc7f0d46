"""The training run file as validated dataclasses (TrainConfig, FlowConfig); pure Python, no torch."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from fluxzero.config.models import get_model_config


# ---------------------------------------------------------------------------------------------------------
# Training run file (YAML -> TrainConfig). Loading YAML happens in load_config below, inside the call; this stays stdlib only.
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
