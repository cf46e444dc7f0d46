"""The training run file as validated dataclasses (TrainConfig, FlowConfig; the checkpoint:, sample:, validation:
and export: sections are fluxzero.config.sections'); pure Python, no torch."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from fluxzero.config.datasets import parse_data
from fluxzero.config.ema import EmaConfig
from fluxzero.config.keys import and_list as _and
from fluxzero.config.keys import check_types as _check_types
from fluxzero.config.keys import did_you_mean as _did_you_mean
from fluxzero.config.lora import LoraConfig
from fluxzero.config.models import model_name, model_spec, resolve_model
from fluxzero.config.sections import (
    MOVED_TO_SECTIONS,
    SECTIONS,
    CheckpointConfig,
    ExportConfig,
    SampleConfig,
    ValidationConfig,
    moved_to_sections_message,
)
from fluxzero.config.user_files import excerpt

# ---------------------------------------------------------------------------------------------------------
# Training run file (YAML -> TrainConfig). Loading YAML happens in fluxzero.config.runfile.load_config; this stays stdlib only.
# ---------------------------------------------------------------------------------------------------------
# Keys an older run file carried that the DeepSpeed JSON owns now (config/deepspeed/view.py's rule: what DeepSpeed's engine does is
# set in its config, nowhere else), with where each lives there.
MOVED_TO_DEEPSPEED = {
    "micro_batch": "train_micro_batch_size_per_gpu",
    "grad_accum": "gradient_accumulation_steps",
    # never run-file keys, but where people look for them (and `lr` is close enough to `lora` to be suggested)
    "lr": "optimizer.params.lr",
    "learning_rate": "optimizer.params.lr",
    "weight_decay": "optimizer.params.weight_decay",
    "precision": "bf16.enabled / fp16.enabled",
}
MOVED_TO_SCHEDULER = {
    "warmup_steps": "scheduler.params.warmup_num_steps",
    "lr_decay": "scheduler.type",
    "min_lr_ratio": "scheduler.params.cos_min_ratio",
}


def moved_keys_message(keys, deepspeed: str | None) -> str:
    """The one sentence for run-file keys whose values live in the DeepSpeed config now."""
    where = deepspeed if isinstance(deepspeed, str) and deepspeed.strip() else "the file deepspeed: names"
    engine = [k for k in MOVED_TO_DEEPSPEED if k in keys]
    sched = [k for k in MOVED_TO_SCHEDULER if k in keys]
    parts = []
    if engine:
        verb = "is" if len(engine) == 1 else "are"
        parts.append(
            f"{_and(engine)} {verb} set in the DeepSpeed config now "
            f"({_and([MOVED_TO_DEEPSPEED[k] for k in engine])} in {where})"
        )
    if sched:
        verb = "is" if len(sched) == 1 else "are"
        parts.append(
            f"{_and(sched)} {verb} the DeepSpeed scheduler's now "
            f"({_and([MOVED_TO_SCHEDULER[k] for k in sched])} in {where}; "
            f"`fluxzero gen-config --scheduler WarmupCosineLR --warmup-steps N --total-steps M` writes it)"
        )
    them = "it" if len(engine) + len(sched) == 1 else "them"
    return f"{' and '.join(parts)}: remove {them} from the run file"


# Seeds reach torch.manual_seed and torch.Generator, which take at most 64 bits; 63 keep them non-negative
MAX_SEED = 2**63 - 1


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
    # loss weight of the image tokens a cached mask leaves out (0: they teach nothing); tokens half inside get
    # halfway between this and 1
    mask_floor: float = 0.0

    def __post_init__(self):
        _check_types(self, "flow.")
        if self.timestep_sampling not in ("uniform", "logit_normal"):
            raise ValueError(
                f"flow.timestep_sampling must be 'uniform' or 'logit_normal', got {excerpt(self.timestep_sampling)}"
            )
        if self.shift not in ("none", "fixed", "resolution"):
            raise ValueError(f"flow.shift must be 'none', 'fixed' or 'resolution', got {excerpt(self.shift)}")
        import math

        # nan and inf pass every comparison below (logit_mean inf trained with every t = 1)
        for name in ("logit_mean", "logit_std", "shift_value", "guidance"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(
                    f"flow.{name} must be a finite number, got {getattr(self, name)}; "
                    f"remove it to use the default {getattr(type(self), name)}"
                )
        if self.logit_std <= 0:
            raise ValueError(f"flow.logit_std must be positive, got {self.logit_std}")
        if self.shift_value <= 0:
            raise ValueError(f"flow.shift_value must be positive, got {self.shift_value}")
        if not 0.0 <= self.mask_floor <= 1.0:
            raise ValueError(f"flow.mask_floor must be in [0, 1], got {self.mask_floor}")


@dataclass
class TrainConfig:
    """One training run, as written in the YAML run file (command-line `key=value` overrides on top).

    Batch sizes, precision, optimizer, lr schedule and gradient clipping are the DeepSpeed config's
    (`fluxzero.config.deepspeed.view` reads them); this holds what the trainer does around the engine.
    """

    deepspeed: str  # DeepSpeed JSON config (from `fluxzero gen-config`)
    # shard directory, or a synthetic spec "synthetic:n=64,hw=32x32,...", or a list of datasets
    # (fluxzero.config.datasets: each a mapping with path, repeats, loss_weight, caption_dropout)
    data: list | str
    output_dir: str  # checkpoints/, tensorboard/, metrics.jsonl, export
    # a preset name, a mapping {preset: NAME, field: value}, or a diffusers config.json (models.resolve_model);
    # kept as the preset name or the whole shape, so the run.yaml saved with a checkpoint records the shape
    model: dict | str = "flux-tiny"
    weights: str | None = None  # pretrained safetensors file or diffusers folder; None = random init
    steps: int = 0  # optimizer steps; 0 = run `epochs` epochs
    epochs: int = 1
    stop_after: int = 0  # stop (with a checkpoint) after this step although the schedule runs to `steps`
    seed: int = 0
    log_every: int = 1
    attention: str = "auto"  # fluxzero.model.math.set_attention_backend
    # loader worker processes; null = auto (TrainConfig.loader_workers: a few on a GPU, none on the CPU)
    num_workers: int | None = None
    # batches read, noised and copied to the device ahead of the step by a background thread (0 = inside it)
    prefetch_batches: int = 1
    flow: FlowConfig = dataclasses.field(default_factory=FlowConfig)
    # EMA of the trained weights (fluxzero.config.ema.EmaConfig; null = none)
    ema: EmaConfig | None = None
    lora: LoraConfig | None = None  # LoRA adapters (fluxzero.config.lora.LoraConfig); null = full fine-tune
    # around the steps, one section a room (fluxzero.config.sections): saving and resuming, sample images, a
    # held-out validation loss, the export at the end
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    sample: SampleConfig = dataclasses.field(default_factory=SampleConfig)
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    export: ExportConfig = dataclasses.field(default_factory=ExportConfig)

    def __post_init__(self):  # noqa: C901
        if isinstance(self.flow, dict):
            self.flow = FlowConfig(**self.flow)
        if isinstance(self.ema, dict):
            self.ema = EmaConfig.from_dict(self.ema)
        if isinstance(self.lora, dict):
            self.lora = LoraConfig.from_dict(self.lora)
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ValueError(
                f"lora must be a mapping of LoRA options (rank, alpha, targets, ...) or null, got {excerpt(self.lora)}"
            )
        for name, cls in SECTIONS.items():  # a mapping (YAML, Python callers) becomes its frozen section
            if not isinstance(getattr(self, name), cls):
                setattr(self, name, cls.from_dict(getattr(self, name)))
        self.data = parse_data(self.data)
        _check_types(self)
        self.model = model_spec(resolve_model(self.model))
        for f in ("deepspeed", "output_dir"):
            if not getattr(self, f).strip():
                raise ValueError(f"{f} is empty; set it to a path (output_dir holds checkpoints, logs and export)")
        for f in ("deepspeed", "output_dir", "weights"):  # `~/runs` means the home folder, as in a shell
            if getattr(self, f):
                setattr(self, f, os.path.expanduser(getattr(self, f)))
        for f in ("epochs", "log_every"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be at least 1, got {getattr(self, f)}")
        for f in ("steps", "stop_after", "num_workers", "prefetch_batches"):
            if getattr(self, f) is not None and getattr(self, f) < 0:
                raise ValueError(f"{f} must be 0 or more, got {getattr(self, f)}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be a whole number from 0 to 2**63 - 1, got {excerpt(self.seed)}")
        if self.attention not in ("auto", "flash", "efficient", "cudnn", "math"):
            raise ValueError(f"attention must be auto, flash, efficient, cudnn or math, got {excerpt(self.attention)}")
        self._check_across_sections()

    def _check_across_sections(self) -> None:
        """What a section asks of the rest of the run file: an EMA to sample or export, a LoRA to merge, a LoRA
        that fits the model."""
        if self.lora is not None:
            self.lora.check_model(resolve_model(self.model))
        for name in ("sample", "export"):
            if getattr(self, name).weights == "ema" and self.ema is None:
                raise ValueError(
                    f"{name}.weights is ema but the run keeps no EMA; add an ema: section (e.g. ema: "
                    f"{{decay: 0.9999}}) or set {name}.weights to live"
                )
        kontext = resolve_model(self.model).kontext
        if self.sample.reference and not kontext:
            raise ValueError(
                f"sample.reference is an image for a FLUX.1 Kontext model to edit, and model "
                f"{model_name(self.model)} is not one; remove sample.reference, or train a Kontext model "
                f"(flux-kontext-dev, or a model spec with kontext: true)"
            )
        if self.sample.every and kontext and not (self.sample.reference or self.validation.data):
            raise ValueError(
                f"model {model_name(self.model)} is FLUX.1 Kontext, so its previews edit a reference image; "
                f"set sample.reference (an image, or a .safetensors file of its latents), or "
                f"validation.data (the previews then edit its first pair's reference)"
            )
        if self.export.merged and self.lora is None:
            raise ValueError(
                "export.merged merges a LoRA into its base weights, but this run has no lora section; "
                "remove export.merged (a full fine-tune exports the whole model anyway)"
            )
        if self.export.merged and not self.weights:
            raise ValueError(
                "export.merged needs the base weights to merge the LoRA into; set weights: to the "
                "pretrained file the LoRA is trained on, or remove export.merged"
            )

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        moved = set(d) & (set(MOVED_TO_DEEPSPEED) | set(MOVED_TO_SCHEDULER))
        if moved:
            raise ValueError(moved_keys_message(moved, d.get("deepspeed")))
        if set(d) & set(MOVED_TO_SECTIONS):  # an older run file (a saved run.yaml: runfile.read_saved_run nests them)
            raise ValueError(moved_to_sections_message(set(d)))
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(
                f"unknown run-file keys {unknown}{_did_you_mean(unknown, names)}; valid keys: "
                f"{', '.join(sorted(names))}"
            )
        missing = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in d
        )
        if missing:
            raise ValueError(f"the run file must set {', '.join(missing)}")
        flow = d.get("flow") or {}
        if not isinstance(flow, dict):
            raise ValueError("flow must be a mapping of flow options")
        fnames = {f.name for f in dataclasses.fields(FlowConfig)}
        if set(flow) - fnames:
            unknown = sorted(set(flow) - fnames)
            raise ValueError(
                f"unknown flow keys {unknown}{_did_you_mean(unknown, fnames)}; valid keys: {', '.join(sorted(fnames))}"
            )
        return cls(**{**d, "flow": FlowConfig(**flow)})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def loader_workers(self, device_type: str, cpus: int, local_ranks: int) -> int:
        """Worker processes for the loader: num_workers as written, or by default none on the CPU (the
        workers would take cores from the training's own threads) and up to 4 per rank on a GPU, leaving
        each rank one core for its own thread (with 0 workers the loader works inside the step: a large part of a
        GPU step, benchmarks/RESULTS.md)."""
        if self.num_workers is not None:
            return self.num_workers
        if device_type != "cuda":
            return 0
        return max(0, min(4, cpus // max(1, local_ranks) - 1))

    def total_steps(self, batches_per_epoch: int, grad_accum: int) -> int:
        """Optimizer steps of the whole run: `steps`, or `epochs` over a loader of batches_per_epoch micro
        batches, `grad_accum` (the DeepSpeed config's gradient_accumulation_steps) of them per step."""
        return self.steps or max(1, self.epochs * batches_per_epoch // grad_accum)
