"""Cached-latent training data: shard format, writer, reader, distributed loader, synthetic source.

`from fluxzero.data import build_dataloader, DataError`. Attributes are imported lazily so that the pure
helpers (`fluxzero.data.errors`, `fluxzero.data.buckets`) stay usable without importing torch.
"""

from __future__ import annotations

import importlib

from fluxzero.data.errors import DataError

_LAZY = {
    "build_dataloader": "fluxzero.data.loader",
    "ShardLoader": "fluxzero.data.loader",
    "check_model_fit": "fluxzero.data.loader",
    "ShardWriter": "fluxzero.data.shards",
    "read_manifest": "fluxzero.data.shards",
    "verify_shards": "fluxzero.data.shards",
    "FORMAT_VERSION": "fluxzero.data.shards",
}

__all__ = ["DataError", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fluxzero.data' has no attribute {name!r}")
