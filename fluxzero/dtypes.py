"""Floating-point dtype names, written once: the short names of run files and the CLI (fp32, bf16, fp16), torch's
attribute names (float32, bfloat16, float16) and safetensors' header codes (F32, BF16, F16).

Pure standard library: the config modules read the names without torch; `torch_dtype` imports torch when called.
"""

from __future__ import annotations

TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SAFETENSORS_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes per value, by short name


def torch_name(name: str) -> str:
    """torch's attribute name of a short name or of a torch name ("bf16" or "bfloat16" -> "bfloat16")."""
    if name in SAFETENSORS_CODES:
        return name
    try:
        return TORCH_NAMES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(TORCH_NAMES)}") from None


def torch_dtype(name: str):
    """The torch.dtype of a short or torch name ("bf16" -> torch.bfloat16)."""
    import torch

    return getattr(torch, torch_name(name))


def safetensors_code(name: str) -> str:
    """safetensors' header code of a short or torch name ("bf16" -> "BF16")."""
    return SAFETENSORS_CODES[torch_name(name)]
