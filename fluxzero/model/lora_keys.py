"""The LoRA vocabulary the adapters (lora.py), the LoRA files (lora_formats.py) and the weights loader share: the
error, the canonical key pattern, which names are linears, and whether a file holds LoRA tensors."""

from __future__ import annotations

import os
import re

from torch import nn

_LORA_KEY = re.compile(r"^(.+)\.(lora_A|lora_B)\.weight$")
# Every adapter tensor under PEFT's saved names (its state dict without the adapter name): a LoRA's A and B, a
# DoRA's magnitude, a LoKr's factors. Group 1 is the module, group 2 the tensor's role.
ADAPTER_TENSORS = (
    "lora_A.weight",
    "lora_B.weight",
    "lora_magnitude_vector",
    "lokr_w1",
    "lokr_w1_a",
    "lokr_w1_b",
    "lokr_w2",
    "lokr_w2_a",
    "lokr_w2_b",
)
_ADAPTER_KEY = re.compile(r"^(.+)\.(" + "|".join(re.escape(t) for t in ADAPTER_TENSORS) + r")$")


class LoraError(ValueError):
    """A LoRA setting or file that does not fit the model."""


def canonical_adapter_name(name: str, adapter: str = "default") -> str | None:
    """A PEFT parameter name (`m.lora_A.default.weight`, `m.lokr_w1.default`,
    `m.lora_magnitude_vector.default.weight`) under its saved name (`m.lora_A.weight`, `m.lokr_w1`,
    `m.lora_magnitude_vector`); None for a name that is no adapter tensor."""
    key = name.replace(f".{adapter}.", ".").removesuffix(f".{adapter}")
    key = key.removesuffix(".weight") if ".lora_magnitude_vector." in key else key
    return key if _ADAPTER_KEY.match(key) else None


def _linear_names(model: nn.Module) -> list[str]:
    """Names of the model's own nn.Linear modules (PEFT's wrappers are skipped; their base layer named as the
    wrapper), in module order."""
    names = []
    for name, mod in model.named_modules():
        if ".lora_" in name or ".lokr_" in name or name.endswith(".base_layer"):
            continue
        base = getattr(mod, "base_layer", None)
        if isinstance(mod, nn.Linear) or isinstance(base, nn.Linear):
            names.append(name)
    return names


def _looks_full(keys) -> list[str]:
    return [k for k in keys if not _LORA_KEY.match(k) and k.endswith((".weight", ".bias", ".scale"))]


def _lora_keys(keys) -> bool:
    return any(".lora_A." in k or ".lora_B." in k or ".lora_down." in k or ".lora_up." in k for k in keys)


def is_lora_file(path: str | os.PathLike) -> bool:
    """True when `path` is a .safetensors file of LoRA tensors (any layout read here); reads only the header."""
    from safetensors import safe_open

    if not os.path.isfile(path) or not str(path).endswith(".safetensors"):
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
    except Exception:  # noqa: BLE001 - not a readable safetensors file: certainly no LoRA
        return False
    # mostly adapter tensors (their .alpha scalars aside): a full model with a stray lora key is not a LoRA file,
    # and the full-weights loader then names that key as unexpected
    lora = sum(_lora_keys([k]) for k in keys)
    return lora > 0 and lora >= (len(keys) - sum(k.endswith(".alpha") for k in keys)) / 2
