"""Synthetic source: `"synthetic:n=64,hw=32x32,txt=16,ctx=64,vec=32"`, deterministic per sample index.

Keys (all optional): n (samples, 64), hw (LATENT h x w, several joined by '+', e.g. 32x32+32x48; sample i
gets size i mod the number of sizes, 32x32), txt (T5 tokens, 16), ctx (T5 width, 64), vec (CLIP width, 32),
ch (latent channels, 16), seed (data seed, 0). Sample i depends only on (seed, i), never on rank or order.
"""
from __future__ import annotations

from fluxzero.data.errors import DataError

PREFIX = "synthetic:"
_DEFAULTS = {"n": 64, "hw": "32x32", "txt": 16, "ctx": 64, "vec": 32, "ch": 16, "seed": 0}
_EXAMPLE = "'synthetic:n=64,hw=32x32,txt=16,ctx=64,vec=32'"


def is_synthetic(source) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def parse_spec(spec: str) -> dict:
    opts = dict(_DEFAULTS)
    body = spec[len(PREFIX):].strip()
    for part in filter(None, (p.strip() for p in body.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in _DEFAULTS:
            raise DataError(f"synthetic spec {spec!r}: unknown item {part!r}; use keys {', '.join(_DEFAULTS)} as in {_EXAMPLE}.")
        opts[key] = value.strip()
    sizes = []
    for s in str(opts["hw"]).split("+"):
        h, x, w = s.strip().lower().partition("x")
        if not (x and h.isdigit() and w.isdigit() and int(h) > 0 and int(w) > 0):
            raise DataError(f"synthetic spec {spec!r}: hw must be latent sizes like 32x32 or 32x32+32x48, got {opts['hw']!r}.")
        sizes.append((int(h), int(w)))
    out = {"sizes": sizes}
    for key in ("n", "txt", "ctx", "vec", "ch", "seed"):
        try:
            out[key] = int(opts[key])
        except ValueError:
            raise DataError(f"synthetic spec {spec!r}: {key} must be an integer, got {opts[key]!r}.") from None
        if key != "seed" and out[key] < 1:
            raise DataError(f"synthetic spec {spec!r}: {key} must be >= 1, got {out[key]}.")
    return out


class SyntheticSource:
    """Random tensors generated from (seed, index): identical on every rank and in every worker."""

    def __init__(self, spec: str):
        self.spec = spec
        o = parse_spec(spec)
        self.sizes, self.num_samples, self.seed = o["sizes"], o["n"], o["seed"]
        self.dims = {"latent_channels": o["ch"], "t5_len": o["txt"], "t5_dim": o["ctx"], "clip_dim": o["vec"]}

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
        """Shape: {"latents": (C,h,w), "t5": (L,D), "clip": (V,), "index": int}, all float32."""
        import torch

        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample index {i} out of range [0, {self.num_samples})")
        h, w = self.sizes[i % len(self.sizes)]
        d = self.dims
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return {
            "latents": torch.randn(d["latent_channels"], h, w, generator=g),
            "t5": torch.randn(d["t5_len"], d["t5_dim"], generator=g),
            "clip": torch.randn(d["clip_dim"], generator=g),
            "index": i,
        }
