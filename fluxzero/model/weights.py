"""FLUX.1 weights on disk: reading and writing BFL single files, ComfyUI single files and diffusers folders,
safetensors only. The layouts' names and conversions are fluxzero.model.layouts (re-exported here).

Reading goes tensor by tensor through `safe_open` (memory-mapped): `iter_weights` never holds more than
one BFL tensor and its parts, so ZeRO-3 loaders can place each tensor as it arrives, and nothing is
ever unpickled. Writing goes tensor by tensor too (`save_weights`): each is converted, written, dropped.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from ..config import MODEL_PRESETS, ModelConfig
from ..config.models import KONTEXT_MODEL_INDEX, is_kontext_pipeline
from ..config.user_files import parse_json
from ..fsutil import atomic_file, atomic_folder
from .layouts import (
    _SHOW,
    COMFY_PREFIX,
    DIFFUSERS_INDEX,
    DIFFUSERS_WEIGHTS,
    LAYOUTS,
    MODEL_METADATA,
    WeightsError,
    _combine,
    _diffusers_parts,
    _expected_shapes,
    _part,
    _plan_from_diffusers,
    _raise_if,
    _wrong_shapes,
    infer_config,
)


# ------------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------------
def _safe_open(path, device="cpu"):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device=str(device))
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a corrupt header
        raise WeightsError(
            f"{path}: not a readable safetensors file ({e}); it is truncated or corrupt: download or write it again"
        ) from None


def _diffusers_dir(path: Path) -> Path | None:
    for d in (path / "transformer", path):
        if (d / DIFFUSERS_INDEX).is_file() or (d / DIFFUSERS_WEIGHTS).is_file():
            return d
    return None


def _no_weights_folder(path: Path) -> WeightsError:
    found = sorted(p.relative_to(path) for p in [*path.glob("*.safetensors"), *path.glob("transformer/*.safetensors")])
    hint = (
        f"; it holds {', '.join(map(str, found[:_SHOW]))}: pass a file of those instead"
        if found
        else "; pass a diffusers model folder or a .safetensors file"
    )
    return WeightsError(
        f"{path}: folder holds no {DIFFUSERS_INDEX} or {DIFFUSERS_WEIGHTS} (nor a transformer/ folder with one){hint}"
    )


def _index_files(index: Path) -> dict[str, Path]:
    """Raw key -> shard file, from a diffusers index; every shard is checked to hold what the index says."""
    fix = "fix it or write the folder again"
    try:
        index_json = parse_json(index.read_text())
    except ValueError as e:  # not JSON, not UTF-8
        raise WeightsError(f"{index}: not a valid index file ({e}); {fix}") from None
    weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
    if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
        raise WeightsError(
            f'{index}: not a valid index file (it needs "weight_map": {{tensor name: shard file name}}); {fix}'
        )
    files = {k: index.parent / f for k, f in weight_map.items()}
    absent = sorted({str(f) for f in files.values() if not f.is_file()})
    if absent:
        raise WeightsError(f"{index} names shard files that do not exist: {', '.join(absent[:_SHOW])}; {fix}")
    held = {}
    for f in set(files.values()):
        with _safe_open(f) as h:
            held[f] = set(h.keys())
    wrong = sorted(f"{k} -> {f.name}" for k, f in files.items() if k not in held[f])
    if wrong:
        more = f" (+{len(wrong) - _SHOW} more)" if len(wrong) > _SHOW else ""
        raise WeightsError(
            f"{index}: weight_map names shards that do not hold these tensors: {', '.join(wrong[:_SHOW])}{more}; {fix}"
        )
    return files


def _raw_files(path: str | os.PathLike) -> tuple[str, dict[str, Path]]:
    """(layout, raw key -> file holding it)."""
    path = Path(path)
    if not path.exists():
        raise WeightsError(f"{path}: no such file or folder")
    if path.is_dir():
        d = _diffusers_dir(path)
        if d is None:
            raise _no_weights_folder(path)
        if (d / DIFFUSERS_INDEX).is_file():
            files = _index_files(d / DIFFUSERS_INDEX)
        else:
            with _safe_open(d / DIFFUSERS_WEIGHTS) as f:
                files = {k: d / DIFFUSERS_WEIGHTS for k in f.keys()}
        return "diffusers", files
    if path.suffix != ".safetensors":
        raise WeightsError(f"{path}: only .safetensors weights are read (pickled .pt/.ckpt/.bin files are refused)")
    from .lora_keys import is_lora_file

    if is_lora_file(path):
        raise WeightsError(
            f"{path} is a LoRA file (adapters only), not full model weights; give the base model's "
            "weights here and the LoRA to lora.weights in the run file (or `fluxzero sample --lora`)"
        )
    with _safe_open(path) as f:
        keys = list(f.keys())
    files = {k: path for k in keys}
    if any(k.startswith(COMFY_PREFIX) for k in keys):
        return "comfyui", files
    if "img_in.weight" in keys or any(k.startswith(("double_blocks.", "single_blocks.")) for k in keys):
        return "bfl", files
    if "x_embedder.weight" in keys or any(k.startswith("transformer_blocks.") for k in keys):
        return "diffusers", files
    raise WeightsError(
        f"{path}: cannot tell the layout (keys start like {', '.join(sorted(keys)[:3]) or 'nothing'}); "
        "expected FLUX.1 transformer weights in BFL, ComfyUI or diffusers naming"
    )


class _Source:
    """One weights source seen in BFL names: plan (BFL key -> raw parts, how), shapes without reading data."""

    def __init__(self, path):
        self.path = path
        self.layout, self.files = _raw_files(path)
        if self.layout == "diffusers":
            plan, self.unexpected = _plan_from_diffusers(self.files)
            # Missing parts are reported under their diffusers names; the BFL tensors they feed are dropped.
            self.missing_raw = sorted({p for parts, _ in plan.values() for p in parts} - set(self.files))
            self.plan = {k: v for k, v in plan.items() if all(p in self.files for p in v[0])}
            self.known = set(plan)
            self.ignored = []
        else:
            prefix = COMFY_PREFIX if self.layout == "comfyui" else ""
            self.plan = {k[len(prefix) :]: ([k], "copy") for k in self.files if k.startswith(prefix)}
            # A ComfyUI all-in-one checkpoint also holds the VAE and text encoders under other prefixes:
            # those are not ours to check. Everything in a BFL file must be the transformer's.
            self.unexpected = [] if prefix else sorted(k for k in self.files if not k.startswith(prefix))
            self.ignored = sorted(k for k in self.files if not k.startswith(prefix)) if prefix else []
            self.missing_raw = []
            self.known = set(self.plan)
        self._handles: dict[Path, object] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def _handle(self, file: Path, device="cpu"):
        if (file, device) not in self._handles:
            self._handles[(file, device)] = self._stack.enter_context(_safe_open(file, device))
        return self._handles[(file, device)]

    def shape(self, key: str) -> tuple[int, ...]:
        parts, how = self.plan[key]
        shapes = [tuple(self._handle(self.files[p]).get_slice(p).get_shape()) for p in parts]
        if how == "cat":
            if len({s[1:] for s in shapes}) > 1 or not all(shapes):  # parts that cannot be fused: report them all
                return tuple(shapes)
            return (sum(s[0] for s in shapes), *shapes[0][1:])
        return shapes[0]

    def not_floating(self) -> list[str]:
        """Raw tensors feeding the plan whose dtype is not floating point (F32, BF16, F8_E4M3, ...), with it."""
        dtypes = {
            p: self._handle(self.files[p]).get_slice(p).get_dtype() for parts, _ in self.plan.values() for p in parts
        }
        return sorted(f"{p} ({d})" for p, d in dtypes.items() if not d.startswith(("F", "BF")))

    def read(self, key: str, device="cpu") -> Tensor:
        parts, how = self.plan[key]
        return _combine([self._handle(self.files[p], device).get_tensor(p) for p in parts], how)


def diffusers_axes(path) -> tuple[int, ...] | None:
    """RoPE axes declared by a diffusers folder's config.json, if any."""
    d = Path(path).is_dir() and _diffusers_dir(Path(path))
    try:
        axes = parse_json((d / "config.json").read_text()).get("axes_dims_rope") if d else None
    except (OSError, ValueError, AttributeError):  # no or unreadable config.json: infer from head dim
        return None
    if axes is None:
        return None
    if not (isinstance(axes, list) and axes and all(isinstance(a, int) and a > 0 for a in axes)):
        raise WeightsError(
            f"{d / 'config.json'}: axes_dims_rope must be a list of positive integers such as "
            f"[16, 56, 56], got {axes!r}; fix it or delete the key"
        )
    return tuple(axes)


def declared(path) -> dict:
    """What weights on disk say about their model beyond tensor shapes: {"axes_dim": ...} from a diffusers
    folder's config.json, or name, axes_dim and theta from the ModelConfig fluxzero records in a single
    file's metadata (MODEL_METADATA); {} when they say nothing."""
    path = Path(path)
    if path.is_dir():
        axes = diffusers_axes(path)
        out = {} if axes is None else {"axes_dim": axes}
        root = path.parent if path.name == "transformer" else path
        return {**out, "kontext": True} if is_kontext_pipeline(root) else out
    if path.suffix != ".safetensors" or not path.is_file():
        return {}
    with _safe_open(path) as f:
        text = (f.metadata() or {}).get(MODEL_METADATA)
    if text is None:
        return {}
    try:
        cfg = ModelConfig.from_dict(parse_json(text))
    except ValueError as e:  # also invalid JSON
        raise WeightsError(
            f"{path}: the model recorded in its metadata ({MODEL_METADATA}) is unreadable "
            f"({str(e).splitlines()[0][:200]}); pass --model naming the shape the weights have"
        ) from None
    return {"name": cfg.name, "axes_dim": cfg.axes_dim, "theta": cfg.theta, "kontext": cfg.kontext}


def source_config(path) -> ModelConfig:
    """The ModelConfig of weights on disk: the tensor shapes (read without their data) plus what `declared`
    finds; WeightsError when they describe no model."""
    with _Source(path) as src:
        shapes = {k: src.shape(k) for k in src.plan}
    return _infer_from(path, shapes)


def _infer_from(path, shapes) -> ModelConfig:
    try:
        return infer_config(shapes, **declared(path))
    except WeightsError as e:
        raise WeightsError(f"{path}: {e}") from None


def iter_weights(
    path: str | os.PathLike,
    cfg: ModelConfig | None = None,
    dtype: torch.dtype | None = None,
    keys=None,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[str, Tensor]]:
    """Yield (BFL name, tensor) one tensor at a time, in the model's parameter order.

    The whole file set is checked against `cfg` (inferred from the file when None) before the first
    tensor is read: missing, unexpected or wrong-shape tensors raise one WeightsError. `keys` limits
    what is read (e.g. one ZeRO-3 partition's parameters); `dtype` converts each tensor as it is read.
    """
    with _Source(path) as src:
        shapes = {k: src.shape(k) for k in src.plan}
        if cfg is None:
            cfg = _infer_from(path, shapes)
        expected = _expected_shapes(cfg)
        missing = src.missing_raw + sorted(set(expected) - src.known)
        unexpected = src.unexpected + sorted(set(shapes) - set(expected))
        _raise_if(missing, unexpected, _wrong_shapes(shapes, expected), src.layout, path, src.not_floating())
        wanted = list(expected) if keys is None else [k for k in expected if k in set(keys)]
        if keys is not None and len(wanted) != len(set(keys)):
            _raise_if([], sorted(set(keys) - set(expected)), [], src.layout, path)
        for key in wanted:
            t = src.read(key, device)
            yield key, t if dtype is None else t.to(dtype)


def ignored_tensors(path: str | os.PathLike) -> list[str]:
    """Tensors of `path` that are not the transformer's and that loading it leaves out: a ComfyUI all-in-one
    checkpoint's VAE and text encoders (every other layout refuses a tensor it cannot place)."""
    with _Source(path) as src:
        return src.ignored


def load_weights(
    path: str | os.PathLike,
    cfg: ModelConfig | None = None,
    dtype: torch.dtype | None = None,
    keys=None,
    device: str | torch.device = "cpu",
) -> dict[str, Tensor]:
    """BFL-named state dict from any layout (auto-detected); see `iter_weights` for the checks."""
    return dict(iter_weights(path, cfg=cfg, dtype=dtype, keys=keys, device=device))


def load_model(path, cfg: ModelConfig | None = None, dtype: torch.dtype = torch.bfloat16, device="cpu"):
    """A Flux holding the file's weights: built on meta, tensors assigned, so 12B never exists twice."""
    from .flux import build_model

    sd = load_weights(path, cfg=cfg, dtype=dtype, device=device)
    if cfg is None:
        cfg = _infer_from(path, {k: tuple(v.shape) for k, v in sd.items()})
    model = build_model(cfg, device="meta", dtype=dtype)
    model.load_state_dict(sd, strict=True, assign=True)
    return model


def diffusers_config(cfg: ModelConfig, path: Path) -> dict:
    """The config.json of diffusers' FluxTransformer2DModel for `cfg`; WeightsError (naming `path`, the file to be
    written) for a model diffusers cannot hold."""
    if cfg.mlp_ratio != 4.0 or not cfg.qkv_bias:
        raise WeightsError(
            f"{path} not written: diffusers' FluxTransformer2DModel needs mlp_ratio 4 and qkv_bias, "
            f"model {cfg.name!r} has {cfg.mlp_ratio} and {cfg.qkv_bias}; write the bfl or comfyui "
            "layout instead"
        )
    return {
        "_class_name": "FluxTransformer2DModel",
        "patch_size": 1,
        "in_channels": cfg.in_channels,
        "out_channels": cfg.out_channels,
        "num_layers": cfg.depth,
        "num_single_layers": cfg.depth_single_blocks,
        "attention_head_dim": cfg.head_dim,
        "num_attention_heads": cfg.num_heads,
        "joint_attention_dim": cfg.context_in_dim,
        "pooled_projection_dim": cfg.vec_in_dim,
        "guidance_embeds": cfg.guidance_embed,
        "axes_dims_rope": list(cfg.axes_dim),
    }


def save_weights(
    state_dict: dict[str, Tensor],
    path: str | os.PathLike,
    layout: str = "bfl",
    dtype: torch.dtype | None = None,
    cfg: ModelConfig | None = None,
    max_shard_bytes: int = 10 * 2**30,
) -> None:
    """Write a BFL-named state dict as a BFL or ComfyUI .safetensors file, or a diffusers transformer folder.

    diffusers: `path` is the folder; weights above `max_shard_bytes` are sharded with an index JSON, and a
    config.json lets `FluxTransformer2DModel.from_pretrained(path)` load it. A FLUX.1 Kontext model's folder is
    FluxKontextPipeline's instead: model_index.json naming the pipeline, the transformer in `path`/transformer/
    (the other components are the base pipeline's, passed to from_pretrained or copied in beside it).
    Streams one tensor at a time (`_write_safetensors`): a tensor is copied (dtype, device, the final layer's
    swapped halves) only while it is written; split parts are views of the fused tensor. So the memory on top
    of `state_dict` is about its largest converted tensor, also for a single-file bf16 export of fp32 weights.
    """
    if layout not in LAYOUTS:
        raise WeightsError(f"unknown layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    path = Path(path)
    cfg = _check_state(state_dict, cfg, path)
    meta = {"format": "pt"}
    if layout != "diffusers":
        prefix = COMFY_PREFIX if layout == "comfyui" else ""
        # a preset's file stays plain; Kontext's is recorded, its tensors being FLUX.1-dev's
        if cfg.kontext or not any(p.same_shape(cfg) for p in MODEL_PRESETS.values()):
            meta[MODEL_METADATA] = json.dumps(cfg.to_dict(), separators=(",", ":"))
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_safetensors(path, [_Out.of(prefix + k, v, "copy", None, dtype) for k, v in state_dict.items()], meta)
        return
    config = diffusers_config(cfg, path)  # before anything is written: a model diffusers cannot hold is refused
    shards = _shards(
        [
            _Out.of(name, state_dict[key], how, rows, dtype)
            for key in state_dict
            for name, how, rows in _diffusers_parts(key, state_dict[key].shape[0], cfg.hidden_size)
        ],
        max_shard_bytes,
    )
    _check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = len(shards)
    files = (
        [DIFFUSERS_WEIGHTS]
        if n == 1
        else [f"diffusion_pytorch_model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    # written beside `path` and swapped in whole: a failure or a kill midway leaves an existing folder as it was
    with atomic_folder(path) as tmp:
        tmp = Path(tmp)
        if cfg.kontext:  # diffusers tells Kontext from the pipeline's model_index.json alone
            (tmp / "model_index.json").write_text(json.dumps(KONTEXT_MODEL_INDEX, indent=2) + "\n")
            tmp = tmp / "transformer"
            tmp.mkdir()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for file, shard in zip(files, shards):
            _write_safetensors(tmp / file, shard, meta)
        if n > 1:
            weight_map = {out.name: file for file, shard in zip(files, shards) for out in shard}
            index = {
                "metadata": {"total_size": sum(out.nbytes for shard in shards for out in shard)},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (tmp / DIFFUSERS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _check_replaceable(path: Path) -> None:
    """Refuse to replace `path` by a diffusers folder unless it is absent or one itself (a diffusers transformer
    folder, a Kontext export's model_index.json and transformer/ folder, or what a killed write of one left): the
    whole folder is replaced, so nothing else may be in it."""
    if not path.exists():
        return
    if not path.is_dir():
        raise WeightsError(f"{path} not written: it is a file, and a diffusers export is a folder; choose another path")
    kontext = (path / "transformer").is_dir()
    other = _not_transformer_files(path, "model_index.json", *(["transformer"] if kontext else []))
    if kontext:
        other += [f"transformer/{n}" for n in _not_transformer_files(path / "transformer")]
    if other:
        more = f" (and {len(other) - 1} more)" if len(other) > 1 else ""
        raise WeightsError(
            f"{path} not written: it holds {other[0]}{more}, which is not part of a diffusers "
            f"transformer folder, and the whole folder would be replaced; choose a new or empty folder"
        )


def _not_transformer_files(folder: Path, *also: str) -> list[str]:
    """The names in `folder` that a diffusers transformer folder (or a killed write of one) does not hold."""
    return sorted(
        n
        for n in os.listdir(folder)
        if not (
            n in ("config.json", DIFFUSERS_INDEX, *also)
            or re.fullmatch(r"diffusion_pytorch_model.*\.safetensors|\..+\.tmp-\d+", n)
        )
    )


class _Out(NamedTuple):
    """One tensor of an output file, known by name, dtype and shape before it exists; `make()` builds it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], Tensor]

    @classmethod
    def of(cls, name: str, t: Tensor, how: str, rows: tuple[int, int] | None, dtype) -> _Out:
        """`_part(t, how, rows, dtype)` on the CPU, described from `t`'s shape alone (nothing is copied yet)."""
        shape = (rows[1], *t.shape[1:]) if rows else tuple(t.shape)
        return cls(name, dtype or t.dtype, shape, partial(_part, t, how, rows, dtype, "cpu"))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _shards(outs: list[_Out], max_shard_bytes: int) -> list[list[_Out]]:
    """Consecutive runs of `outs`, each at most max_shard_bytes (or one tensor)."""
    shards, size = [[]], 0
    for out in outs:
        if shards[-1] and size + out.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(out)
        size += out.nbytes
    return shards


# safetensors' dtype names in the order of its Dtype enum: its writer lays tensors out by this order, last
# first (widest first, so every tensor is aligned to its element size), then by name. Following it makes our
# files byte-identical to safetensors.torch.save_file's.
_ST_DTYPES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
}
_ST_RANK = {d: i for i, d in enumerate(_ST_DTYPES)}


def _write_safetensors(path: Path, outs: list[_Out], metadata: dict[str, str]) -> None:
    """Write a .safetensors file one tensor at a time: memory on top of the inputs is about one tensor.

    Format: 8-byte little-endian header length N, N bytes of JSON header (space-padded so the data starts
    8-byte aligned), then each tensor's raw bytes in header order. Bytes are written as the CPU holds them,
    i.e. little-endian (torch's platforms are). The file is written beside `path` and renamed over it only
    when complete, with the usual mode 0666 minus the umask (safetensors' own writer leaves 0600), or the mode
    of the file it replaces (a user's chmod stays). The header is in a fixed order (metadata keys sorted,
    tensors as below), so the same tensors and metadata always give the same bytes.
    """
    odd = sorted({str(o.dtype) for o in outs if o.dtype not in _ST_DTYPES})
    if odd:
        raise WeightsError(
            f"{path} not written: tensors of dtype {', '.join(odd)} cannot be written; "
            "convert them to bf16, fp16 or fp32 first"
        )
    outs = sorted(outs, key=lambda o: (-_ST_RANK[o.dtype], o.name))
    tensors, offset = {}, 0
    for o in outs:
        tensors[o.name] = {
            "dtype": _ST_DTYPES[o.dtype],
            "shape": list(o.shape),
            "data_offsets": [offset, offset + o.nbytes],
        }
        offset += o.nbytes
    if len(tensors) != len(outs):
        raise ValueError(f"{path}: duplicate tensor names")
    header = {"__metadata__": dict(sorted(metadata.items())), **tensors} if metadata else tensors
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_file(path) as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for o in outs:
            t = o.make()
            if (t.dtype, tuple(t.shape), t.device.type) != (o.dtype, o.shape, "cpu") or not t.is_contiguous():
                raise RuntimeError(
                    f"{o.name}: made {t.dtype} {tuple(t.shape)} on {t.device}, "
                    f"planned {o.dtype} {o.shape} contiguous on the CPU"
                )
            f.write(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes: no copy
            del t  # before the next one is made


def save_tensors(path: str | os.PathLike, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> None:
    """Any small fluxzero .safetensors file (LoRA files, prompt embeddings) through the writer above: the same
    bytes for the same input, the usual permissions, and nothing but the old file or the new one on disk."""
    _write_safetensors(Path(path), [_Out.of(k, v, "copy", None, None) for k, v in tensors.items()], metadata or {})


def _check_state(state_dict, cfg: ModelConfig | None, path: Path) -> ModelConfig:
    """The config a state dict to save matches (inferred when None); WeightsError when it does not."""
    shapes = {k: tuple(v.shape) for k, v in state_dict.items()}
    try:
        cfg = cfg or infer_config(shapes)
    except WeightsError as e:
        raise WeightsError(f"{path} not written: {e}") from None
    expected = _expected_shapes(cfg)
    _raise_if(
        sorted(set(expected) - set(shapes)),
        sorted(set(shapes) - set(expected)),
        _wrong_shapes(shapes, expected),
        "bfl",
        f"{path} not written",
        [f"{k} ({v.dtype})" for k, v in state_dict.items() if not v.is_floating_point()],
    )
    return cfg
