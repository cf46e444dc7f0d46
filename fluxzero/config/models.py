"""Model shapes: ModelConfig, the named presets (fluxzero.config.architecture.PRESETS) and reshaped variants
(pure Python).

No torch import here: `fluxzero gen-config`, `fluxzero estimate` and friends must stay instant.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from fluxzero.config import architecture
from fluxzero.config.user_files import excerpt, parse_json

# What a ModelConfig may say: far beyond any FLUX.1-shaped model (FLUX.1-dev: width 3072, 19 + 38 blocks), and
# small enough that the memory model and parameter counts stay exact and a typo (depth=10000000000) is refused
# instead of exhausting memory
MAX_WIDTH = 65536
MAX_BLOCKS = 1024
MAX_THETA = 10**9


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
    # FLUX.1 Kontext: FLUX.1-dev's tensors, fed a reference image's tokens after the target's (image editing)
    kontext: bool = False

    def __post_init__(self):
        import math

        for f in ("in_channels", "out_channels", "vec_in_dim", "context_in_dim", "hidden_size", "num_heads"):
            if not 1 <= getattr(self, f) <= MAX_WIDTH:
                raise ValueError(
                    f"model {excerpt(self.name)}: {f} must be from 1 to {MAX_WIDTH}, got {excerpt(getattr(self, f))}"
                )
        for f in ("depth", "depth_single_blocks"):
            if not 0 <= getattr(self, f) <= MAX_BLOCKS:
                raise ValueError(
                    f"model {excerpt(self.name)}: {f} must be from 0 to {MAX_BLOCKS}, got {excerpt(getattr(self, f))}"
                )
        if not (math.isfinite(self.mlp_ratio) and 1 <= self.mlp_hidden_dim <= MAX_WIDTH * 16):
            raise ValueError(
                f"model {excerpt(self.name)}: mlp_ratio {self.mlp_ratio} gives an MLP width of "
                f"hidden_size x mlp_ratio = {self.mlp_hidden_dim if math.isfinite(self.mlp_ratio) else 'inf'}"
                f"; choose mlp_ratio so that the width is from 1 to {MAX_WIDTH * 16} (FLUX.1: 4.0)"
            )
        if not 1 <= self.theta <= MAX_THETA:
            raise ValueError(
                f"model {excerpt(self.name)}: theta (RoPE base) must be from 1 to {MAX_THETA}, got "
                f"{excerpt(self.theta)} (FLUX.1: 10000)"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model {excerpt(self.name)}: hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}"
            )
        if sum(self.axes_dim) != self.head_dim:
            raise ValueError(
                f"model {excerpt(self.name)}: axes_dim {self.axes_dim} must sum to the head dim {self.head_dim}"
            )
        if any(d % 2 or d <= 0 for d in self.axes_dim):
            raise ValueError(
                f"model {excerpt(self.name)}: every entry of axes_dim {self.axes_dim} must be positive "
                f"and even (RoPE pairs)"
            )

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
        """Parameter count of the transformer (flux-dev: 11,901,408,320), from the architecture table."""
        return architecture.num_params(self)

    def flops_per_sample(self, img_tokens: int, txt_tokens: int) -> float:
        """Forward FLOPs of one sample (multiply-add = 2 FLOPs); training step is about 3x this.
        fluxzero.config.architecture.flops_per_sample says what is counted."""
        return architecture.flops_per_sample(self, img_tokens, txt_tokens)

    def train_flops_per_sample(self, img_tokens: int, txt_tokens: int, frozen_linears: bool = False) -> float:
        """FLOPs of one sample's training step (forward and backward; 2x instead of 3x for a LoRA's frozen
        linears): fluxzero.config.architecture.train_flops_per_sample."""
        return architecture.train_flops_per_sample(self, img_tokens, txt_tokens, frozen_linears)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Every field, JSON/YAML-ready (axes_dim as a list); `from_dict` reads it back equal."""
        return {**dataclasses.asdict(self), "axes_dim": list(self.axes_dim)}

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """A ModelConfig from `to_dict()`'s mapping (missing fields take flux-dev's values); ValueError naming
        a bad field."""
        if not isinstance(d, dict):
            raise ValueError(f"model must be a mapping of ModelConfig fields, got {excerpt(d)}")
        return _from_mapping({"name": "custom", **d}, "model")

    def same_shape(self, other: ModelConfig) -> bool:
        """Equal in every field but the name: the same tensors and the same forward."""
        return dataclasses.replace(self, name="") == dataclasses.replace(other, name="")


def _presets() -> dict[str, ModelConfig]:
    """MODEL_PRESETS from fluxzero.config.architecture.PRESETS (a preset starts from one listed before it)."""
    out: dict[str, ModelConfig] = {}
    for name, (base, changes) in architecture.PRESETS.items():
        out[name] = (out[base] if base else ModelConfig(name=name)).replace(name=name, **changes)
    return out


MODEL_PRESETS: dict[str, ModelConfig] = _presets()


def get_model_config(name) -> ModelConfig:
    """A preset by name; any other model spec is resolved as `resolve_model` does (so every --model accepts
    them)."""
    return resolve_model(name)


def reshaped(
    base: ModelConfig,
    *,
    depth: int | None = None,
    depth_single_blocks: int | None = None,
    hidden_size: int | None = None,
    num_heads: int | None = None,
) -> ModelConfig:
    """`base` with another block count or width (what-if sizing); RoPE axes follow the new head dim.

    Raises ValueError with one sentence when the shape cannot exist.
    """
    changes = {
        k: v
        for k, v in dict(
            depth=depth, depth_single_blocks=depth_single_blocks, hidden_size=hidden_size, num_heads=num_heads
        ).items()
        if v is not None
    }
    if not changes:
        return base
    hidden, heads = changes.get("hidden_size", base.hidden_size), changes.get("num_heads", base.num_heads)
    if hidden % heads or (hidden // heads) % 2:
        raise ValueError(f"hidden size {hidden} / {heads} heads must give an even whole head dim")
    head_dim = hidden // heads
    if head_dim != base.head_dim:
        changes["axes_dim"] = _axes_for(head_dim, base)
    desc = ", ".join(f"{k}={v}" for k, v in changes.items() if k != "axes_dim")
    return dataclasses.replace(base, name=f"{base.name} ({desc})", **changes)


# ------------------------------------------------------------------------------------------------------
# Model specs: a preset name, a mapping of field overrides, "PRESET:field=value,...", or a diffusers config.json
# ------------------------------------------------------------------------------------------------------
_INT_FIELDS = (
    "in_channels",
    "out_channels",
    "vec_in_dim",
    "context_in_dim",
    "hidden_size",
    "num_heads",
    "depth",
    "depth_single_blocks",
    "theta",
    "head_dim",
)
_BOOL_FIELDS = ("qkv_bias", "guidance_embed", "kontext")
# What a mapping may set: every ModelConfig field, `head_dim` (hidden_size = head_dim x num_heads) and `preset`.
SPEC_KEYS = ("preset", *(f.name for f in dataclasses.fields(ModelConfig)), "head_dim")
_SPEC_FORMS = (
    "a preset name, a mapping {preset: NAME, field: value, ...}, 'PRESET:field=value,...' or the path "
    "of a diffusers config.json (or the folder holding it)"
)
# diffusers' FluxTransformer2DModel argument -> our field, with diffusers' own default when config.json omits it
# (what from_pretrained would build). hidden_size is attention_head_dim x num_attention_heads.
_DIFFUSERS = {
    "in_channels": ("in_channels", 64),
    "out_channels": ("out_channels", None),
    "num_layers": ("depth", 19),
    "num_single_layers": ("depth_single_blocks", 38),
    "attention_head_dim": ("head_dim", 128),
    "num_attention_heads": ("num_heads", 24),
    "joint_attention_dim": ("context_in_dim", 4096),
    "pooled_projection_dim": ("vec_in_dim", 768),
    "guidance_embeds": ("guidance_embed", False),
    "axes_dims_rope": ("axes_dim", [16, 56, 56]),
}


def _did_you_mean(key: str, names) -> str:
    import difflib

    m = difflib.get_close_matches(str(key), list(names), n=1, cutoff=0.6)
    return f" (did you mean {excerpt(m[0])}?)" if m else ""


def _checked(where: str, key: str, value, label: str | None = None):
    """`value` for field `key` with its type checked (ints for widths, true/false for flags, 3 even axes)."""
    label = label or key
    if key in _INT_FIELDS:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{where}: {label} must be a whole number, got {excerpt(value)}")
    elif key == "mlp_ratio":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or value == float("inf"):
            raise ValueError(f"{where}: {label} must be a positive number, got {excerpt(value)}")
        value = float(value)
    elif key in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {label} must be true or false, got {excerpt(value)}")
    elif key == "axes_dim":
        ok = (
            isinstance(value, (list, tuple))
            and len(value) == 3
            and all(isinstance(a, int) and not isinstance(a, bool) and a > 0 for a in value)
        )
        if not ok:  # RoPE rotates three position axes (frame, row, column): the ids have three columns
            raise ValueError(
                f"{where}: {label} must be three positive even whole numbers summing to the head dim, "
                f"such as [16, 56, 56], got {excerpt(value)}"
            )
        value = tuple(value)
    elif key in ("name", "preset") and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"{where}: {label} must be text, got {excerpt(value)}")
    return value


def _axes_for(head_dim: int, base: ModelConfig) -> tuple[int, int, int]:
    """RoPE axes for another head dim: FLUX splits 128 as (16, 56, 56); keep the proportions, even entries."""
    side = 2 * max(1, round(head_dim * base.axes_dim[1] / base.head_dim / 2))
    if head_dim - 2 * side < 2:
        raise ValueError(f"head dim {head_dim} is too small for 3-axis RoPE")
    return (head_dim - 2 * side, side, side)


def _matching_preset(cfg: ModelConfig) -> ModelConfig | None:
    return next((p for p in MODEL_PRESETS.values() if p.same_shape(cfg)), None)


def _from_mapping(spec: dict, where: str) -> ModelConfig:
    unknown = [k for k in spec if k not in SPEC_KEYS]
    if unknown:
        raise ValueError(
            f"{where}: unknown field {excerpt(unknown[0])}{_did_you_mean(unknown[0], SPEC_KEYS)}; "
            f"valid fields: {', '.join(SPEC_KEYS)}"
        )
    values = {k: _checked(where, k, v) for k, v in spec.items()}
    preset = values.pop("preset", None)
    if preset is None:
        base = ModelConfig(name="custom")  # the field defaults are flux-dev's
    elif preset in MODEL_PRESETS:
        base = MODEL_PRESETS[preset]
    else:
        raise ValueError(
            f"{where}: unknown preset {excerpt(preset)}{_did_you_mean(preset, MODEL_PRESETS)}; choose one "
            f"of: {', '.join(MODEL_PRESETS)}"
        )
    name = values.pop("name", None)
    heads = values.get("num_heads", base.num_heads)
    head_dim = values.pop("head_dim", None)
    if head_dim is not None:
        if "hidden_size" in values and values["hidden_size"] != head_dim * heads:
            raise ValueError(
                f"{where}: hidden_size {values['hidden_size']} is not head_dim {head_dim} x num_heads "
                f"{heads}; give one of hidden_size and head_dim"
            )
        values["hidden_size"] = head_dim * heads
    if "in_channels" in values:  # the model predicts a velocity in its input's space
        values.setdefault("out_channels", values["in_channels"])
    hidden = values.get("hidden_size", base.hidden_size)
    if heads <= 0 or hidden <= 0 or hidden % heads:
        raise ValueError(f"{where}: hidden_size {hidden} must be a positive multiple of num_heads {heads}")
    if "axes_dim" not in values and hidden // heads != base.head_dim:
        try:
            values["axes_dim"] = _axes_for(hidden // heads, base)
        except ValueError as e:
            raise ValueError(f"{where}: {e}; set axes_dim") from None
    try:
        cfg = dataclasses.replace(base, name=name or base.name, **values)
    except ValueError as e:  # ModelConfig's own checks: one sentence naming the field
        raise ValueError(f"{where}: {str(e).partition(': ')[2] or e}") from None
    if name is None:
        desc = ", ".join(f"{k}={v}" for k, v in spec.items() if k not in ("preset", "name"))
        cfg = _matching_preset(cfg) or (cfg.replace(name=f"{base.name} ({desc})") if desc else cfg)
    return cfg


def _parse_scalar(text: str):
    text = text.strip()
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _parse_inline(spec: str) -> dict:
    """'flux-dev:depth=5,axes_dim=4,6,6' -> {preset: flux-dev, depth: 5, axes_dim: [4, 6, 6]}."""
    preset, _, body = spec.partition(":")
    out: dict = {"preset": preset.strip()}
    key = None
    for item in body.split(","):
        k, sep, v = item.partition("=")
        if sep:
            key = k.strip()
            out[key] = _parse_scalar(v)
        elif key is not None and item.strip():  # axes_dim=4,6,6: bare numbers continue the last value
            prev = out[key]
            out[key] = [*(prev if isinstance(prev, list) else [prev]), _parse_scalar(item)]
        elif item.strip():
            raise ValueError(
                f"model {excerpt(spec)}: {excerpt(item.strip())} must look like field=value, as in "
                f"'flux-dev:depth=5,depth_single_blocks=10'"
            )
    return out


def _diffusers_json(path: str) -> str:
    import os.path as op

    if op.isdir(path):
        for candidate in (op.join(path, "transformer", "config.json"), op.join(path, "config.json")):
            if op.isfile(candidate):
                return candidate
        raise ValueError(
            f"model {path}: the folder holds no config.json (nor transformer/config.json); pass a "
            f"diffusers FluxTransformer2DModel folder or its config.json"
        )
    return path


def from_diffusers_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a diffusers FluxTransformer2DModel config.json (or the folder holding it)."""
    file = _diffusers_json(os.fspath(path))
    try:
        with open(file, encoding="utf-8") as f:
            d = parse_json(f.read())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(
            f"model {file}: not a readable JSON file ({str(e).splitlines()[0][:200]}); pass a diffusers config.json"
        ) from None
    if not isinstance(d, dict):
        raise ValueError(f"model {file}: a diffusers config.json holds a JSON object; pass one")
    if d.get("_class_name", "FluxTransformer2DModel") != "FluxTransformer2DModel":
        raise ValueError(
            f"model {file}: describes a {d['_class_name']}, not a FluxTransformer2DModel; pass the "
            f"transformer's config.json (a pipeline's transformer/ folder)"
        )
    if d.get("patch_size", 1) != 1:
        raise ValueError(
            f"model {file}: patch_size {excerpt(d['patch_size'])} is not FLUX.1's 1; only patch_size 1 models load"
        )
    values = {}
    for key, (ours, default) in _DIFFUSERS.items():
        value = d.get(key, default)
        if value is not None:
            values[ours] = _checked(f"model {file}", ours, value, label=key)
    values["hidden_size"] = values["head_dim"] * values["num_heads"]
    base = os.path.dirname(os.path.abspath(file))
    name = (
        os.path.basename(os.path.dirname(base)) if os.path.basename(base) == "transformer" else os.path.basename(base)
    )
    values.setdefault("out_channels", values["in_channels"])
    if os.path.basename(base) == "transformer" and is_kontext_pipeline(os.path.dirname(base)):
        values["kontext"] = True
    try:
        cfg = ModelConfig(name=name or "custom", **{k: v for k, v in values.items() if k != "head_dim"})
    except ValueError as e:
        raise ValueError(f"model {file}: {str(e).partition(': ')[2] or e}") from None
    return _matching_preset(cfg) or cfg


# A diffusers FluxKontextPipeline folder's model_index.json, as FLUX.1 Kontext [dev] ships it: the pipeline's
# class (what diffusers, and fluxzero, tell Kontext by: its transformer's config.json is FLUX.1-dev's) and where each
# component's folder is. A diffusers export of a Kontext model writes it above its transformer/ folder.
KONTEXT_MODEL_INDEX = {
    "_class_name": "FluxKontextPipeline",
    "feature_extractor": [None, None],
    "image_encoder": [None, None],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def is_kontext_pipeline(folder: str | os.PathLike) -> bool:
    """Whether a diffusers pipeline folder is FLUX.1 Kontext's: its model_index.json names FluxKontextPipeline
    (the transformer's own config.json is FLUX.1-dev's)."""
    import json

    try:
        with open(os.path.join(folder, "model_index.json"), encoding="utf-8") as f:
            return json.load(f).get("_class_name") == KONTEXT_MODEL_INDEX["_class_name"]
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def resolve_model(spec) -> ModelConfig:
    """The ModelConfig a model spec names; ValueError with one sentence naming the bad field or value.

    `spec` is a ModelConfig, a preset name ("flux-dev"), a mapping {preset: NAME, <field>: value, ...}
    (fields of ModelConfig plus head_dim; no preset starts from flux-dev's values), the same inline as
    "flux-dev:depth=5,depth_single_blocks=10", or the path of a diffusers config.json or its folder. A shape
    equal to a preset's is that preset (named so), unless the mapping gives a name.
    """
    if isinstance(spec, ModelConfig):
        return spec
    if isinstance(spec, os.PathLike):
        return from_diffusers_config(spec)
    if isinstance(spec, dict):
        return _from_mapping(spec, "model")
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"model must be {_SPEC_FORMS}, got {excerpt(spec)}")
    if spec in MODEL_PRESETS:
        return MODEL_PRESETS[spec]
    if os.path.exists(spec):
        return from_diffusers_config(spec)
    if ":" in spec and spec.partition(":")[0].strip() in MODEL_PRESETS:
        return _from_mapping(_parse_inline(spec), f"model {excerpt(spec)}")
    if "/" in spec or spec.endswith(".json"):
        raise ValueError(
            f"model {spec}: no such file or folder; pass a diffusers config.json (or its folder) "
            f"that exists, or a preset name"
        )
    raise ValueError(
        f"unknown model preset {excerpt(spec)}{_did_you_mean(spec, MODEL_PRESETS)}; choose one of: "
        f"{', '.join(MODEL_PRESETS)} (or give {_SPEC_FORMS.partition(', ')[2]})"
    )


def model_spec(cfg: ModelConfig) -> str | dict:
    """The spec a run file records for `cfg`: its preset name, else its whole shape (`to_dict()`)."""
    preset = MODEL_PRESETS.get(cfg.name)
    return cfg.name if preset == cfg else cfg.to_dict()


def same_model(a, b) -> bool:
    """Whether two model specs describe one shape (names aside); a spec that does not resolve matches nothing."""
    try:
        return resolve_model(a).same_shape(resolve_model(b))
    except ValueError:
        return False


def model_name(spec) -> str:
    """A model spec's name for messages."""
    try:
        return resolve_model(spec).name
    except ValueError:
        return repr(spec)
