"""Aspect-ratio buckets for caching (pure Python: no torch, no PIL).

A bucket is a pixel size (height, width) with both sides multiples of a step (64 px by default, at least 16: the
VAE divides by 8 and FLUX packs 2x2 latent patches) and at most `resolution**2` pixels. An image goes to the bucket whose aspect
ratio is nearest in log space (so 2:1 and 1:2 are equally far from 1:1); ties go to the larger area.
It is then resized to cover the bucket and center-cropped, so at most a strip is cut.
"""

from __future__ import annotations

import math

STEP = 16  # pixels: VAE factor 8 x FLUX 2x2 patch; the finest step a bucket side can take
# pixels: `fluxzero cache`'s default step (kohya's too). Every bucket's image token count is then a multiple of 16,
# so compiled blocks compile once for all buckets; at 16 px counts such as 999 (27 x 37 patches) fail Inductor's
# alignment guard on attention and recompile (200 bucketed steps: 0 recompiles against 3; benchmarks/RESULTS.md)
DEFAULT_STEP = 64


def default_step(resolution: int) -> int:
    """`fluxzero cache`'s bucket step at `resolution` px: DEFAULT_STEP where it divides the resolution (the square
    bucket must be resolution x resolution) and the resolution is at least 4 steps (below, a 64 px step leaves one
    bucket or a few), else STEP."""
    return DEFAULT_STEP if resolution % DEFAULT_STEP == 0 and resolution >= 4 * DEFAULT_STEP else STEP


def make_buckets(
    resolution: int = 1024, min_side: int | None = None, max_aspect: float = 4.0, step: int | None = None
) -> list[tuple[int, int]]:
    """All (height, width) buckets with sides in [min_side, ...] multiples of `step` (default: default_step),
    area <= resolution**2, aspect ratio <= max_aspect; for each width the tallest height that fits. Sorted by
    aspect ratio (h/w).

    `min_side` defaults to resolution // 4 (rounded down to `step`, at least `step`).
    """
    step = step or default_step(resolution)
    if resolution < step or resolution % step:
        raise ValueError(f"resolution must be a positive multiple of {step}, got {resolution}")
    if min_side is None:
        min_side = max(step, resolution // 4 // step * step)
    if min_side < step or min_side % step or min_side > resolution:
        raise ValueError(
            f"min_side must be a multiple of {step} between {step} and the resolution {resolution}, got {min_side}"
        )
    if max_aspect < 1:
        raise ValueError(f"max_aspect must be >= 1, got {max_aspect}")
    area = resolution * resolution
    out = set()
    for w in range(min_side, area // min_side + 1, step):
        h = min(area // w // step * step, area // min_side // step * step)
        if h < min_side or max(w / h, h / w) > max_aspect + 1e-9:
            continue
        out.add((h, w))
        out.add((w, h))
    return sorted(out, key=lambda hw: (hw[0] / hw[1], -hw[0] * hw[1]))


def nearest_bucket(width: int, height: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """(height, width) of the bucket nearest to the image's aspect ratio (log distance; ties -> larger area)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    ar = math.log(height / width)
    return min(buckets, key=lambda hw: (round(abs(math.log(hw[0] / hw[1]) - ar), 12), -hw[0] * hw[1]))


def cover_and_crop(
    width: int, height: int, bucket: tuple[int, int]
) -> tuple[tuple[int, int], tuple[int, int, int, int]]:
    """Resize size (w, h) that covers `bucket` (h, w) keeping the aspect ratio, and the centered crop box
    (left, top, right, bottom) in the resized image."""
    bh, bw = bucket
    scale = max(bw / width, bh / height)
    rw, rh = max(bw, round(width * scale)), max(bh, round(height * scale))
    left, top = (rw - bw) // 2, (rh - bh) // 2
    return (rw, rh), (left, top, left + bw, top + bh)
