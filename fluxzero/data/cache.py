"""The `fluxzero cache` pipeline: image folder -> planned shards -> encoded shards -> manifest + report.

Every process computes the same plan (sorted image list, bucket per image, flip and caption-dropout draws
seeded by file name), so work splits without communication: process `rank` of `world_size` encodes the
planned shards whose id % world_size == rank. Each finished shard gets a small "part" file under
`parts/` written after the shard itself; a rerun skips shards whose part exists and whose shard passes the
size/header check. Whichever process finds every part present writes the manifest (deterministic content,
atomic rename, so two writers at once are harmless) and `cache_report.json`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from fluxzero.config.user_files import parse_json
from fluxzero.data import kontext
from fluxzero.data import shards as fmt
from fluxzero.data.buckets import STEP, default_step, make_buckets, nearest_bucket
from fluxzero.data.errors import DataError, InputFileError
from fluxzero.data.images import (
    captions_for,
    has_alpha,
    list_images,
    load_bucketed,
    load_mask,
    mask_for,
    orphan_masks,
    probe_size,
)
from fluxzero.fsutil import atomic_write

PLAN_FILE = "cache_plan.json"
REPORT_FILE = "cache_report.json"
EMPTY_FILE = fmt.EMPTY_CAPTION_FILE
PARTS_DIR = "parts"
FLIP_MODES = ("none", "random", "both")
STALE_PLAN_S = 3600  # s: a differing plan this old with nothing encoded under it is from a run that died
SMALL_BUCKET = 8  # samples: a bucket below this is cycled to fill a global batch of micro batch x GPUs


@dataclass(frozen=True)
class CacheOptions:
    images_dir: str
    out_dir: str
    resolution: int = 1024
    min_side: int | None = None
    max_aspect: float = 4.0
    bucket_step: int | None = None  # None: buckets.default_step(resolution)
    min_image_side: int | None = None  # None: half the smallest bucket side; 0: keep every image
    flip: str = "none"
    caption_dropout: float = 0.0
    caption_file: str | None = None
    caption_prefix: str = ""  # put before every caption (a trigger word), dropped ones excepted
    mask_from_alpha: bool = False  # an image's alpha channel is its loss mask where it has no NAME.mask.png
    shard_size: int = 64
    batch_size: int = 8
    seed: int = 0
    t5_max_length: int = 512
    latent: str = "mode"
    rank: int = 0
    world_size: int = 1
    encoder_key: str = ""  # encoder folders and dtype: part of the fingerprint, so shards never mix encoders

    def __post_init__(self):
        if self.flip not in FLIP_MODES:
            raise ValueError(f"flip must be one of {FLIP_MODES}, got {self.flip!r}")
        if not 0.0 <= self.caption_dropout < 1.0:
            raise ValueError(f"caption_dropout must be in [0, 1), got {self.caption_dropout}")
        if self.shard_size < 1 or self.batch_size < 1 or self.t5_max_length < 1:
            raise ValueError("shard_size, batch_size and t5_max_length must be >= 1")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={self.rank}, world_size={self.world_size}")
        if self.bucket_step is None:
            object.__setattr__(self, "bucket_step", default_step(self.resolution))
        if self.bucket_step < STEP or self.bucket_step % STEP:
            raise ValueError(f"bucket_step must be a multiple of {STEP}, got {self.bucket_step}")
        if self.min_image_side is not None and self.min_image_side < 0:
            raise ValueError(f"min_image_side must be >= 0, got {self.min_image_side}")
        if self.latent not in ("mode", "sample"):
            raise ValueError(f"latent must be 'mode' or 'sample', got {self.latent!r}")

    def output_options(self) -> dict:
        """The options that change the output (the plan fingerprint covers these, not rank/batch size)."""
        d = asdict(self)
        for k in ("images_dir", "out_dir", "rank", "world_size", "batch_size"):
            d.pop(k)
        # min_image_side acts through the images it skips, which make_plan hashes one by one; a default
        # bucket_step stays out so that folders cached before these options existed still resume
        d.pop("min_image_side")
        if d["caption_file"]:  # the same table by a relative or an absolute path is the same input
            d["caption_file"] = os.path.abspath(d["caption_file"])
        if d["bucket_step"] == STEP:
            d.pop("bucket_step")
        for k in ("caption_prefix", "mask_from_alpha"):  # unset: folders cached before them still resume
            if not d[k]:
                d.pop(k)
        return d


def _unit(*parts) -> float:
    """Deterministic number in [0, 1) from the parts (same on every process and every rerun)."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") / 2**64


def default_min_image_side(buckets: list[tuple[int, int]]) -> int:
    """Shorter side below which an image is skipped by default: half the smallest bucket side (such an image
    would be upscaled more than 2x into even the smallest bucket)."""
    return min(min(b) for b in buckets) // 2


def make_plan(opts: CacheOptions) -> dict:  # noqa: C901
    """Shards to write: [{"id", "bucket": (h, w) px, "items": [{"file", "flip", "caption", "dropped", "mask",
    "reference"}]}]; "pairs": whether the folder holds FLUX.1 Kontext pairs (fluxzero.data.kontext).

    A mask of another size than its image (or one that cannot be read), a missing reference image or one of
    another aspect than its target is an InputFileError here, before anything is written."""
    root = Path(opts.images_dir)
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist; pass a folder of .png/.jpg/.webp images.")
    images = list_images(root)
    if not images:
        raise DataError(f"image folder {root} holds no .png, .jpg, .jpeg or .webp files.")
    references = kontext.references_for(root, images, opts.caption_file)
    if references is not None:  # Kontext pairs: a reference is a target only where its own row names a reference
        only_references = set(references.values()) - set(references)
        images = [im for im in images if im not in only_references]
    captions, caption_source, unmatched = captions_for(root, images, opts.caption_file)
    if caption_source != "txt" and all(c is None for c in captions.values()):
        table = opts.caption_file or root / caption_source
        example = f" (e.g. {unmatched[0]!r})" if unmatched else ""
        raise DataError(
            f"no row of the caption file {table}{example} names one of the {len(images)} images in {root} "
            f"(e.g. {images[0]!r}); file names must be relative to the image folder or bare file names."
        )
    buckets = make_buckets(opts.resolution, opts.min_side, opts.max_aspect, step=opts.bucket_step)
    min_image = default_min_image_side(buckets) if opts.min_image_side is None else opts.min_image_side
    skipped, no_caption, by_bucket = [], [], {}
    fp = hashlib.sha256(json.dumps(opts.output_options(), sort_keys=True).encode())
    from tqdm import tqdm

    # every image's header is read: minutes on a large folder over a network file system, so show it (rank 0)
    for im in tqdm(images, desc="planning", unit="img", disable=opts.rank != 0, leave=False, dynamic_ncols=True):
        try:
            w, h = probe_size(root / im)
        except Exception as e:  # noqa: BLE001 - any unreadable file is skipped and reported, never fatal
            skipped.append(
                {"file": im, "reason": f"unreadable image: {str(e).splitlines()[0] if str(e) else type(e).__name__}"}
            )
            continue
        if min(w, h) < min_image:  # would be upscaled more than 2x into even the smallest bucket
            skipped.append(
                {"file": im, "reason": f"too small: {w}x{h} px, shorter side below {min_image} px (--min-image-side)"}
            )
            fp.update(json.dumps([im, "too small"]).encode())
            continue
        caption = captions[im]
        if caption is None:
            no_caption.append(im)
        if opts.caption_prefix:
            caption = opts.caption_prefix + (caption or "")
        st = (root / im).stat()  # an in-place edit that keeps the byte size still changes mtime_ns
        fp.update(json.dumps([im, st.st_size, st.st_mtime_ns, [w, h], caption]).encode())
        mask, alpha = _check_mask(root, im, (w, h)), False
        if mask is not None:  # hashed only when there is one: folders cached before masks existed still resume
            mst = (root / mask).stat()
            fp.update(json.dumps(["mask", mask, mst.st_size, mst.st_mtime_ns]).encode())
        elif opts.mask_from_alpha and has_alpha(root / im):
            mask, alpha = im, True  # the image's own bytes are hashed above
        reference = None if references is None else references[im]
        if reference is not None:
            kontext.check_reference(root, im, reference, (w, h), buckets, min_image)
            rst = (root / reference).stat()
            fp.update(json.dumps(["reference", reference, rst.st_size, rst.st_mtime_ns]).encode())
        flips = {"none": [False], "both": [False, True], "random": [_unit(opts.seed, "flip", im) < 0.5]}[opts.flip]
        bucket = nearest_bucket(w, h, buckets)
        for flip in flips:
            dropped = opts.caption_dropout > 0 and _unit(opts.seed, "drop", im, flip) < opts.caption_dropout
            by_bucket.setdefault(bucket, []).append(
                {
                    "file": im,
                    "flip": flip,
                    "caption": caption or "",
                    "dropped": dropped,
                    "size": [w, h],
                    "mask": mask,
                    "mask_alpha": alpha,
                    "reference": reference,
                }
            )
    shards = []
    for bucket in sorted(by_bucket):
        items = by_bucket[bucket]
        for k in range(0, len(items), opts.shard_size):
            shards.append({"id": len(shards), "bucket": bucket, "items": items[k : k + opts.shard_size]})
    # a caption table wins over same-name .txt files: count those it hides, so the console can say so
    ignored_txt = 0 if caption_source == "txt" else sum((root / im).with_suffix(".txt").is_file() for im in images)
    return {
        "fingerprint": fp.hexdigest(),
        "shards": shards,
        "skipped": skipped,
        "no_caption": no_caption,
        "caption_source": caption_source,
        "unmatched_captions": unmatched,
        "num_images": len(images),
        "min_image_side": min_image,
        "ignored_txt": ignored_txt,
        "unused_masks": orphan_masks(root, images),
        "pairs": references is not None,
    }


def _check_mask(root: Path, image: str, size: tuple[int, int]) -> str | None:
    """The image's mask file (images.mask_for), checked to be readable and of the image's size."""
    mask = mask_for(root, image)
    if mask is None:
        return None
    try:
        mw, mh = probe_size(root / mask)
    except Exception as e:  # noqa: BLE001 - any unreadable mask: one sentence, nothing written yet
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputFileError(
            f"mask {root / mask} cannot be read ({why}); save it as a PNG of its image's size, or "
            f"delete it to train on the whole image."
        ) from None
    if (mw, mh) != size:
        raise InputFileError(
            f"mask {root / mask} is {mw}x{mh} px but its image {root / image} is {size[0]}x{size[1]} px; "
            f"save the mask at its image's size (white where the loss applies, black where not)."
        )
    gray = _mask_gray(root / mask)
    if gray is None:
        raise InputFileError(
            f"mask {root / mask} has colour (its red, green and blue channels differ), and a mask is one weight "
            f"per pixel; save it as a grayscale PNG (white where the loss applies, black where not)."
        )
    if gray.getextrema()[1] == 0:
        raise InputFileError(
            f"mask {root / mask} is black everywhere, so {root / image} would train nothing; paint "
            f"white where the loss applies (black where not), or delete the mask to train on the "
            f"whole image."
        )
    return mask


def _mask_gray(path: Path):
    """The mask as 8-bit gray (PIL "L"), or None for a colour one. A single-channel mask (alpha, if any, ignored)
    is gray as it is; an RGB or palette one only if its red, green and blue are equal everywhere, as editors save a
    gray drawing: any weighting of real colour would be a guess."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        if len([b for b in im.getbands() if b != "A"]) == 1 and im.mode not in ("P", "PA"):
            return im.convert("L")
        rgb = np.asarray(im.convert("RGB"))
    if not ((rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all()):
        return None
    return Image.fromarray(rgb[..., 0])


# ------------------------------------------------------------------------------------------ resume state
def _part_path(out: Path, sid: int) -> Path:
    return out / PARTS_DIR / f"shard-{sid:05d}.json"


def _read_part(out: Path, sid: int, fingerprint: str) -> dict | None:
    """The part of a finished shard of this plan, or None when the shard must be (re)encoded."""
    p = _part_path(out, sid)
    if not p.exists():
        return None
    try:
        part = parse_json(p.read_text())
        if part.get("fingerprint") != fingerprint:
            return None  # written under another plan (or by a version that did not record one)
        rec = part["record"]
        if rec is not None:
            fmt.check_shard(out, rec, part["dims"])
    except (ValueError, KeyError, AttributeError, DataError):
        return None  # damaged part or shard: encode again
    return part


def _plan_doc(plan: dict, opts: CacheOptions, failed: bool = False) -> bytes:
    doc = {"fingerprint": plan["fingerprint"], "options": opts.output_options(), "num_shards": len(plan["shards"])}
    if failed:
        doc["failed"] = True
    return (json.dumps(doc, indent=1) + "\n").encode()


def _create_exclusive(path: Path, data: bytes) -> bool:
    """Create `path` with `data` complete or not at all; False when it already exists (another process won)."""
    tmp = path.with_name(f".{path.name}.new-{os.getpid()}")
    tmp.write_bytes(data)
    try:
        os.link(tmp, path)  # atomic and exclusive: readers never see a partial plan
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _with_legacy_defaults(options: dict) -> dict:
    """A plan's options with the keys output_options leaves out at their old defaults filled in (bucket_step:
    STEP, as every plan made before the option existed was)."""
    return {"bucket_step": STEP, **options}


def planned_bucket_step(out_dir) -> int | None:
    """The bucket step of the plan an earlier run left in `out_dir`; None where there is none."""
    if not Path(out_dir).is_dir():
        return None
    options = _read_plan(Path(out_dir) / PLAN_FILE).get("options")
    return _with_legacy_defaults(options)["bucket_step"] if isinstance(options, dict) else None


def _read_plan(plan_file: Path) -> dict:
    try:
        old = parse_json(plan_file.read_text())
        return old if isinstance(old, dict) else {"fingerprint": "damaged"}
    except FileNotFoundError:
        return {}
    except ValueError:
        return {"fingerprint": "damaged"}


def _claim_dir(out: Path, plan: dict, opts: CacheOptions) -> None:
    """Make OUT_DIR this plan's folder, or refuse: processes with different plans must never share one.

    The plan file is created exclusively, so of two processes starting at once one writes it and the other
    compares against it. A differing plan is replaced only when nothing was encoded under it and no process
    can still be working on it: its run recorded a failure, or the plan is older than STALE_PLAN_S.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / PARTS_DIR).mkdir(exist_ok=True)
    plan_file = out / PLAN_FILE
    # Shards first, plan second: a process writes the plan before any shard, so seeing shards and then no
    # plan means the shards came from elsewhere (the other order would race with a sibling process).
    shards = any(out.glob("shard-*.safetensors"))
    if not plan_file.exists() and (shards or (out / fmt.MANIFEST).exists()):
        raise DataError(f"{out} already holds shards not made by this cache run; choose a new output folder.")
    started = shards or any((out / PARTS_DIR).glob("shard-*.json"))
    for _ in range(3):
        if _create_exclusive(plan_file, _plan_doc(plan, opts)):
            return
        old = _read_plan(plan_file)
        if not old:
            continue  # removed between our attempt and the read: try again
        if old.get("fingerprint") == plan["fingerprint"]:
            if old.get("failed"):  # a rerun of a failed run: working again, so no other plan may take over
                atomic_write(plan_file, _plan_doc(plan, opts))
            return
        if started and old.get("fingerprint") == "damaged":
            raise DataError(
                f"{plan_file} is damaged, so the shards in {out} cannot be matched to this run; delete {out} to start over."
            )
        if started:
            raise DataError(
                f"{out} was cached from other images, captions or options ({_what_changed(old, opts)}); "
                f"choose a new output folder, or delete it to start over."
            )
        age = time.time() - plan_file.stat().st_mtime
        if not (old.get("failed") or old.get("fingerprint") == "damaged" or age > STALE_PLAN_S):
            raise DataError(
                f"{out} is being cached by another process with other images, captions or options "
                f"({_what_changed(old, opts)}; its {PLAN_FILE} is {age:.0f} s old); wait for it, choose "
                f"another output folder, or delete {out} to start over."
            )
        # nothing encoded under the old plan and nobody working on it: start afresh; its empty-caption
        # embedding may come from other encoders
        plan_file.unlink(missing_ok=True)
        (out / EMPTY_FILE).unlink(missing_ok=True)
    raise DataError(
        f"other processes keep replacing {plan_file}; run one cache command per output folder, or delete {out} to start over."
    )


# CacheOptions.output_options key -> the `fluxzero cache` option that sets it
_FLAGS = {
    "caption_file": "--captions",
    "encoder_key": "the encoders (--flux-dir, --vae, --t5, --clip, --dtype)",
    "t5_max_length": "--t5-max-length (or --variant)",
}


def _what_changed(old: dict, opts: CacheOptions) -> str:
    """Which options differ from those an earlier plan was made with; the images or captions when none do."""
    was, now = _with_legacy_defaults(old.get("options", {})), _with_legacy_defaults(opts.output_options())
    changed = [k for k in now if was.get(k) != now[k]]
    if not changed:
        return "the options are the same, so the images or their captions changed"
    return "changed: " + "; ".join(
        _FLAGS.get(k, "--" + k.replace("_", "-")) + ("" if k == "encoder_key" else f" was {was.get(k)}, now {now[k]}")
        for k in changed
    )


def _check_plan_unchanged(out: Path, plan: dict) -> None:
    """Refuse to record a shard once another plan has taken the folder (a race _claim_dir cannot close alone)."""
    if _read_plan(out / PLAN_FILE).get("fingerprint") != plan["fingerprint"]:
        raise DataError(
            f"another cache run with other images, captions or options took over {out}; "
            f"delete {out} and run one cache command (or one set of ranks) to start over."
        )


def _mark_failed(out: Path, plan: dict, opts: CacheOptions) -> None:
    """Record that this plan's run stopped, so a corrected command may replace it while nothing was encoded."""
    try:
        if _read_plan(out / PLAN_FILE).get("fingerprint") == plan["fingerprint"]:
            atomic_write(out / PLAN_FILE, _plan_doc(plan, opts, failed=True))
    except OSError:
        pass


def _why(e: OSError) -> str:
    return f"{e.strerror}: {e.filename}" if e.strerror and e.filename else (e.strerror or str(e) or type(e).__name__)


# ------------------------------------------------------------------------------------------------ encode
def _empty_caption(out: Path, enc) -> dict:
    """T5/CLIP embedding of "" computed once and kept in EMPTY_FILE; caption-dropped samples store a copy."""
    from safetensors.torch import load_file, save

    path = out / EMPTY_FILE
    if path.exists():
        try:
            d = load_file(str(path))
            if d["t5"].shape == (enc.t5_max_length, enc.dims["t5_dim"]):
                return d
        except Exception:  # noqa: BLE001 - unreadable: recompute
            pass
    t5, t5_len, clip = enc.encode_text([""])
    d = {"t5": t5[0].contiguous(), "clip": clip[0].contiguous(), "t5_len": t5_len}
    atomic_write(path, save(d))
    return d


def _load(path: Path, bucket, flip: bool, mask: Path | None = None, alpha: bool = False, reference: Path | None = None):
    """((pixels, mask or None, reference pixels or None), None) or (None, reason): a bad file is skipped and
    reported, never fatal. A Kontext reference is cropped and flipped to its target's bucket as the target is."""
    try:
        return (
            load_bucketed(path, bucket, flip),
            None if mask is None else load_mask(mask, bucket, flip, alpha),
            None if reference is None else load_bucketed(reference, bucket, flip),
        ), None
    except Exception as e:  # noqa: BLE001
        return None, f"could not decode: {str(e).splitlines()[0] if str(e) else type(e).__name__}"


def _encode_shard(
    shard: dict, opts: CacheOptions, enc, empty: dict, storage_dtype: str, bar, pool
) -> tuple[dict | None, list, list]:
    """(the shard's record or None, the files skipped, the files whose caption T5 cut at t5_max_length)."""
    import torch

    root, samples, skipped, cut = Path(opts.images_dir), [], [], []
    bucket = tuple(shard["bucket"])
    batches = [shard["items"][k : k + opts.batch_size] for k in range(0, len(shard["items"]), opts.batch_size)]

    def submit(batch):  # decode in threads while the encoders work on the previous batch
        return [
            pool.submit(
                _load,
                root / it["file"],
                bucket,
                it["flip"],
                it["mask"] and root / it["mask"],
                it["mask_alpha"],
                it.get("reference") and root / it["reference"],
            )
            for it in batch
        ]

    pending = submit(batches[0])
    for bi, batch in enumerate(batches):
        loaded = [f.result() for f in pending]
        pending = submit(batches[bi + 1]) if bi + 1 < len(batches) else []
        pixels, masks, refs, ok = [], [], [], []
        for it, (px, reason) in zip(batch, loaded):
            if px is None:
                skipped.append({"file": it["file"], "reason": reason})
            else:
                pixels.append(px[0])
                masks.append(px[1])
                refs.append(px[2])
                ok.append(it)
        bar.update(len(batch))
        if not ok:
            continue
        # noise seeded per sample (plan seed, file, flip): shards do not depend on --batch-size
        seeds = [int(_unit(opts.seed, "vae", it["file"], it["flip"]) * 2**62) for it in ok]
        latents = enc.encode_images(torch.stack(pixels), seeds=seeds)
        ref_latents = _encode_references(enc, refs, ok, opts)
        texts = [it["caption"] for it in ok if not it["dropped"]]
        t5, t5_len, clip = enc.encode_text(texts) if texts else (None, None, None)
        if texts:
            kept = [it for it in ok if not it["dropped"]]
            cut += [it["file"] for it, c in zip(kept, enc.t5_cut(texts)) if c and it["file"] not in cut]
        k = 0
        for j, it in enumerate(ok):
            if it["dropped"]:
                e5, elen, ec = empty["t5"], int(empty["t5_len"][0]), empty["clip"]
            else:
                e5, elen, ec = t5[k], int(t5_len[k]), clip[k]
                k += 1
            meta = {"file": it["file"], "flip": it["flip"], "caption_dropped": it["dropped"], "image_size": it["size"]}
            if it["mask"]:
                meta["mask"] = "alpha" if it["mask_alpha"] else it["mask"]
            if it.get("reference"):
                meta["reference"] = it["reference"]
            samples.append(
                {
                    "latents": latents[j],
                    "t5": e5,
                    "clip": ec,
                    "t5_len": elen,
                    "mask": masks[j],
                    "reference": None if ref_latents is None else ref_latents[j],
                    "caption": "" if it["dropped"] else it["caption"],
                    "meta": meta,
                }
            )
    if not samples:
        return None, skipped, cut
    return fmt.write_shard(Path(opts.out_dir) / fmt.shard_name(shard["id"]), samples, storage_dtype), skipped, cut


def _encode_references(enc, refs: list, items: list[dict], opts: CacheOptions):
    """The Kontext references' latents (their own seeded VAE draws), or None for a plain folder."""
    import torch

    if refs[0] is None:
        return None
    seeds = [int(_unit(opts.seed, "vae-reference", it["file"], it["flip"]) * 2**62) for it in items]
    return enc.encode_images(torch.stack(refs), seeds=seeds)


def _shard_dims(enc, plan: dict) -> dict:
    """The manifest's dims: the encoders', and "reference": 1 for a folder of Kontext pairs."""
    return {**enc.dims, "reference": 1} if plan["pairs"] else dict(enc.dims)


def run_cache(opts: CacheOptions, load_encoders, log=print) -> dict:
    """Encode this process's share of the plan; write the manifest when every share is done.

    `load_encoders()` -> Encoders, called only if something is left to encode (a rerun loads nothing).
    Returns {"encoded", "skipped_shards", "manifest": dict | None, "report": dict | None}.
    """
    from tqdm import tqdm

    out = Path(opts.out_dir)
    plan = make_plan(opts)
    if opts.rank == 0:
        _log_captions(plan, opts, log)
    try:
        _claim_dir(out, plan, opts)
    except OSError as e:
        raise DataError(
            f"cannot write to the output folder {out} ({_why(e)}); choose a folder you can write to."
        ) from None
    mine = [s for s in plan["shards"] if s["id"] % opts.world_size == opts.rank]
    todo = [s for s in mine if _read_part(out, s["id"], plan["fingerprint"]) is None]
    if len(todo) < len(mine):
        log(f"rank {opts.rank}: {len(mine) - len(todo)} of {len(mine)} shards already done, skipping them")
    written = 0  # samples this run put into shards
    finished = len(mine) - len(todo)
    try:
        if todo:
            enc = load_encoders()
            empty = _empty_caption(out, enc)
            storage = "bfloat16" if str(enc.dtype) == "torch.bfloat16" else "float32"
            total = sum(len(s["items"]) for s in todo)
            t0, bad = time.perf_counter(), set()
            with (
                tqdm(total=total, unit="img", desc=f"cache {opts.rank}/{opts.world_size}", dynamic_ncols=True) as bar,
                ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool,
            ):
                for s in todo:
                    record, skipped, cut = _encode_shard(s, opts, enc, empty, storage, bar, pool)
                    for sk in {sk["file"]: sk for sk in skipped}.values():
                        bar.write(f"skipped {sk['file']}: {sk['reason']}")
                    _check_plan_unchanged(out, plan)
                    part = {
                        "fingerprint": plan["fingerprint"],
                        "record": record,
                        "skipped": skipped,
                        "captions_truncated": cut,
                        "dims": _shard_dims(enc, plan),
                        "dtype": storage,
                        "vae_scale": enc.scale,
                        "vae_shift": enc.shift,
                        "encoders": vars(enc.paths),
                    }
                    atomic_write(_part_path(out, s["id"]), (json.dumps(part) + "\n").encode())
                    finished += 1
                    written += record["num_samples"] if record else 0
                    bad |= {sk["file"] for sk in skipped}
            # samples of images that fail to decode drop out of the plan's count (a flipped copy counts twice)
            what = f"{written} of {total} planned samples" if bad else f"{written} samples"
            note = f" ({len(bad)} unreadable image(s) skipped)" if bad else ""
            log(f"rank {opts.rank}: encoded {what} in {time.perf_counter() - t0:.1f} s{note}")
        manifest, report = _finalize(out, plan, opts)
    except BaseException as e:
        _mark_failed(out, plan, opts)
        if not isinstance(e, OSError):
            raise
        # image reads and encoder loads catch their own: this is a write into OUT_DIR
        raise DataError(
            f"writing to {out} failed ({_why(e)}); the shards finished so far ({finished} by this process) "
            f"are kept, and running the same command again (after freeing space, if the disk is full) "
            f"encodes only the rest."
        ) from None
    if manifest is None:
        missing = [s["id"] for s in plan["shards"] if _read_part(out, s["id"], plan["fingerprint"]) is None]
        ranks = sorted({sid % opts.world_size for sid in missing})
        log(
            f"rank {opts.rank}: done; {len(missing)} of {len(plan['shards'])} shards still missing (those of rank(s) "
            f"{', '.join(map(str, ranks))} of {opts.world_size}); the manifest is written when all are done, by the last "
            f"process to finish or by rerunning with the missing --rank values"
        )
    return {"encoded": written, "skipped_shards": len(mine) - len(todo), "manifest": manifest, "report": report}


def _log_captions(plan: dict, opts: CacheOptions, log) -> None:
    """Say up front what would otherwise show only in the report: images without caption, unused caption rows and
    unused mask files."""
    n, images = len(plan["no_caption"]), plan["num_images"] - len(plan["skipped"])
    if n:
        src = "no same-name .txt file" if plan["caption_source"] == "txt" else f"no row in {plan['caption_source']}"
        log(
            f"{n} of {images} image(s) have {src} and are encoded with the empty caption (first: {plan['no_caption'][0]}; "
            f"all listed in {REPORT_FILE})"
        )
    if plan["ignored_txt"]:
        table = opts.caption_file or Path(opts.images_dir) / plan["caption_source"]
        log(
            f"{plan['ignored_txt']} same-name .txt caption file(s) are ignored: the captions come from {table} "
            + (
                "(leave out --captions, with no metadata file in the image folder, to use them)"
                if opts.caption_file
                else "(move it out of the image folder to use them)"
            )
        )
    if plan["unmatched_captions"]:
        u = plan["unmatched_captions"]
        log(
            f"{len(u)} row(s) of {plan['caption_source']} name no image in {opts.images_dir} (first: {u[0]}; "
            f"all listed in {REPORT_FILE})"
        )
    if plan["unused_masks"]:
        u = plan["unused_masks"]
        log(
            f"{len(u)} mask file(s) in {opts.images_dir} belong to no image cached here and are not used (first: "
            f"{u[0]}; a mask is NAME.mask.png beside its image NAME.png, .jpg, .jpeg or .webp; all listed in "
            f"{REPORT_FILE})"
        )


def small_buckets(manifest: dict, below: int = SMALL_BUCKET) -> tuple[int, int, int]:
    """(buckets with fewer than `below` samples, samples in them, all buckets) of a cache manifest."""
    sizes = [b["num_samples"] for b in manifest["cache"]["pixel_buckets"].values()]
    small = [n for n in sizes if n < below]
    return len(small), sum(small), len(sizes)


def _nothing_usable(skipped: list[dict], plan: dict, opts: CacheOptions, report: Path) -> str:
    """Why no image made it into a shard, counted by reason, and the option that would change it."""
    small = sum(s["reason"].startswith("too small") for s in skipped)
    kinds = ", ".join(f"{n} {what}" for n, what in ((small, "too small"), (len(skipped) - small, "unreadable")) if n)
    why = f"no image in {opts.images_dir} could be used: {len(skipped)} of {plan['num_images']} skipped ({kinds}); "
    if not small:
        return why + f"each file and its reason is in {report}."
    side = plan["min_image_side"]
    if opts.min_image_side is None:
        fix = (
            "half the smallest bucket side; a lower --resolution or --min-side, or --min-image-side 0 to "
            "upscale them, keeps them"
        )
    else:
        fix = "--min-image-side; a lower value keeps them, 0 keeps all"
    return why + f"too small means a shorter side below {side} px ({fix}); each file is listed in {report}."


def _finalize(out: Path, plan: dict, opts: CacheOptions):
    parts = []
    for s in plan["shards"]:
        p = _read_part(out, s["id"], plan["fingerprint"])
        if p is None:
            return None, None
        parts.append(p)
    records = [p["record"] for p in parts if p["record"] is not None]
    skipped = list({sk["file"]: sk for sk in plan["skipped"] + [sk for p in parts for sk in p["skipped"]]}.values())
    bad = {sk["file"] for sk in skipped}
    report = {
        "num_images": plan["num_images"],
        "num_samples": sum(r["num_samples"] for r in records),
        "skipped": skipped,
        "no_caption": [im for im in plan["no_caption"] if im not in bad],
        "captions_matching_no_image": plan["unmatched_captions"],
        "masks_matching_no_image": plan["unused_masks"],
        # parts written before this key existed count none (a rerun does not re-encode them)
        "captions_truncated": sorted({f for p in parts for f in p.get("captions_truncated", []) if f not in bad}),
    }
    _write_if_changed(out / REPORT_FILE, report)
    if not records:
        raise DataError(_nothing_usable(skipped, plan, opts, out / REPORT_FILE))
    first = next(p for p in parts if p["record"] is not None)
    kept = [
        it
        for s, p in zip(plan["shards"], parts)
        if p["record"] is not None
        for it in s["items"]
        if it["file"] not in bad
    ]
    total = sum(r["num_samples"] for r in records)
    stats = {}
    for s, part in zip(plan["shards"], parts):
        if part["record"] is not None:
            h, w = s["bucket"]
            b = stats.setdefault(f"{h}x{w}", {"latent_hw": [h // 8, w // 8], "num_samples": 0})
            b["num_samples"] += part["record"]["num_samples"]
    for b in stats.values():
        b["share"] = round(b["num_samples"] / total, 4)
    extra = {
        "images_dir": str(Path(opts.images_dir).resolve()),
        "num_images": plan["num_images"],
        "num_skipped": len(skipped),
        "report": REPORT_FILE,
        "caption_source": plan["caption_source"],
        "caption_dropout": opts.caption_dropout,
        "num_caption_dropped": sum(it["dropped"] for it in kept),
        "num_masked": sum(bool(it["mask"]) for it in kept),
        **({"num_pairs": len(kept)} if plan["pairs"] else {}),
        **({"caption_prefix": opts.caption_prefix} if opts.caption_prefix else {}),
        "empty_caption": EMPTY_FILE,
        "flip": opts.flip,
        "num_flipped": sum(it["flip"] for it in kept),
        "resolution": opts.resolution,
        "min_side": opts.min_side,
        "max_aspect": opts.max_aspect,
        "bucket_step": opts.bucket_step,
        "min_image_side": plan["min_image_side"],
        "latent": opts.latent,
        "vae_scale": first["vae_scale"],
        "vae_shift": first["vae_shift"],
        "t5_max_length": opts.t5_max_length,
        "encoders": first["encoders"],
        "seed": opts.seed,
        "plan_fingerprint": plan["fingerprint"],
        "pixel_buckets": stats,
    }
    manifest = fmt.build_manifest(records, first["dims"], first["dtype"], extra)
    _write_if_changed(out / fmt.MANIFEST, manifest)
    return manifest, report


def _write_if_changed(path: Path, doc: dict) -> None:
    data = (json.dumps(doc, indent=1, ensure_ascii=False) + "\n").encode()
    if not (path.exists() and path.read_bytes() == data):
        atomic_write(path, data)


def env_rank_world() -> tuple[int, int]:
    """RANK / WORLD_SIZE from a launcher (torchrun, deepspeed, srun via SLURM_PROCID/SLURM_NTASKS), else 0 / 1."""
    values = []
    for names, default, low in ((("RANK", "SLURM_PROCID"), "0", 0), (("WORLD_SIZE", "SLURM_NTASKS"), "1", 1)):
        name = next((n for n in names if n in os.environ), None)
        text = os.environ[name] if name else default
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            opt = "--rank" if low == 0 else "--world-size"
            raise DataError(
                f"environment variable {name}={text!r} is not a whole number >= {low}; fix or unset it, or pass {opt}."
            )
        values.append(value)
    return values[0], values[1]
