"""Sampled images on disk: PNGs that carry their sampling parameters as PNG text chunks, and a grid."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from fluxzero.config.user_files import parse_json

# Text chunks written to every PNG (values as text; the whole set also as JSON under "parameters").
PNG_KEYS = ("prompt", "negative_prompt", "seed", "steps", "guidance", "true_cfg", "width", "height", "model", "weights")
SOFTWARE = "fluxzero"


def _pil(image):
    from PIL import Image

    if isinstance(image, torch.Tensor):
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(f"expected a (H, W, 3) uint8 image, got {tuple(image.shape)} {image.dtype}")
        return Image.fromarray(image.numpy())
    return image


def save_png(image, path: str | os.PathLike, params: dict) -> Path:
    """Write an (H, W, 3) uint8 tensor (or a PIL image) as PNG with `params` as text chunks.

    Keys in PNG_KEYS are written one chunk each (str() of the value; None is left out), and all of
    `params` once more as JSON under "parameters", so tools that read either form find them.
    Non-Latin-1 text (a prompt in any script) goes into iTXt chunks, which hold UTF-8.
    """
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key in PNG_KEYS:
        if params.get(key) is not None:
            info.add_itxt(key, str(params[key]))
    info.add_itxt("parameters", json.dumps(params, ensure_ascii=False, sort_keys=True))
    info.add_text("Software", SOFTWARE)
    path = Path(path)
    _pil(image).save(path, format="PNG", pnginfo=info)
    return path


def read_png_params(path: str | os.PathLike) -> dict:
    """The "parameters" JSON that `save_png` wrote ({} for a PNG without it)."""
    from PIL import Image

    with Image.open(path) as im:
        text = getattr(im, "text", {}) or {}
        return parse_json(text["parameters"]) if "parameters" in text else {}


def grid(images, cols: int | None = None, pad: int = 0):
    """Tile same-size images row-major into one PIL image; `cols` defaults to ceil(sqrt(n)).

    Shape: n images (H, W, 3) -> (rows * (H + pad) - pad, cols * (W + pad) - pad, 3)
    """
    from PIL import Image

    pics = [_pil(im) for im in images]
    if not pics:
        raise ValueError("grid needs at least one image")
    w, h = pics[0].size
    if any(p.size != (w, h) for p in pics):
        raise ValueError("grid images must all have the same size")
    cols = cols or math.ceil(math.sqrt(len(pics)))
    rows = math.ceil(len(pics) / cols)
    out = Image.new("RGB", (cols * (w + pad) - pad, rows * (h + pad) - pad), "white")
    for i, p in enumerate(pics):
        out.paste(p, ((i % cols) * (w + pad), (i // cols) * (h + pad)))
    return out
