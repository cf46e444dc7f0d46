"""FLUX.1 Kontext pairs for `fluxzero cache`: (reference image, target image, instruction).

A folder of pairs holds a metadata.jsonl (or .csv, or the --captions table) whose rows name the target in
`file_name`, its reference in `control_file_name` (diffusers' and ai-toolkit's convention; `control_image` and
`reference` are read too) and the instruction in `text`. Every image the table names as a reference is a
reference, not a target of its own unless its own row names a reference too (a chain of edits); every other image
of the folder is a target and needs a reference. A
reference must have its target's aspect (the same bucket): it is resized and cropped to its target's bucket, so
both latents have one size and their tokens line up as FLUX.1 Kontext's were trained.
"""

from __future__ import annotations

from pathlib import Path

from fluxzero.data.buckets import nearest_bucket
from fluxzero.data.errors import InputFileError
from fluxzero.data.images import FILE_KEYS, TEXT_KEYS, caption_table_path, probe_size, read_table_rows, table_file_name

CONTROL_KEYS = ("control_file_name", "control_image", "reference")


def references_for(root, images: list[str], caption_file=None) -> dict[str, str] | None:
    """target -> reference (both relative to `root`) when the folder's caption table names references, else None
    (a plain text-to-image folder). `images` (list_images) holds both; the caller drops the references from it.

    InputFileError naming the file when a target has no reference or a reference does not exist.
    """
    root = Path(root)
    table = caption_table_path(root, caption_file)
    if table is None:
        return None
    rows = read_table_rows(table)
    pairs = {}
    for row in rows:
        key = next((k for k in CONTROL_KEYS if row.get(k)), None)
        if key is not None:
            pairs[table_file_name(row, table)] = Path(str(row[key])).as_posix()
    if not pairs:
        _refuse_unread_reference_column(rows, table, images)
        return None
    by_name = {Path(im).name: im for im in images}
    out = {}
    for target, ref in pairs.items():
        if ref == target:
            raise InputFileError(
                f"{table} names {target} as its own reference (control_file_name); give it the image "
                f"before the edit instead."
            )
        ref_rel = ref if (root / ref).is_file() else None
        if ref_rel is None:
            raise InputFileError(
                f"reference image {root / ref} (the control_file_name of {target} in {table}) does "
                f"not exist; add it, or fix that row of {table.name}."
            )
        out[target if target in images else by_name.get(target, target)] = ref_rel
    references = set(out.values())
    for im in images:
        if im not in references and im not in out:
            raise InputFileError(
                f"image {root / im} has no reference image: {table} names references "
                f"(control_file_name) for other images, so every target needs one; add a "
                f"control_file_name to its row, or move it out of {root}."
            )
    return out


def _refuse_unread_reference_column(rows: list[dict], table: Path, images: list[str]) -> None:
    """InputFileError when a column other than the file name and caption names images of the folder: a reference
    column under another name (`control`, `control_file`, ...), which would otherwise cache every reference as a
    target of its own."""
    known, listed = {*FILE_KEYS, *TEXT_KEYS}, set(images)
    for row in rows:
        for key, value in row.items():
            if key not in known and isinstance(value, str) and Path(value).as_posix() in listed:
                raise InputFileError(
                    f"{table}: column {key!r} names the image {value!r}, but a FLUX.1 Kontext reference "
                    f"is read from {CONTROL_KEYS[0]} ({', '.join(CONTROL_KEYS[1:])} too); rename the "
                    f"column to {CONTROL_KEYS[0]}, or remove it to cache every image as a target."
                )


def check_reference(root, target: str, reference: str, size: tuple[int, int], buckets, min_side: int = 0) -> None:
    """InputFileError naming the reference when it cannot be read, has another aspect than its target (another
    bucket of `buckets`) or a shorter side below `min_side` (what skips a target as too small); `size` is the
    target's (width, height)."""
    root = Path(root)
    try:
        rw, rh = probe_size(root / reference)
    except Exception as e:  # noqa: BLE001 - any unreadable reference: one sentence, nothing written yet
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputFileError(
            f"reference image {root / reference} cannot be read ({why}); save it as a PNG, JPEG or WebP image."
        ) from None
    w, h = size
    if nearest_bucket(rw, rh, buckets) != nearest_bucket(w, h, buckets):
        raise InputFileError(
            f"reference image {root / reference} is {rw}x{rh} px, another aspect ratio than its "
            f"target {root / target} ({w}x{h} px); crop the reference to its target's aspect ratio."
        )
    if min(rw, rh) < min_side:
        raise InputFileError(
            f"reference image {root / reference} is {rw}x{rh} px, its shorter side below {min_side} px "
            f"(--min-image-side), so it would be upscaled into its target's bucket; give the "
            f"full-size image before the edit, or lower --min-image-side."
        )
