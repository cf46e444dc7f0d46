"""Synthetic source: `"synthetic:n=64,hw=32x32,txt=16,ctx=64,vec=32"`, deterministic per sample index.

Keys (all optional): n (samples, 64), hw (LATENT h x w, several joined by '+', each optionally weighted by
'*k', e.g. 32x32*2+32x48; sample i gets the (i mod total weight)-th size of the list with each size repeated
by its weight, 32x32), buckets (a pixel resolution such as 512: instead of hw, the aspect buckets `fluxzero
cache` makes of a typical photo collection at that resolution, see bucket_mix), txt (T5 tokens, 16), ctx (T5
width, 64), vec (CLIP width, 32), ch (latent channels, 16), seed (data seed, 0), ref (1: each sample also holds
the reference latents of a FLUX.1 Kontext pair, at its target's size; 0). Sample i depends only on (seed, i),
never on rank or order.
"""

from __future__ import annotations

from fluxzero.data.errors import DataError

PREFIX = "synthetic:"
_DEFAULTS = {"n": 64, "hw": "32x32", "buckets": 0, "txt": 16, "ctx": 64, "vec": 32, "ch": 16, "seed": 0, "ref": 0}
_EXAMPLE = "'synthetic:n=64,hw=32x32,txt=16,ctx=64,vec=32'"
# (width, height, weight) of a photo collection's aspect ratios: square, then 3:4 and 2:3 both ways
PHOTO_ASPECTS = ((1, 1, 4), (3, 4, 2), (4, 3, 2), (2, 3, 1), (3, 2, 1))


def bucket_mix(resolution: int, step: int | None = None) -> str:
    """The `hw` value of PHOTO_ASPECTS at `resolution` px: each aspect's bucket as `fluxzero cache` picks it
    (fluxzero.data.buckets; `step`: its --bucket-step, default its default), as latent h x w (pixels / 8) with its
    weight. At 512: 64x64*4+72x56*2+56x72*2+80x48+48x80 (512x512 40%, 576x448 and 448x576 20%, 640x384 and 384x640
    10%; every token count a multiple of 16); with step 16: 64x64*4+74x54*2+54x74*2+78x52+52x78."""
    from fluxzero.data.buckets import make_buckets, nearest_bucket

    buckets = make_buckets(resolution, step=step)
    parts = []
    for w, h, weight in PHOTO_ASPECTS:
        bh, bw = nearest_bucket(w, h, buckets)
        parts.append(f"{bh // 8}x{bw // 8}" + (f"*{weight}" if weight > 1 else ""))
    return "+".join(parts)


def is_synthetic(source) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def parse_spec(spec: str) -> dict:
    opts, given = dict(_DEFAULTS), set()
    body = spec[len(PREFIX) :].strip()
    for part in filter(None, (p.strip() for p in body.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in _DEFAULTS:
            raise DataError(
                f"synthetic spec {spec!r}: unknown item {part!r}; use keys {', '.join(_DEFAULTS)} as in {_EXAMPLE}."
            )
        opts[key] = value.strip()
        given.add(key)
    if "buckets" in given:
        if "hw" in given:
            raise DataError(f"synthetic spec {spec!r}: give hw or buckets, not both.")
        res = str(opts["buckets"])
        if not (res.isdigit() and int(res) >= 64 and int(res) % 16 == 0):
            raise DataError(
                f"synthetic spec {spec!r}: buckets must be a pixel resolution, a multiple of 16 from 64 "
                f"on such as 512, got {res!r}."
            )
        opts["hw"] = bucket_mix(int(res))
    sizes = []
    for s in str(opts["hw"]).split("+"):
        size, star, weight = s.strip().lower().partition("*")
        h, x, w = size.strip().partition("x")
        weight = weight.strip() if star else "1"
        if not (
            x and h.isdigit() and w.isdigit() and int(h) > 0 and int(w) > 0 and weight.isdigit() and int(weight) > 0
        ):
            raise DataError(
                f"synthetic spec {spec!r}: hw must be latent sizes like 32x32, 32x32+32x48 or "
                f"32x32*2+32x48, got {opts['hw']!r}."
            )
        sizes += [(int(h), int(w))] * int(weight)
    out = {"sizes": sizes}
    for key in ("n", "txt", "ctx", "vec", "ch", "seed", "ref"):
        try:
            out[key] = int(opts[key])
        except ValueError:
            raise DataError(f"synthetic spec {spec!r}: {key} must be an integer, got {opts[key]!r}.") from None
        if key not in ("seed", "ref") and out[key] < 1:
            raise DataError(f"synthetic spec {spec!r}: {key} must be >= 1, got {out[key]}.")
    if out["ref"] not in (0, 1):
        raise DataError(f"synthetic spec {spec!r}: ref must be 0 or 1, got {out['ref']}.")
    if not out["ref"]:  # kept out: the fingerprint of a spec without pairs stays what it was before ref existed
        del out["ref"]
    return out


class SyntheticSource:
    """Random tensors generated from (seed, index): identical on every rank and in every worker."""

    def __init__(self, spec: str):
        self.spec = spec
        o = parse_spec(spec)
        self.sizes, self.num_samples, self.seed = o["sizes"], o["n"], o["seed"]
        self.dims = {"latent_channels": o["ch"], "t5_len": o["txt"], "t5_dim": o["ctx"], "clip_dim": o["vec"]}
        if o.get("ref"):
            self.dims["reference"] = 1

    def __len__(self) -> int:
        return self.num_samples

    def fingerprint(self) -> str:
        """The generating options, however the spec was written."""
        return "synthetic:" + ",".join(f"{k}={v}" for k, v in sorted(parse_spec(self.spec).items()))

    def latent_sizes(self) -> list[tuple[int, int]]:
        return [self.sizes[i % len(self.sizes)] for i in range(self.num_samples)]

    def describe(self, i: int) -> str:
        """Where sample i lives, for messages."""
        return f"synthetic sample {i}"

    def caption(self, i: int) -> str:
        return f"synthetic sample {i}"

    def empty_caption(self) -> dict:
        """The embedding caption dropout trains with: zeros here (there is no text encoder)."""
        import torch

        return {"t5": torch.zeros(self.dims["t5_len"], self.dims["t5_dim"]), "clip": torch.zeros(self.dims["clip_dim"])}

    def get(self, i: int) -> dict:
        """Shape: {"latents": (C,h,w), "t5": (L,D), "clip": (V,), "index": int} and with ref=1 "reference": (C,h,w),
        all float32."""
        import torch

        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample index {i} out of range [0, {self.num_samples})")
        h, w = self.sizes[i % len(self.sizes)]
        d = self.dims
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        out = {
            "latents": torch.randn(d["latent_channels"], h, w, generator=g),
            "t5": torch.randn(d["t5_len"], d["t5_dim"], generator=g),
            "clip": torch.randn(d["clip_dim"], generator=g),
            "index": i,
        }
        if d.get("reference"):  # drawn last: the other tensors stay those of the same spec without ref
            out["reference"] = torch.randn(d["latent_channels"], h, w, generator=g)
        return out


def write_shards(spec: str, out_dir, *, dtype: str = "bfloat16", samples_per_shard: int = 256) -> dict:
    """Write the samples of a synthetic spec as a shard folder in `fluxzero cache`'s format (ShardWriter: one
    latent size per shard, manifest last), so a benchmark reads them through the trainer's shard reader as it
    reads a user's cached images. Returns the manifest."""
    from fluxzero.data.shards import ShardWriter

    source = SyntheticSource(spec)
    writer = ShardWriter(out_dir, samples_per_shard=samples_per_shard, dtype=dtype, extra={"synthetic": spec})
    for i in range(len(source)):
        s = source.get(i)
        writer.add(s["latents"], s["t5"], s["clip"], caption=source.caption(i), reference=s.get("reference"))
    return writer.close()  # the manifest only after every sample: an error above leaves no readable folder
