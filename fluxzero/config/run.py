"""The training run file as validated dataclasses (TrainConfig, FlowConfig); pure Python, no torch."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from fluxzero.config.models import get_model_config


# ---------------------------------------------------------------------------------------------------------
# Training run file (YAML -> TrainConfig). Loading YAML happens in load_config below, inside the call; this stays stdlib only.
# ---------------------------------------------------------------------------------------------------------
# Keys an older run file carried that the DeepSpeed JSON owns now (ds_view's rule: what DeepSpeed's engine does is
# set in its config, nowhere else), with where each lives there.
MOVED_TO_DEEPSPEED = {
    "micro_batch": "train_micro_batch_size_per_gpu",
    "grad_accum": "gradient_accumulation_steps",
    "precision": "bf16.enabled / fp16.enabled",
}
MOVED_TO_SCHEDULER = {
    "warmup_steps": "scheduler.params.warmup_num_steps",
    "lr_decay": "scheduler.type",
    "min_lr_ratio": "scheduler.params.cos_min_ratio",
}


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def moved_keys_message(keys, deepspeed: str | None) -> str:
    """The one sentence for run-file keys whose values live in the DeepSpeed config now."""
    where = deepspeed if isinstance(deepspeed, str) and deepspeed.strip() else "the file deepspeed: names"
    engine = [k for k in MOVED_TO_DEEPSPEED if k in keys]
    sched = [k for k in MOVED_TO_SCHEDULER if k in keys]
    parts = []
    if engine:
        verb = "is" if len(engine) == 1 else "are"
        parts.append(f"{_and(engine)} {verb} set in the DeepSpeed config now "
                     f"({_and([MOVED_TO_DEEPSPEED[k] for k in engine])} in {where})")
    if sched:
        verb = "is" if len(sched) == 1 else "are"
        parts.append(f"{_and(sched)} {verb} the DeepSpeed scheduler's now "
                     f"({_and([MOVED_TO_SCHEDULER[k] for k in sched])} in {where}; "
                     f"`fluxzero gen-config --scheduler WarmupCosineLR --warmup-steps N --total-steps M` writes it)")
    them = "it" if len(engine) + len(sched) == 1 else "them"
    return f"{' and '.join(parts)}: remove {them} from the run file"


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
        import math

        # nan and inf pass every comparison below (logit_mean inf trained with every t = 1)
        for name in ("logit_mean", "logit_std", "shift_value", "guidance"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"flow.{name} must be a finite number, got {getattr(self, name)}; "
                                 f"remove it to use the default {getattr(type(self), name)}")
        if self.logit_std <= 0:
            raise ValueError(f"flow.logit_std must be positive, got {self.logit_std}")
        if self.shift_value <= 0:
            raise ValueError(f"flow.shift_value must be positive, got {self.shift_value}")


@dataclass
class TrainConfig:
    """One training run, as written in the YAML run file (command-line `key=value` overrides on top).

    Batch sizes, precision, optimizer, lr schedule and gradient clipping are the DeepSpeed config's
    (`fluxzero.config.ds_view` reads them); this holds what the trainer does around the engine.
    """

    deepspeed: str  # DeepSpeed JSON config (from `fluxzero gen-config`)
    data: str  # shard directory, or a synthetic spec "synthetic:n=64,hw=32x32,..."
    output_dir: str  # checkpoints/, tensorboard/, metrics.jsonl, export
    model: str = "flux-tiny"  # preset name
    weights: str | None = None  # pretrained safetensors file or diffusers folder; None = random init
    steps: int = 0  # optimizer steps; 0 = run `epochs` epochs
    epochs: int = 1
    stop_after: int = 0  # stop (with a checkpoint) after this step although the schedule runs to `steps`
    seed: int = 0
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
        for f in ("epochs", "log_every"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be at least 1, got {getattr(self, f)}")
        for f in ("steps", "stop_after", "checkpoint_every", "keep_checkpoints", "num_workers"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be 0 or more, got {getattr(self, f)}")
        if self.export_format not in (None, "bfl", "diffusers", "comfyui"):
            raise ValueError(f"export_format must be bfl, diffusers, comfyui or null, got {self.export_format!r}")
        if self.export_dtype not in ("bf16", "fp32"):
            raise ValueError(f"export_dtype must be bf16 or fp32, got {self.export_dtype!r}")
        if self.attention not in ("auto", "flash", "efficient", "cudnn", "math"):
            raise ValueError(f"attention must be auto, flash, efficient, cudnn or math, got {self.attention!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        moved = set(d) & (set(MOVED_TO_DEEPSPEED) | set(MOVED_TO_SCHEDULER))
        if moved:
            raise ValueError(moved_keys_message(moved, d.get("deepspeed")))
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

    def total_steps(self, batches_per_epoch: int, grad_accum: int) -> int:
        """Optimizer steps of the whole run: `steps`, or `epochs` over a loader of batches_per_epoch micro
        batches, `grad_accum` (the DeepSpeed config's gradient_accumulation_steps) of them per step."""
        return self.steps or max(1, self.epochs * batches_per_epoch // grad_accum)
