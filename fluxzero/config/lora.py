"""The run file's `lora:` section (LoraConfig) and the named target presets; pure Python, no torch.

Targets are fnmatch patterns (shell globs: `*`, `?`, `[...]`; `*` also matches dots) over our module names,
which follow BFL's reference (`double_blocks.3.img_attn.qkv`, `single_blocks.10.linear1`). Globs rather than
regexes because they read naturally in YAML and need no escaping of the dots in every name.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

from fluxzero.config.architecture import linear_shapes
from fluxzero.config.keys import did_you_mean
from fluxzero.config.user_files import excerpt

# What each stream of a double block and each single block holds, by preset. A single block's attention
# and MLP share fused linears (linear1 = q, k, v and MLP-in; linear2 = attn-out and MLP-out), so even the
# "attention" preset adapts the single blocks' MLP rows: a LoRA cannot cover part of one linear's rows.
_ATTN = (
    "double_blocks.*.img_attn.qkv",
    "double_blocks.*.img_attn.proj",
    "double_blocks.*.txt_attn.qkv",
    "double_blocks.*.txt_attn.proj",
    "single_blocks.*.linear1",
    "single_blocks.*.linear2",
)
_MLP = (
    "double_blocks.*.img_mlp.0",
    "double_blocks.*.img_mlp.2",
    "double_blocks.*.txt_mlp.0",
    "double_blocks.*.txt_mlp.2",
)
_MOD = ("double_blocks.*.img_mod.lin", "double_blocks.*.txt_mod.lin", "single_blocks.*.modulation.lin")
TARGET_PRESETS: dict[str, tuple[str, ...]] = {
    "attention": _ATTN,
    "attention+mlp": _ATTN + _MLP,
    # Every linear of every block. The embedders (img_in, txt_in, time_in, ...) and final_layer stay out,
    # as in PEFT's own "all-linear"; name them as patterns to adapt them too.
    "all-linear": _ATTN + _MLP + _MOD,
}
DEFAULT_TARGETS = "attention+mlp"  # lora.targets when the run file leaves it out, and the CLI's --lora-targets
# PEFT's initialisations that leave the frozen base weights untouched and start at the base model's output
# (B = 0): "default" = Kaiming-uniform A, "gaussian" = normal A (std 1/rank). PiSSA / OLoRA / CorDA rewrite the
# base weights (W <- W - BA), which a ZeRO-3 placeholder cannot hold and which would make every saved LoRA
# valid only against the rewritten base.
LORA_INITS = ("default", "gaussian")
# How the frozen base's block linears are stored under a LoRA (fluxzero/model/quant.py): in the training dtype,
# weight-only quantized through torchao (int8: one scale per output row; fp8: e4m3, one scale per row), or
# fp8-matmul: e4m3 with one scale per row like fp8, its forward matmuls in FP8 (activations quantized per token;
# needs an Ada or Hopper GPU)
BASE_QUANTS = ("none", "int8", "fp8", "fp8-matmul")
# What is trained on each targeted linear (all through PEFT): "lora" = B A; "dora" = LoRA plus a trained magnitude
# per output row, m (W + s B A) / ||W + s B A||; "lokr" = a Kronecker product w1 (x) w2, w2 (and with
# decompose_both w1) itself low-rank when the rank is small against its shape (PEFT's and LyCORIS' rule).
ADAPTER_TYPES = ("lora", "dora", "lokr")
ADAPTER_NAMES = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr"}  # as messages write them
_LOKR_KEYS = ("factor", "decompose_both")


@dataclass
class LoraConfig:
    """Adapters on the transformer's linears, only they trained: W x + (alpha / rank) B A x for a LoRA (type
    sets DoRA or LoKr instead, ADAPTER_TYPES)."""

    rank: int = 16
    alpha: float | None = None  # None = rank (scale 1)
    dropout: float = 0.0  # on the adapter's input, training only
    init: str = "default"  # one of LORA_INITS
    targets: str | list[str] = DEFAULT_TARGETS  # a TARGET_PRESETS name or a list of fnmatch module-name patterns
    weights: str | None = None  # a LoRA .safetensors file (diffusers or kohya layout) to continue from
    base_quant: str = "none"  # one of BASE_QUANTS: the frozen base's block linears stored quantized (QLoRA-style)
    type: str = "lora"  # one of ADAPTER_TYPES
    factor: int = -1  # lokr: the Kronecker split of each dimension (-1: the divisors nearest its square root)
    decompose_both: bool = False  # lokr: w1 low-rank too, not only w2

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise ValueError(
                f"lora.rank must be a whole number of at least 1, got {excerpt(self.rank)}; set e.g. rank: 16"
            )
        if self.alpha is None:
            self.alpha = float(self.rank)
        if (
            not isinstance(self.alpha, (int, float))
            or isinstance(self.alpha, bool)
            or not self.alpha > 0
            or not math.isfinite(self.alpha)
        ):
            raise ValueError(
                f"lora.alpha must be a positive number (finite), got {excerpt(self.alpha)}; set it to the "
                "rank (scale 1) or leave it out"
            )
        self.alpha = float(self.alpha)
        if not isinstance(self.dropout, (int, float)) or isinstance(self.dropout, bool) or not 0 <= self.dropout < 1:
            raise ValueError(
                f"lora.dropout must be a number in [0, 1), got {excerpt(self.dropout)}; use 0 to turn it off"
            )
        self.dropout = float(self.dropout)
        if self.init not in LORA_INITS:
            why = (
                " (it rewrites the frozen base weights, which ZeRO-3 placeholders cannot hold and saved LoRA "
                "files would then depend on)"
                if str(self.init).lower().startswith(("pissa", "olora", "corda"))
                else ""
            )
            raise ValueError(f"lora.init must be one of {', '.join(LORA_INITS)}, got {excerpt(self.init)}{why}")
        if self.base_quant not in BASE_QUANTS:
            raise ValueError(f"lora.base_quant must be one of {', '.join(BASE_QUANTS)}, got {excerpt(self.base_quant)}")
        self._check_type()
        self._check_targets()
        if isinstance(self.weights, os.PathLike):
            self.weights = os.fspath(self.weights)
        if self.weights is not None:
            if not isinstance(self.weights, str) or not self.weights.strip():
                raise ValueError(
                    f"lora.weights must be a path to a LoRA .safetensors file or null, got {excerpt(self.weights)}"
                )
            self.weights = os.path.expanduser(self.weights)
            if self.type != "lora":
                raise ValueError(
                    f"lora.weights continues a plain LoRA file, and lora.type is {self.type}; remove "
                    "lora.weights (resuming the run's own checkpoint needs none) or set lora.type: lora"
                )

    def _check_type(self) -> None:
        if self.type not in ADAPTER_TYPES:
            raise ValueError(f"lora.type must be one of {', '.join(ADAPTER_TYPES)}, got {self.type!r}")
        if (
            not isinstance(self.factor, int)
            or isinstance(self.factor, bool)
            or not (self.factor == -1 or self.factor >= 1)
        ):
            raise ValueError(f"lora.factor must be -1 (automatic) or a whole number of at least 1, got {self.factor!r}")
        if not isinstance(self.decompose_both, bool):
            raise ValueError(f"lora.decompose_both must be true or false, got {self.decompose_both!r}")
        if self.type != "lokr" and (self.factor != -1 or self.decompose_both):
            raise ValueError(
                f"lora.factor and lora.decompose_both shape a LoKr; set lora.type: lokr or remove them "
                f"(lora.type is {self.type})"
            )
        if self.type == "lokr" and (self.dropout or self.init != "default"):
            raise ValueError(
                "a LoKr (lora.type: lokr) has no lora.dropout or lora.init (PEFT draws w2 as LyCORIS does "
                "and starts w1 at 0); remove them"
            )
        if self.type != "lora" and self.base_quant != "none":
            raise ValueError(
                f"lora.base_quant {self.base_quant} quantizes the base under a plain LoRA only ({self.type} "
                "reads the base weight in its own forward); set lora.base_quant: none or lora.type: lora"
            )

    def _check_targets(self) -> None:
        presets = ", ".join(TARGET_PRESETS)
        if isinstance(self.targets, str):
            if self.targets not in TARGET_PRESETS:
                raise ValueError(
                    f"lora.targets {excerpt(self.targets)} is not a preset; use one of {presets}, or a list "
                    "of module-name patterns such as ['double_blocks.*.img_attn.qkv']"
                )
            return
        if isinstance(self.targets, tuple):
            self.targets = list(self.targets)
        if (
            not isinstance(self.targets, list)
            or not self.targets
            or not all(isinstance(p, str) and p.strip() for p in self.targets)
        ):
            raise ValueError(
                f"lora.targets must be a preset ({presets}) or a non-empty list of module-name patterns, "
                f"got {excerpt(self.targets)}"
            )

    @property
    def scale(self) -> float:
        """alpha / rank: the factor on B A."""
        return self.alpha / self.rank

    @property
    def patterns(self) -> tuple[str, ...]:
        """The fnmatch patterns the targets stand for."""
        return TARGET_PRESETS[self.targets] if isinstance(self.targets, str) else tuple(self.targets)

    @classmethod
    def from_dict(cls, d: dict) -> LoraConfig:
        """From the run file's `lora:` mapping; unknown keys are refused with the valid ones listed."""
        if not isinstance(d, dict):
            raise ValueError(f"lora must be a mapping of LoRA options (rank, alpha, ...), got {excerpt(d)}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if set(unknown) & {"lr", "learning_rate"}:  # a LoRA's lr is the optimizer's, as for a full fine-tune
            raise ValueError(
                "the lr is not a lora key: it lives in the DeepSpeed config (optimizer.params.lr in "
                "the file deepspeed: names), for a LoRA as for a full fine-tune"
            )
        if unknown:
            raise ValueError(
                f"unknown lora keys {unknown}{did_you_mean(unknown, names)}; valid keys: {', '.join(names)}"
            )
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check_model(self, model_cfg) -> None:
        """ValueError (one sentence naming the setting) unless these adapters fit a model of shape `model_cfg` (a
        ModelConfig): a rank from 1 to the model's width (a larger one adds nothing but memory), targets
        that select linears of it, every pattern of a list at least one (fluxzero.model.lora.target_modules
        applies the same rule to the built model), and a LoKr factor no larger than the smallest targeted
        dimension. The one check of a LoRA against its model, for the run file, gen-config and the memory model."""
        import fnmatch

        width = model_cfg.hidden_size
        if self.rank > width:
            raise ValueError(
                f"lora.rank must be from 1 to the model's width {width} ({model_cfg.name}), got "
                f"{self.rank}; set e.g. rank: 16"
            )
        shapes = linear_shapes(model_cfg)
        hits = {p: [n for n in shapes if fnmatch.fnmatchcase(n, p)] for p in self.patterns}
        if isinstance(self.targets, str):
            if not any(hits.values()):
                raise ValueError(
                    f"lora.targets {self.targets!r} selects no linear layer of {model_cfg.name}; name "
                    f"module patterns instead (e.g. img_in, final_layer.linear)"
                )
        else:
            missed = [p for p, hit in hits.items() if not hit]
            if missed:
                raise ValueError(
                    f"lora.targets pattern {excerpt(missed[0])} matches no linear layer of {model_cfg.name}; "
                    f"patterns are fnmatch globs over whole module names such as "
                    f"double_blocks.*.img_attn.qkv or single_blocks.*.linear1"
                )
        if self.type == "lokr" and self.factor != -1:
            # PEFT splits each dimension as (factor, dim / factor) only when factor divides it; a factor past a
            # dimension silently falls back to the automatic split there, so it would not mean what it says.
            name, dim = min(((n, d) for hit in hits.values() for n in hit for d in shapes[n]), key=lambda nd: nd[1])
            if self.factor > dim:
                raise ValueError(
                    f"lora.factor {self.factor} is larger than the smallest dimension {dim} of a targeted layer "
                    f"({name} of {model_cfg.name}); set lora.factor from 1 to {dim}, or -1 (automatic)"
                )


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """(m, n), m <= n, m x n = dimension: LoKr's split of one dimension (peft.tuners.lokr.layer.factorization, the
    same rule, here without torch for the memory model): m = factor when it divides, else the divisor pair nearest
    the square root, or nearest `factor` from below."""
    if factor > 0 and dimension % factor == 0:
        return factor, dimension // factor
    if factor == -1:
        factor = dimension
    m, n = 1, dimension
    while m < n:
        new_m = m + 1
        while dimension % new_m:
            new_m += 1
        new_n = dimension // new_m
        if new_m + new_n > dimension + 1 or new_m > factor:
            break
        m, n = new_m, new_n
    return (n, m) if m > n else (m, n)


def lokr_factors(shape: tuple[int, int], lora_cfg: LoraConfig) -> tuple[tuple[int, int, bool], tuple[int, int, bool]]:
    """A LoKr's two factors on a linear of (in_features, out_features): (rows, columns, low-rank?) of w1 and of w2,
    kron(w1, w2) the (out, in) update. A low-rank factor is a product of two rank-r matrices (PEFT's use_w1 /
    use_w2 rule: w1 only with decompose_both, each only where the rank is below half its larger side)."""
    fan_in, fan_out = shape
    r = lora_cfg.rank
    (a, c), (b, d) = factorization(fan_out, lora_cfg.factor), factorization(fan_in, lora_cfg.factor)
    return (a, b, lora_cfg.decompose_both and r < max(a, b) / 2), (c, d, r < max(c, d) / 2)


def adapter_param_count(shape: tuple[int, int], lora_cfg: LoraConfig) -> int:
    """Trainable parameters of one adapter on a linear of (in_features, out_features)."""
    fan_in, fan_out = shape
    r = lora_cfg.rank
    if lora_cfg.type != "lokr":
        return r * (fan_in + fan_out) + (fan_out if lora_cfg.type == "dora" else 0)  # DoRA: a magnitude per row
    return sum(r * (m + n) if low else m * n for m, n, low in lokr_factors(shape, lora_cfg))


def lora_param_count(model_cfg, lora_cfg: LoraConfig) -> int:
    """Trainable parameters of the adapters `lora_cfg` puts on a model of shape `model_cfg` (a ModelConfig):
    adapter_param_count per adapted linear, the modules chosen as fluxzero.model.lora.target_modules chooses them.
    Pure arithmetic (no torch), for the memory model."""
    c = lora_cfg
    return _lora_param_count(model_cfg, c.patterns, c.rank, c.type, c.factor, c.decompose_both)


@functools.lru_cache(maxsize=64)
def _lora_param_count(model_cfg, patterns: tuple[str, ...], rank: int, kind: str, factor: int, both: bool) -> int:
    # keyed on what the count depends on: gen-config --fit estimates ~80 configurations of one run, each asking ~60
    # times, and matching every pattern against FLUX.1-dev's ~500 linears took 12 of its 13 s
    import fnmatch

    shapes = linear_shapes(model_cfg)
    cfg = LoraConfig(rank=rank, type=kind, factor=factor, decompose_both=both)
    chosen = {n for p in patterns for n in shapes if fnmatch.fnmatchcase(n, p)}
    return sum(adapter_param_count(shapes[n], cfg) for n in chosen)
