"""Image folder input for `fluxzero cache`: file listing, captions, size probing, bucket resize + crop."""

from __future__ import annotations

import csv
import os
import threading
from pathlib import Path

from fluxzero.config.user_files import check_regular, parse_json
from fluxzero.data.buckets import cover_and_crop
from fluxzero.data.errors import DataError, InputFileError

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp")
# an image's loss mask: NAME.mask.png beside NAME.jpg (or .png, .webp), white where the loss applies
MASK_SUFFIX = ".mask.png"
MASK_PATCH = 16  # pixels per side of one image token: the VAE's 8x, then FLUX's 2x2 latent packing
METADATA_FILES = ("metadata.jsonl", "metadata.csv")
FILE_KEYS = ("file_name", "file", "image", "path")
TEXT_KEYS = ("text", "caption", "prompt")
# The images are the user's own, so PIL's decompression-bomb limit (89 MP warns, 179 MP fails: a 15000x12000
# photo) is raised to this; memory stays bounded because larger images are refused by probe_size and images
# above _BIG_PIXELS decode one at a time (a 268 MP RGB decode is ~0.8 GB)
MAX_PIXELS = 2**28
_BIG_PIXELS = 2**26
_BIG_DECODE = threading.Lock()


def _open(path):
    from PIL import Image

    if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < MAX_PIXELS:
        Image.MAX_IMAGE_PIXELS = MAX_PIXELS  # PIL warns above this and fails above twice this
    return Image.open(path)


def list_images(root) -> list[str]:
    """Image paths relative to `root` (recursive, sorted, '/' separators); masks (NAME.mask.png, and NAME.mask.jpg
    and the like, which mask_for refuses) are not images."""
    root = Path(root)
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.suffix.lower() in IMAGE_EXTS and not _is_mask(p) and p.is_file()
    )


def _is_mask(p: Path) -> bool:
    return p.suffix.lower() in IMAGE_EXTS and Path(p.stem).suffix.lower() == ".mask"


def orphan_masks(root, images: list[str]) -> list[str]:
    """Mask files under `root` (NAME.mask.png and the like, relative, sorted) that belong to none of `images`: they
    are never read, which a user who misnamed the mask or its image should be told."""
    root = Path(root)
    stems = {Path(im).with_suffix("").as_posix() for im in images}
    return sorted(
        rel
        for rel in (p.relative_to(root).as_posix() for p in root.rglob("*") if _is_mask(p) and p.is_file())
        if Path(rel).with_suffix("").with_suffix("").as_posix() not in stems
    )


def mask_for(root, image: str) -> str | None:
    """The mask file of `image` (relative to `root`), NAME.mask.png beside it, or None when it has none.
    InputFileError for a mask saved in another format (NAME.mask.jpg, ...)."""
    rel = Path(image).with_suffix(MASK_SUFFIX).as_posix()
    if (Path(root) / rel).is_file():
        return rel
    for ext in IMAGE_EXTS:
        other = Path(root) / Path(image).with_suffix(".mask" + ext)
        if other.is_file() or other.with_suffix(ext.upper()).is_file():
            raise InputFileError(
                f"mask {other} is not a PNG; save it as {Path(root) / rel} (lossy formats blur a "
                f"mask's edges), or delete it to train on the whole image."
            )
    return None


def has_alpha(path) -> bool:
    """Whether an image has transparency (an alpha channel or a tRNS colour key), reading only its header."""
    with _open(path) as im:
        return im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info


def _alpha(im):
    """The alpha channel of an image as 8-bit L (255 opaque); a 16-bit gray PNG's tRNS key marks its transparent value."""
    import numpy as np
    from PIL import Image

    if im.mode == "I" or im.mode.startswith("I;16"):
        key = im.info.get("transparency")
        opaque = np.ones(im.size[::-1], bool) if key is None else np.asarray(im) != key
        return Image.fromarray(opaque.astype(np.uint8) * 255)
    return im.convert("RGBA").getchannel("A")


def load_mask(path, bucket: tuple[int, int], flip: bool, from_alpha: bool = False):
    """A mask image cropped and flipped as its image is (load_bucketed), averaged over each image token's pixels.

    Gray levels are weights (white 1, black 0; an RGB mask has equal channels, which `fluxzero cache`
    checks before it writes, so its gray is any of them; alpha ignored); with from_alpha,
    `path` is the image itself and its alpha channel is the mask (opaque 1). Shape: returns (H/16, W/16)
    float32 in [0, 1] with (H, W) = bucket, row-major as fluxzero.model.packing.pack's tokens.
    """
    import numpy as np
    import torch
    from PIL import Image, ImageOps

    with _open(path) as im:
        im = ImageOps.exif_transpose(im)
        if from_alpha:
            im = _alpha(im)
        else:
            im = _to_8bit(im) if im.mode == "I" or im.mode.startswith("I;16") else im.convert("L")
        size, box = cover_and_crop(im.width, im.height, bucket)
        im = im.resize(size, Image.Resampling.BILINEAR).crop(box)  # no ringing outside [0, 1], unlike Lanczos
        if flip:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        arr = np.asarray(im, dtype=np.float32) / 255.0
    h, w = bucket
    grid = arr.reshape(h // MASK_PATCH, MASK_PATCH, w // MASK_PATCH, MASK_PATCH).mean(axis=(1, 3))
    return torch.from_numpy(np.ascontiguousarray(grid, dtype=np.float32))


def _pick(row: dict, keys, what: str, source) -> str:
    for k in keys:
        if k in row:
            return row[k]
    raise DataError(f"{source}: a row has no {what} column; use one of {', '.join(keys)}.")


def read_caption_table(path) -> dict[str, str]:
    """file name -> caption from a metadata .jsonl or .csv (columns file_name|file|image|path and text|caption|prompt)."""
    path = Path(path)
    out = {}
    for row in read_table_rows(path):
        out[table_file_name(row, path)] = str(_pick(row, TEXT_KEYS, "caption", path) or "").strip()
    return out


def table_file_name(row: dict, path) -> str:
    """The image a row of a metadata table names, '/'-separated."""
    return Path(str(_pick(row, FILE_KEYS, "file name", path))).as_posix()


def read_table_rows(path) -> list[dict]:
    """The rows of a metadata .jsonl or .csv, each a dict; DataError naming the file when it cannot be read."""
    path = Path(path)
    check_regular(path, "caption file", "pass a metadata .jsonl or .csv file.", DataError)
    rows = []
    try:
        if path.suffix == ".jsonl":
            for n, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(parse_json(line))
                    except ValueError:
                        raise DataError(f"{path} line {n} is not valid JSON.") from None
        elif path.suffix == ".csv":
            with open(path, newline="", encoding="utf-8-sig") as f:  # tolerate a BOM (Excel)
                rows = list(csv.DictReader(f))
        else:
            raise DataError(f"caption file {path} must be a .jsonl or .csv file.")
    except UnicodeDecodeError as e:
        raise DataError(
            f"caption file {path} is not UTF-8 text (byte {e.start} cannot be decoded); save it as UTF-8."
        ) from None
    except csv.Error as e:
        raise DataError(
            f"caption file {path} is not a readable CSV file ({e}); save it as comma-separated UTF-8 text."
        ) from None
    except OSError as e:
        raise DataError(f"cannot read caption file {path} ({e.strerror or e}); make it readable.") from None
    if any(not isinstance(row, dict) for row in rows):
        raise DataError(f'{path}: every line must be a JSON object such as {{"file_name": "a.png", "text": "..."}}.')
    return rows


def captions_for(root, images: list[str], caption_file=None) -> tuple[dict[str, str | None], str, list[str]]:
    """Caption of every image (None = no caption found), a word naming the source used, and the caption
    table's file names that match no image (always empty for .txt captions).

    Order of preference: `caption_file`, then metadata.jsonl / metadata.csv in `root`, then same-name .txt.
    A table row matches an image by its path relative to `root` or by its bare file name.
    """
    root = Path(root)
    table_path = caption_table_path(root, caption_file)
    if table_path is not None:
        table = read_caption_table(table_path)
        known = set(images) | {Path(im).name for im in images}
        unmatched = [name for name in table if name not in known]
        return {im: table.get(im, table.get(Path(im).name)) for im in images}, table_path.name, unmatched
    out = {}
    for im in images:
        txt = (root / im).with_suffix(".txt")
        if not os.path.lexists(txt):
            out[im] = None
            continue
        check_regular(txt, "caption file", f"make it the caption of {im} as UTF-8 text, or remove it.", DataError)
        try:  # utf-8-sig: a BOM (Notepad) is dropped, not kept as U+FEFF; other encodings are refused, not mangled
            out[im] = txt.read_text(encoding="utf-8-sig").strip()
        except UnicodeDecodeError as e:
            raise DataError(
                f"caption file {txt} is not UTF-8 text (byte {e.start} cannot be decoded); save it as UTF-8."
            ) from None
        except OSError as e:
            raise DataError(
                f"cannot read caption file {txt} ({e.strerror or e}); make it readable or remove it."
            ) from None
    return out, "txt", []


def caption_table_path(root, caption_file=None) -> Path | None:
    """The caption table in use: `caption_file`, else metadata.jsonl / metadata.csv in `root`, else None (.txt)."""
    root = Path(root)
    return Path(caption_file) if caption_file else next((root / m for m in METADATA_FILES if (root / m).exists()), None)


def probe_size(path) -> tuple[int, int]:
    """(width, height) as displayed (EXIF rotation applied), reading only the header. Raises on bad files."""
    with _open(path) as im:
        w, h = im.size
        if im.format not in ("PNG", "JPEG", "WEBP", "MPO"):
            raise ValueError(f"unsupported image format {im.format}")
        if w * h > MAX_PIXELS:
            raise ValueError(
                f"{w}x{h} px is more than the {MAX_PIXELS // 2**20} MP fluxzero cache decodes; downscale it first"
            )
        orientation = im.getexif().get(0x0112, 1)
    return (h, w) if orientation in (5, 6, 7, 8) else (w, h)


def load_bucketed(path, bucket: tuple[int, int], flip: bool):
    """Decode, EXIF-rotate, RGB (alpha over white), resize to cover `bucket`, center crop, optional flip.

    Shape: returns (3, H, W) float32 in [-1, 1] with (H, W) = bucket.
    """
    import numpy as np
    import torch
    from PIL import Image, ImageOps

    with _open(path) as im:
        if im.format == "JPEG":  # decode at 1/2, 1/4 or 1/8 scale when the bucket is that much smaller
            rotated = im.getexif().get(0x0112, 1) in (5, 6, 7, 8)
            bh, bw = bucket
            im.draft("RGB", (bh, bw) if rotated else (bw, bh))
        if im.width * im.height > _BIG_PIXELS:
            with _BIG_DECODE:  # one huge decode at a time, shrunk before the lock is let go
                im.load()
                # box-average by an integer factor that leaves both sides >= 2x the bucket's longer side, so
                # the LANCZOS resize below still sets the quality (either orientation: EXIF turns come after)
                factor = min(im.width, im.height) // (2 * max(bucket))
                if factor > 1 and im.mode in ("L", "LA", "RGB", "RGBA") and "transparency" not in im.info:
                    im = im.reduce(factor)
        else:
            im.load()
        im = ImageOps.exif_transpose(im)
        sixteen = im.mode == "I" or im.mode.startswith("I;16")
        if sixteen:
            key = im.info.get("transparency")  # tRNS of a 16-bit gray PNG: one transparent 16-bit value
            opaque = None if key is None else np.asarray(im) != key
            im = _to_8bit(im)  # convert("RGB") would clip 16-bit values at 255: a white image
            if opaque is not None:
                im = im.convert("RGBA")
                im.putalpha(Image.fromarray(opaque.astype(np.uint8) * 255))
        if im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info:  # alpha or a tRNS colour key (P, L, RGB)
            im = im.convert("RGBA")
            bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
            im = Image.alpha_composite(bg, im)
        im = im.convert("RGB")
        size, box = cover_and_crop(im.width, im.height, bucket)
        im = im.resize(size, Image.Resampling.LANCZOS).crop(box)
        if flip:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        arr = np.asarray(im, dtype=np.float32)
    return torch.from_numpy(arr).permute(2, 0, 1).div(127.5).sub(1.0).contiguous()


def _to_8bit(im):
    """16-bit grayscale (PNG opens as I;16 or I, 0..65535) -> 8-bit L, scaled by 255/65535 (not clipped)."""
    import numpy as np
    from PIL import Image

    arr = np.asarray(im, dtype=np.float64)
    return Image.fromarray(np.clip(np.rint(arr / 257.0), 0, 255).astype(np.uint8))
