"""The cached-latent shard format: safetensors shards plus a versioned `manifest.json`.

Layout of a data directory (format version 1)::

    manifest.json                 written last, atomically; its presence means "complete"
    shard-00000.safetensors       one shard = samples of ONE latent size (one bucket)
    ...

A shard holds, for its n samples (row i = one sample):

    latents  (n, C, h, w)   VAE latents after FLUX's shift and scale (C = 16; h, w = pixel size / 8)
    t5       (n, L, D)      T5 encoder output, padded to L tokens (D = 4096 for T5-XXL)
    clip     (n, V)         CLIP pooled output (V = 768 for CLIP-L)
    t5_len   (n,) int32     real (unpadded) token count of each caption
    mask     (n, h/2, w/2)  optional, float32: per packed 2x2 latent patch (one image token), the share of its
                            pixels the loss covers (1 = all); a shard of images without masks has none
    reference (n, C, h, w)  FLUX.1 Kontext pairs only: the reference image's latents, cached at its target's
                            bucket (manifest dims "reference": 1); other shards have none
    header metadata: one key "fluxzero" whose value is JSON {"format", "version", "captions": [n strings],
                     "samples": [n dicts: source file, flip, ...], "xxh3_64": [n hex strings]} (one
                     key, because safetensors writes several metadata keys in a random order and shards
                     must be byte-reproducible)

"xxh3_64" (added within version 1; shards written before it have none and load unchecked, as before) is, per
sample, the 64-bit XXH3 hash of the bytes of its latents, t5 and clip rows as stored, in that order (and its
mask row after them, in a shard that has masks, then its reference row, in a shard of Kontext pairs). The
reader checks it for every sample it reads, so a shard damaged in place (same size, so the open-time size and
header checks pass) stops training at the first damaged sample instead of training on it. XXH3 (the xxhash
package) rather than the standard library's zlib.crc32: on 4.5 MiB samples (1024 px latents + T5, bf16, from
the page cache, one thread, 2-core machine) crc32 made ShardSource.get 3.2-3.8x slower (+3.3 ms a sample),
XXH3 1.5-2.1x (+0.6-0.9 ms a sample, against a GPU step of ~250 ms a sample at 1024 px): the hash is a
second pass over bytes the float32 conversion reads anyway (benchmarks/archive/shard_checksum.py measures it).

The manifest lists the shards in order (file, num_samples, latent_hw, bytes, sha256, text_lens), the
dims, the per-bucket sample counts and, under "cache", how the shards were made. Global sample index =
position in the concatenation of the shards in manifest order.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fluxzero.config.user_files import parse_json
from fluxzero.data.errors import DataError
from fluxzero.dtypes import SAFETENSORS_CODES
from fluxzero.fsutil import atomic_write

FORMAT = "fluxzero-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_TENSORS = ("latents", "t5", "clip", "t5_len")
EMPTY_CAPTION_FILE = "empty_caption.safetensors"  # `fluxzero cache` keeps the embedding of "" here
META_KEY = "fluxzero"
MAX_OPEN_SHARDS = 64  # per process (each DataLoader worker has its own)
_RECREATE = "re-create the shards with `fluxzero cache`"


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def bucket_key(h: int, w: int) -> str:
    return f"{h}x{w}"


CHECKSUM_KEY = "xxh3_64"


def sample_checksum(latents, t5, clip, mask=None, reference=None) -> str:
    """XXH3-64 (hex) of one sample's stored bytes. Shape: latents (C,h,w), t5 (L,D), clip (V,), shard dtype;
    mask (h/2,w/2) float32 or None; reference (C,h,w) in the shard dtype or None."""
    import torch

    try:
        import xxhash
    except ImportError:
        raise DataError(
            "checking shard checksums needs the xxhash package; `pip install xxhash` "
            "(it is in fluxzero's train requirements)."
        ) from None
    h = xxhash.xxh3_64()
    for t in (t for t in (latents, t5, clip, mask, reference) if t is not None):  # as bytes: numpy has no bfloat16
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------- writing
def write_shard(path, samples: list[dict], dtype="float32") -> dict:
    """Write one shard of same-size samples atomically; return its manifest record.

    Each sample: {"latents": (C,h,w), "t5": (L,D), "clip": (V,), "caption": str, "t5_len": int (optional),
    "meta": dict (optional), "mask": (h/2,w/2) in [0, 1] (optional; where some sample has one, the shard
    stores masks, all ones for the samples without), "reference": (C,h,w) (FLUX.1 Kontext; every sample of
    the shard has one, or none does)}.
    """
    import torch
    from safetensors.torch import save

    if not samples:
        raise ValueError("write_shard needs at least one sample")
    tdtype = getattr(torch, dtype)
    hw = tuple(samples[0]["latents"].shape[-2:])
    for s in samples:
        if tuple(s["latents"].shape[-2:]) != hw:
            raise ValueError(
                f"all samples of one shard must share one latent size, got {hw} and {tuple(s['latents'].shape[-2:])}"
            )
    L = samples[0]["t5"].shape[0]
    text_lens = [int(s.get("t5_len", L)) for s in samples]
    tensors = {
        "latents": torch.stack([s["latents"].detach().to("cpu", tdtype) for s in samples]).contiguous(),
        "t5": torch.stack([s["t5"].detach().to("cpu", tdtype) for s in samples]).contiguous(),
        "clip": torch.stack([s["clip"].detach().to("cpu", tdtype) for s in samples]).contiguous(),
        "t5_len": torch.tensor(text_lens, dtype=torch.int32),
    }
    if any(s.get("mask") is not None for s in samples):
        grid = (hw[0] // 2, hw[1] // 2)
        for s in samples:
            if s.get("mask") is not None and tuple(s["mask"].shape) != grid:
                raise ValueError(
                    f"a mask must have one value per packed latent patch, {grid}, got {tuple(s['mask'].shape)}"
                )
        tensors["mask"] = torch.stack(
            [torch.ones(grid) if s.get("mask") is None else s["mask"].detach().float().cpu() for s in samples]
        ).contiguous()
    refs = [s.get("reference") is not None for s in samples]
    if any(refs):
        if not all(refs) or any(tuple(s["reference"].shape) != tuple(s["latents"].shape) for s in samples):
            raise ValueError("every sample of a shard of Kontext pairs needs a reference of its latents' shape")
        tensors["reference"] = torch.stack([s["reference"].detach().to("cpu", tdtype) for s in samples]).contiguous()
    mask, ref = tensors.get("mask"), tensors.get("reference")
    sums = [
        sample_checksum(
            tensors["latents"][i],
            tensors["t5"][i],
            tensors["clip"][i],
            None if mask is None else mask[i],
            None if ref is None else ref[i],
        )
        for i in range(len(samples))
    ]
    info = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "captions": [s.get("caption", "") for s in samples],
        "samples": [s.get("meta") or {} for s in samples],
        CHECKSUM_KEY: sums,
    }
    data = save(tensors, metadata={META_KEY: json.dumps(info, ensure_ascii=False)})
    path = Path(path)
    atomic_write(path, data)
    return {
        "file": path.name,
        "num_samples": len(samples),
        "latent_hw": list(hw),
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "text_lens": text_lens,
    }


def build_manifest(records: list[dict], dims: dict, dtype: str, extra: dict | None = None) -> dict:
    buckets: dict[str, dict] = {}
    for r in records:
        b = buckets.setdefault(
            bucket_key(*r["latent_hw"]), {"latent_hw": r["latent_hw"], "num_samples": 0, "num_shards": 0}
        )
        b["num_samples"] += r["num_samples"]
        b["num_shards"] += 1
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "num_samples": sum(r["num_samples"] for r in records),
        "dtype": dtype,
        "dims": dims,
        "buckets": dict(sorted(buckets.items())),
        "shards": records,
    }
    if extra:
        manifest["cache"] = extra
    return manifest


def write_manifest(out_dir, records: list[dict], dims: dict, dtype: str, extra: dict | None = None) -> dict:
    manifest = build_manifest(records, dims, dtype, extra)
    atomic_write(Path(out_dir) / MANIFEST, (json.dumps(manifest, indent=1, ensure_ascii=False) + "\n").encode())
    return manifest


class ShardWriter:
    """Accumulate samples, group them by latent size, write full shards as they fill; manifest at close().

        with ShardWriter(out_dir, samples_per_shard=256) as w:
            w.add(latents, t5, clip, caption="a cat")      # (16,h,w), (L,D), (V,)
        # manifest.json exists only if the block finished without an exception

    Every shard and the manifest are written to a temp file and renamed, the manifest last, so a crash
    leaves a directory that the reader refuses (no manifest) instead of one it half-reads.
    """

    def __init__(self, out_dir, *, samples_per_shard: int = 256, dtype: str = "float32", extra: dict | None = None):
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
        if dtype not in SAFETENSORS_CODES:
            raise ValueError(f"dtype must be one of {sorted(SAFETENSORS_CODES)}, got {dtype!r}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if (self.out_dir / MANIFEST).exists() or any(self.out_dir.glob("shard-*.safetensors")):
            raise DataError(f"output directory {self.out_dir} already holds shards; choose an empty directory.")
        self.samples_per_shard = samples_per_shard
        self.dtype = dtype
        self.extra = extra
        self.records: list[dict] = []
        self.dims: dict | None = None
        self._pending: dict[tuple[int, int], list[dict]] = {}
        self._closed = False

    def add(
        self,
        latents,
        t5,
        clip,
        caption: str = "",
        t5_len: int | None = None,
        meta: dict | None = None,
        mask=None,
        reference=None,
    ) -> None:
        """Shape: latents (C, h, w), t5 (L, D), clip (V,), mask (h/2, w/2) or None, reference (C, h, w) or None
        (FLUX.1 Kontext pairs: all samples of a writer have one, or none)."""
        if latents.dim() != 3 or t5.dim() != 2 or clip.dim() != 1:
            raise ValueError(
                f"expected latents (C,h,w), t5 (L,D), clip (V,); got {tuple(latents.shape)}, {tuple(t5.shape)}, {tuple(clip.shape)}"
            )
        dims = {
            "latent_channels": latents.shape[0],
            "t5_len": t5.shape[0],
            "t5_dim": t5.shape[1],
            "clip_dim": clip.shape[0],
        }
        if reference is not None:
            dims["reference"] = 1
        if self.dims is None:
            self.dims = dims
        elif dims != self.dims:
            raise ValueError(f"sample dims {dims} differ from the first sample's {self.dims}")
        sample = {
            "latents": latents,
            "t5": t5,
            "clip": clip,
            "caption": caption,
            "meta": meta,
            "mask": mask,
            "reference": reference,
        }
        if t5_len is not None:
            sample["t5_len"] = t5_len
        hw = tuple(latents.shape[-2:])
        self._pending.setdefault(hw, []).append(sample)
        if len(self._pending[hw]) >= self.samples_per_shard:
            self._flush(hw)

    def _flush(self, hw) -> None:
        samples = self._pending.pop(hw)
        self.records.append(write_shard(self.out_dir / shard_name(len(self.records)), samples, self.dtype))

    def close(self) -> dict:
        """Write the partial shards and then the manifest; returns the manifest."""
        if self._closed:
            raise RuntimeError("ShardWriter is already closed")
        for hw in sorted(self._pending):
            self._flush(hw)
        self._closed = True
        if not self.records:
            raise DataError(f"no samples were added to {self.out_dir}; nothing to write.")
        return write_manifest(self.out_dir, self.records, self.dims, self.dtype, self.extra)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        return False


# --------------------------------------------------------------------------------------------- reading
def read_manifest(data_dir) -> dict:
    """Load and check `manifest.json`; every problem is a one-sentence DataError."""
    d = Path(data_dir)
    if not d.exists():
        raise DataError(
            f"data directory {d} does not exist; pass a folder made by `fluxzero cache` or a synthetic spec such as 'synthetic:n=64,hw=32x32'."
        )
    if not d.is_dir():
        raise DataError(f"data path {d} is not a directory; pass a folder made by `fluxzero cache`.")
    path = d / MANIFEST
    if not path.exists():
        if not any(d.iterdir()):
            raise DataError(f"data directory {d} is empty; fill it with `fluxzero cache IMAGES_DIR {d}`.")
        raise DataError(f"data directory {d} has no {MANIFEST} (unfinished or not a shard folder); {_RECREATE}.")
    try:
        manifest = parse_json(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"manifest {path} cannot be read ({e}); {_RECREATE}.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"manifest {path} is not a fluxzero shard manifest; {_RECREATE}.")
    if manifest.get("version") != FORMAT_VERSION:
        raise DataError(
            f"manifest {path} has format version {manifest.get('version')!r} but this fluxzero reads version "
            f"{FORMAT_VERSION}; {_RECREATE} or use the matching fluxzero version."
        )
    try:
        shards = manifest["shards"]
        for key in ("latent_channels", "t5_len", "t5_dim", "clip_dim"):
            int(manifest["dims"][key])
        for r in shards:
            r["file"], int(r["num_samples"]), int(r["bytes"]), tuple(r["latent_hw"])
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"manifest {path} is missing field {e}; {_RECREATE}.") from None
    if sum(r["num_samples"] for r in shards) == 0:
        raise DataError(f"manifest {path} lists no samples; {_RECREATE} from a folder with images.")
    return manifest


def read_header(path) -> tuple[dict, dict]:
    """A safetensors header without loading data: ({tensor: {"dtype", "shape"}}, metadata).

    safetensors' own reader checks what catches truncated and overwritten files (the header length fits, the
    header is JSON, the tensors cover the file exactly); ValueError with its reason otherwise. The "numpy"
    framework reads no tensor and keeps this module free of torch.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            entries = {k: {"dtype": (s := f.get_slice(k)).get_dtype(), "shape": list(s.get_shape())} for k in f.keys()}
            return entries, f.metadata() or {}
    except SafetensorError as e:
        raise ValueError(str(e).removeprefix("Error while deserializing header: ")) from None


def check_shard(data_dir, record: dict, dims: dict) -> None:
    """Cheap open-time check of one shard against its manifest record (size, header, shapes)."""
    path = Path(data_dir) / record["file"]
    if not path.exists():
        raise DataError(
            f"shard {path} listed in the manifest is missing; {_RECREATE} (a rerun rewrites missing shards)."
        )
    size = path.stat().st_size
    if size != record["bytes"]:
        raise DataError(
            f"shard {path} has {size} bytes but the manifest says {record['bytes']} (truncated or overwritten); {_RECREATE}."
        )
    try:
        header, meta = read_header(path)
    except (OSError, ValueError) as e:
        raise DataError(f"shard {path} is corrupt ({e}); {_RECREATE}.") from None
    n, (h, w) = record["num_samples"], record["latent_hw"]
    want = {
        "latents": [n, dims["latent_channels"], h, w],
        "t5": [n, dims["t5_len"], dims["t5_dim"]],
        "clip": [n, dims["clip_dim"]],
    }
    if "mask" in header:
        want["mask"] = [n, h // 2, w // 2]
    if dims.get("reference"):
        want["reference"] = [n, dims["latent_channels"], h, w]
    for key, shape in want.items():
        got = header.get(key, {}).get("shape")
        if got != shape:
            raise DataError(f"shard {path} holds {key} of shape {got} but the manifest implies {shape}; {_RECREATE}.")
    try:
        version = parse_json(meta[META_KEY])["version"]
    except (KeyError, TypeError, ValueError):
        raise DataError(f"shard {path} has no fluxzero metadata in its header; {_RECREATE}.") from None
    if version != FORMAT_VERSION:
        raise DataError(f"shard {path} has format version {version!r}, expected {FORMAT_VERSION}; {_RECREATE}.")


def verify_shards(data_dir, checksum: bool = True) -> dict:
    """Check every shard (size, header, shapes and, with checksum=True, sha256 of all bytes).

    The loader does the cheap checks at open; the checksum reads every byte, so it is opt-in.
    """
    manifest = read_manifest(data_dir)
    for r in manifest["shards"]:
        check_shard(data_dir, r, manifest["dims"])
        if checksum and r.get("sha256"):
            h = hashlib.sha256()
            with open(Path(data_dir) / r["file"], "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
            if h.hexdigest() != r["sha256"]:
                raise DataError(
                    f"shard {Path(data_dir) / r['file']} fails its sha256 check (corrupt bytes); {_RECREATE}."
                )
    return manifest


class ShardSource:
    """Random access to the samples of a shard directory (picklable: file handles are opened lazily).

    checksums=True (the default) checks each sample read against its XXH3 hash where the shard has them.
    """

    def __init__(self, data_dir, checksums: bool = True):
        self.data_dir = Path(data_dir)
        self.checksums = checksums
        self.manifest = read_manifest(self.data_dir)
        self.dims = {k: int(v) for k, v in self.manifest["dims"].items()}
        for r in self.manifest["shards"]:
            check_shard(self.data_dir, r, self.dims)
        self._starts = []  # first global index of each shard
        total = 0
        for r in self.manifest["shards"]:
            self._starts.append(total)
            total += r["num_samples"]
        self.num_samples = total
        self._handles: dict[int, object] = {}
        self._infos: dict[int, dict] = {}

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_handles"], state["_infos"] = {}, {}
        return state

    def fingerprint(self) -> str:
        """What the samples are, wherever the folder lives: the shards' names, sample counts and hashes."""
        rows = [[r.get("file"), r["num_samples"], r.get("sha256")] for r in self.manifest["shards"]]
        return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return self.num_samples

    def latent_sizes(self) -> list[tuple[int, int]]:
        """Latent (h, w) of every sample, in global index order."""
        out = []
        for r in self.manifest["shards"]:
            out += [tuple(r["latent_hw"])] * r["num_samples"]
        return out

    def _locate(self, i: int) -> tuple[int, int]:
        import bisect

        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample index {i} out of range [0, {self.num_samples})")
        s = bisect.bisect_right(self._starts, i) - 1
        return s, i - self._starts[s]

    def _info(self, s: int) -> dict:
        if s not in self._infos:
            self._infos[s] = parse_json(self._handle(s).metadata()[META_KEY])
        return self._infos[s]

    def caption(self, i: int) -> str:
        s, row = self._locate(i)
        return self._info(s)["captions"][row]

    def describe(self, i: int) -> str:
        """Where sample i lives, for messages: "shard PATH sample ROW (global index I)"."""
        s, row = self._locate(i)
        return f"shard {self.data_dir / self.manifest['shards'][s]['file']} sample {row} (global index {i})"

    def sample_meta(self, i: int) -> dict:
        """What the writer recorded about sample i (for `fluxzero cache`: file, flip, caption_dropped, ...)."""
        s, row = self._locate(i)
        return self._info(s)["samples"][row]

    def _has_mask(self, s: int) -> bool:
        return "mask" in self._handle(s).keys()

    def empty_caption(self) -> dict:
        """The embedding of the empty caption `fluxzero cache` kept beside the shards (for caption dropout)."""
        import torch
        from safetensors.torch import load_file

        path = self.data_dir / EMPTY_CAPTION_FILE
        try:
            d = load_file(str(path))
            t5, clip = d["t5"].to(torch.float32), d["clip"].to(torch.float32)
        except Exception:  # noqa: BLE001 - missing or unreadable: the same fix
            raise DataError(
                f"caption dropout needs {path}, the empty caption's embedding `fluxzero cache` writes; "
                f"re-run the `fluxzero cache` command that made {self.data_dir}, or set caption_dropout "
                f"to 0 for it."
            ) from None
        if tuple(t5.shape) != (self.dims["t5_len"], self.dims["t5_dim"]) or tuple(clip.shape) != (
            self.dims["clip_dim"],
        ):
            raise DataError(
                f"{path} does not fit the shards beside it (other encoders); re-run the `fluxzero cache` "
                f"command that made {self.data_dir}, or set caption_dropout to 0 for it."
            )
        return {"t5": t5, "clip": clip}

    def _handle(self, s: int):
        from safetensors import safe_open

        if s in self._handles:
            self._handles[s] = self._handles.pop(s)  # most recently used last
        else:
            if len(self._handles) >= MAX_OPEN_SHARDS:  # bound open maps per worker on 10k-shard datasets
                del self._handles[next(iter(self._handles))]
            self._handles[s] = safe_open(str(self.data_dir / self.manifest["shards"][s]["file"]), framework="pt")
        return self._handles[s]

    def get(self, i: int) -> dict:
        """Shape: {"latents": (C,h,w) f32, "t5": (L,D) f32, "clip": (V,) f32, "index": int}, plus "mask" (h/2,w/2)
        where the shard has masks and "reference" (C,h,w) for Kontext pairs."""
        import torch

        s, row = self._locate(i)
        path = self.data_dir / self.manifest["shards"][s]["file"]
        try:
            f = self._handle(s)
            keys = (
                "latents",
                "t5",
                "clip",
                *(("mask",) if self._has_mask(s) else ()),
                *(("reference",) if self.dims.get("reference") else ()),
            )
            raw = {k: f.get_slice(k)[row : row + 1][0] for k in keys}  # stored dtype
            sums = self._info(s).get(CHECKSUM_KEY) if self.checksums else None
        except Exception as e:  # any read failure mid-training: name the shard, keep it one sentence
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"shard {path} could not be read at row {row} ({msg}); {_RECREATE}.") from None
        if sums is not None and (
            row >= len(sums)
            or sample_checksum(raw["latents"], raw["t5"], raw["clip"], raw.get("mask"), raw.get("reference"))
            != sums[row]
        ):
            raise DataError(
                f"shard {path} sample {row} (global index {i}) fails its checksum, so its bytes "
                f"changed after `fluxzero cache` wrote them; delete {path} and re-run the same "
                f"`fluxzero cache` command, which rewrites it."
            )
        out = {k: v.to(torch.float32) for k, v in raw.items()}
        out["index"] = i
        return out
