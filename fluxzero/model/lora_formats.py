"""LoRA files: write and read the diffusers/PEFT and kohya/ComfyUI safetensors layouts; merge a LoRA into weights.

  diffusers  `transformer.<diffusers module>.lora_A.weight` / `.lora_B.weight`, what
             FluxTransformer2DModel.load_lora_adapter and FluxPipeline.load_lora_weights load. Our fused
             linears are split like the weights (weights.py): qkv -> to_q/to_k/to_v (add_q_proj/.. for txt),
             linear1 -> to_q/to_k/to_v/proj_mlp. A LoRA on a fused linear, A (r, C) and B (rows, r), becomes
             one LoRA per part sharing A, B split by rows (exact: (B A)[rows] = B[rows] A). The scale
             alpha / rank is folded into B and the file declares alpha = rank (scale 1) in diffusers' own
             `lora_adapter_metadata` header entry, with no `.alpha` tensors: every reader then applies the
             trained strength, whether it reads that entry (diffusers' FluxPipeline.load_lora_weights), reads
             the tensors alone (Nunchaku's converter, ComfyUI: B A at scale 1 without `.alpha`), or gets both
             (diffusers refuses a file with `.alpha` tensors and the entry). B rather than A, or sqrt of the
             scale in each: A stays the trained A bit for bit, B is rounded once (exact when alpha / rank is a
             power of two: alpha = rank, rank / 2, 2 x rank, 1 at rank 16, ...), and the fluxzero.* entries
             still say the trained alpha, so reading the file back gives the trained adapters.
  kohya      `lora_unet_<BFL module, dots as underscores>.lora_down.weight` / `.lora_up.weight` / `.alpha`,
             BFL's fused names (ComfyUI, sd-scripts, and diffusers' kohya converter read it).
Both carry fluxzero.* header entries: layout, rank, alpha, targets, base model.

Reading accepts either layout (and our canonical names) and returns canonical tensors whose scale is the
file's alpha / rank; per-module alphas that differ are folded into B. The tensors' own scale is the one
the file's consumers apply: a module's `.alpha` / rank, else diffusers' entry (lora_alpha / r), else the
declared alpha / rank. Whatever a file holds that no trainer writes (a header entry that does not parse,
an `.alpha` of several values, non-finite or integer tensors) is refused in one sentence naming the file. A diffusers LoRA whose parts of one
fused linear have different A matrices (trained with diffusers' separate projections) becomes one LoRA of
rank sum(r_i) on the fused linear: A = [A_q; A_k; A_v], B block-diagonal (exact; missing parts get zero
rows). Such a file merges exactly but loads into adapters only of that rank.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from ..config.lora import LoraConfig
from ..config.user_files import parse_json
from .layouts import diffusers_names, split_sizes, swap_halves
from .lora_keys import _LORA_KEY, LoraError, _looks_full

LAYOUTS = ("diffusers", "kohya")
KOHYA_PREFIX = "lora_unet_"
DIFFUSERS_PREFIX = "transformer."
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY
_BLOCK = re.compile(r"^(double_blocks|single_blocks)\.(\d+)\.(.+)$")
_DBLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")
_KBLOCK = re.compile(r"^(double_blocks|single_blocks)_(\d+)_(.+)$")


@dataclass(frozen=True)
class LoraFileInfo:
    """What a LoRA file says about itself. `alpha / rank` is the scale of the tensors read_lora returns."""

    layout: str
    rank: int
    alpha: float
    modules: tuple[str, ...]  # our module names, in file order
    targets: str | list[str] | None = None  # as written by fluxzero (preset name or patterns), else None
    base_model: str | None = None


# ------------------------------------------------------------------------------------------------------
# Module names: ours (BFL) <-> diffusers, from weights.py's tables over our own module tree
# ------------------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _module_names() -> dict[str, list[str]]:
    """Linear module names of each kind: "double" / "single" (inside block N, without the prefix), "top"."""
    from .flux import build_model
    from .lora_keys import _linear_names

    names = _linear_names(build_model("flux-tiny", device="meta"))
    out = {"double": [], "single": [], "top": []}
    for n in names:
        m = _BLOCK.match(n)
        kind, inner = ("double" if m.group(1) == "double_blocks" else "single", m.group(3)) if m else ("top", n)
        if inner not in out[kind]:
            out[kind].append(inner)
    return out


def _diffusers_modules(module: str) -> tuple[list[str], str]:
    """Diffusers module names our module becomes and how: "copy", "cat" (row parts) or "swap" (halves)."""
    try:
        names, how = diffusers_names(module + ".weight")
    except KeyError:
        raise LoraError(f"module {module} has no diffusers counterpart; write the kohya layout instead") from None
    return [n.removesuffix(".weight") for n in names], how


@lru_cache(maxsize=1)
def _from_diffusers_table() -> dict[tuple[str, str], tuple[str, int, int]]:
    """(diffusers kind, inner diffusers name) -> (our inner name, part index, part count)."""
    table = {}
    for kind, prefix in (("double", "double_blocks.0."), ("single", "single_blocks.0."), ("top", "")):
        for inner in _module_names()[kind]:
            names, _ = _diffusers_modules(prefix + inner)
            for i, name in enumerate(names):
                m = _DBLOCK.match(name)
                table[(kind, m.group(3) if m else name)] = (inner, i, len(names))
    return table


# ------------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------------
def _modules(sd: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """module -> (A, B) of a canonical LoRA state dict, checked for pairs and matching ranks."""
    full = _looks_full(sd)
    if full:
        raise LoraError(f"tensor {full[0]} is a model weight, not a LoRA tensor; pass lora_state_dict(model)")
    out = {}
    for k in sd:
        m = _LORA_KEY.match(k)
        if m is None:
            raise LoraError(f"tensor {k} is not a LoRA tensor (<module>.lora_A.weight / .lora_B.weight)")
        module = m.group(1)
        if module in out:
            continue
        A, B = sd.get(f"{module}.lora_A.weight"), sd.get(f"{module}.lora_B.weight")
        if A is None or B is None:
            raise LoraError(f"module {module} has only one of lora_A / lora_B; a LoRA needs both")
        if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[1]:
            raise LoraError(
                f"module {module}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} do not form a "
                "LoRA (A is rank x in, B is out x rank)"
            )
        out[module] = (A, B)
    return out


def _metadata(cfg: LoraConfig, layout: str, base_model: str | None) -> dict[str, str]:
    return {
        "format": "pt",
        "fluxzero.format": layout,
        "fluxzero.rank": str(cfg.rank),
        "fluxzero.alpha": repr(cfg.alpha),
        "fluxzero.targets": json.dumps(cfg.targets),
        "fluxzero.base_model": base_model or "",
    }


def to_diffusers(sd: dict[str, Tensor], cfg: LoraConfig) -> tuple[dict[str, Tensor], dict]:
    """(diffusers-named tensors with the `transformer.` prefix, diffusers' adapter metadata for them).

    B carries the scale (B x alpha / rank, in fp32, rounded once to B's dtype) and the metadata says
    alpha = rank: the tensors alone are the delta, as every reader applies them (see the module docstring).
    """
    out, ranks = {}, {}
    for module, (A, B) in _modules(sd).items():
        B = _scale_b(B.detach(), cfg.scale)
        names, how = _diffusers_modules(module)
        if how == "cat":
            rows = split_sizes(module, B.shape[0], A.shape[1])
            parts = B.split(rows, dim=0)
        else:
            parts = [swap_halves(B) if how == "swap" else B]
        for name, b in zip(names, parts):
            out[f"{DIFFUSERS_PREFIX}{name}.lora_A.weight"] = A.detach().clone()
            out[f"{DIFFUSERS_PREFIX}{name}.lora_B.weight"] = b.detach().contiguous().clone()
            ranks[name] = A.shape[0]
    meta = {"r": cfg.rank, "lora_alpha": cfg.rank, "target_modules": sorted(ranks)}
    odd = {n: r for n, r in ranks.items() if r != cfg.rank}
    if odd:  # modules of another rank keep scale 1 too: PEFT scales each by alpha_m / r_m
        meta["rank_pattern"] = odd
        meta["alpha_pattern"] = dict(odd)
    return out, {f"{DIFFUSERS_PREFIX}{k}": v for k, v in meta.items()}


def to_kohya(sd: dict[str, Tensor], cfg: LoraConfig) -> dict[str, Tensor]:
    """kohya-named tensors: lora_down = A, lora_up = B, alpha = scale x module rank (= cfg.alpha at cfg.rank)."""
    out = {}
    for module, (A, B) in _modules(sd).items():
        key = KOHYA_PREFIX + module.replace(".", "_")
        out[f"{key}.lora_down.weight"] = A.detach().clone()
        out[f"{key}.lora_up.weight"] = B.detach().clone()
        out[f"{key}.alpha"] = torch.tensor(float(cfg.scale * A.shape[0]))
    return out


def save_lora(
    path: str | os.PathLike,
    sd: dict[str, Tensor],
    cfg: LoraConfig,
    layout: str = "diffusers",
    base_model: str | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write a canonical LoRA state dict (lora_state_dict(model)) as a .safetensors file in `layout`.

    `base_model` (e.g. "flux-dev") goes into the header; `dtype` converts the A/B tensors (alphas stay fp32).
    Written by weights.save_tensors: the same LoRA always gives the same bytes, with the usual permissions
    (or those of the file it replaces), through a temp file beside `path` that a later export removes if
    this one is killed.
    """
    if layout not in LAYOUTS:
        raise LoraError(f"unknown LoRA layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    meta = _metadata(cfg, layout, base_model)
    if layout == "diffusers":
        tensors, adapter_meta = to_diffusers(sd, cfg)
        meta[DIFFUSERS_METADATA_KEY] = json.dumps(adapter_meta, sort_keys=True)
    else:
        tensors = to_kohya(sd, cfg)
        meta.update(
            {
                "ss_network_module": "networks.lora_flux",
                "ss_network_dim": str(cfg.rank),
                "ss_network_alpha": repr(cfg.alpha),
                "ss_base_model_version": "flux1",
            }
        )
    if dtype is not None:
        tensors = {k: v if k.endswith(".alpha") else v.to(dtype) for k, v in tensors.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from .weights import save_tensors

    save_tensors(path, tensors, meta)


# ------------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------------
def _open(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    from safetensors import safe_open

    if not path.is_file():
        raise LoraError(f"{path}: no such LoRA file")
    if path.suffix != ".safetensors":
        raise LoraError(f"{path}: only .safetensors LoRA files are read (pickled files are refused)")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a corrupt header
        raise LoraError(f"{path}: not a readable safetensors file ({e}); write or download it again") from None
    for key, t in raw.items():
        problem = _value_problem(key, t)
        if problem:
            raise LoraError(f"{path}: {problem}; this LoRA file is damaged, write or download it again")
    return raw, meta


_LORA_TENSOR = (".lora_A.weight", ".lora_B.weight", ".lora_down.weight", ".lora_up.weight")


def _value_problem(key: str, t: Tensor) -> str | None:
    """What is wrong with one tensor of a LoRA file, or None: an A / B that is not floating point or not
    finite (it would train from NaN or sample black images, an integer one would be truncated), an alpha
    that is not one finite positive number."""
    if key.endswith(".alpha"):
        if t.numel() != 1:
            return f"{key} holds {t.numel()} values, but an alpha is one number"
        if t.dtype == torch.bool or t.is_complex():
            return f"{key} holds {str(t.dtype).replace('torch.', '')} values, but an alpha is a real number"
        value = float(t.reshape(()).float())
        if not math.isfinite(value) or value <= 0:
            return f"{key} is {value}, but an alpha is a finite number above 0"
        return None
    if not key.endswith(_LORA_TENSOR):
        return None
    if not t.is_floating_point():
        return (
            f"{key} holds {str(t.dtype).replace('torch.', '')} values, but LoRA tensors are floating point "
            "(fp32, bf16 or fp16)"
        )
    if not bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all()):  # fp8: isfinite needs a cast
        return f"{key} holds NaN or infinite values"
    return None


def _scale_b(B: Tensor, factor: float) -> Tensor:
    return B if factor == 1.0 else (B.float() * factor).to(B.dtype)


def kohya_module(base: str) -> str | None:
    """Our module name of a kohya key base (`lora_unet_double_blocks_0_img_attn_qkv` ->
    `double_blocks.0.img_attn.qkv`); None when it names no FLUX.1 transformer linear."""
    names = _module_names()
    lookup = {kind: {n.replace(".", "_"): n for n in names[kind]} for kind in names}
    flat = base.removeprefix(KOHYA_PREFIX)
    m = _KBLOCK.match(flat)
    kind, index, inner = (
        (("double" if m.group(1) == "double_blocks" else "single"), m.group(2), m.group(3)) if m else ("top", "", flat)
    )
    if not base.startswith(KOHYA_PREFIX) or inner not in lookup[kind]:
        return None
    return f"{m.group(1)}.{index}.{lookup[kind][inner]}" if m else lookup[kind][inner]


def diffusers_module(name: str) -> tuple[str, int, int] | None:
    """(our module, part index, part count) of a diffusers FluxTransformer2DModel linear, by its dotted name
    (`transformer_blocks.0.attn.to_k` -> (`double_blocks.0.img_attn.qkv`, 1, 3)); None for another name."""
    m = _DBLOCK.match(name)
    kind, index, inner = (
        (("double" if m.group(1) == "transformer_blocks" else "single"), m.group(2), m.group(3))
        if m
        else ("top", "", name)
    )
    hit = _from_diffusers_table().get((kind, inner))
    if hit is None:
        return None
    ours, part, n = hit
    return (f"{'double_blocks' if kind == 'double' else 'single_blocks'}.{index}.{ours}" if m else ours), part, n


def _from_kohya(raw: dict[str, Tensor]) -> tuple[dict[str, tuple[Tensor, Tensor, float | None]], list[str]]:
    """module -> (A, B, alpha or None), plus skipped (text-encoder) keys."""
    out, skipped = {}, []
    for key in raw:
        if not key.endswith(".lora_down.weight"):
            continue
        base = key.removesuffix(".lora_down.weight")
        if base.startswith("lora_te"):
            skipped.append(base)
            continue
        module = kohya_module(base)
        if module is None:
            raise LoraError(
                f"kohya key {base} names no FLUX.1 transformer linear (expected e.g. "
                "lora_unet_double_blocks_0_img_attn_qkv); this is not a FLUX.1 LoRA"
            )
        up = raw.get(f"{base}.lora_up.weight")
        if up is None:
            raise LoraError(f"kohya LoRA {base} has lora_down but no lora_up; the file is incomplete")
        alpha = raw.get(f"{base}.alpha")
        out[module] = (raw[key], up, None if alpha is None else float(alpha.item()))
    return out, skipped


def _fuse(module: str, parts: dict[int, tuple[Tensor, Tensor]], n: int) -> tuple[Tensor, Tensor]:
    """One LoRA on a fused linear from LoRAs on some of its n row parts (see the module docstring)."""
    A0 = next(iter(parts.values()))[0]
    hidden = A0.shape[1]
    if module.endswith(".linear1") and 3 not in parts:
        mlp = 4 * hidden  # diffusers' FLUX has mlp_ratio 4
    else:
        mlp = parts[3][1].shape[0] if module.endswith(".linear1") else hidden
    rows = [hidden, hidden, hidden, mlp][:n] if module.endswith(".linear1") else [hidden] * 3
    As = [parts[i][0] for i in sorted(parts)]
    if all(a.shape == A0.shape and torch.equal(a, A0) for a in As):  # shared A (our own export, kohya's)
        Bs = [parts[i][1] if i in parts else A0.new_zeros(rows[i], A0.shape[0]) for i in range(n)]
        return A0, torch.cat(Bs, dim=0)
    A = torch.cat(As, dim=0)
    B = A0.new_zeros(sum(rows), A.shape[0])
    col = 0
    for i in sorted(parts):
        a, b = parts[i]
        start = sum(rows[:i])
        B[start : start + rows[i], col : col + a.shape[0]] = b
        col += a.shape[0]
    return A, B


def _from_diffusers(raw: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor, float | None]]:
    found: dict[str, dict[int, tuple[Tensor, Tensor, float | None]]] = {}
    counts: dict[str, int] = {}
    for key in raw:
        if not key.endswith(".lora_A.weight"):
            continue
        base = key.removesuffix(".lora_A.weight")
        if not base.startswith(DIFFUSERS_PREFIX) and base.split(".")[0] in ("text_encoder", "text_encoder_2"):
            continue  # another pipeline component's LoRA
        hit = diffusers_module(base.removeprefix(DIFFUSERS_PREFIX))
        if hit is None:
            raise LoraError(
                f"diffusers LoRA key {base} names no FluxTransformer2DModel linear (expected e.g. "
                "transformer.transformer_blocks.0.attn.to_q); this is not a FLUX.1 transformer LoRA"
            )
        module, part, n = hit
        B = raw.get(f"{base}.lora_B.weight")
        if B is None:
            raise LoraError(f"diffusers LoRA {base} has lora_A but no lora_B; the file is incomplete")
        alpha = raw.get(f"{base}.alpha")
        found.setdefault(module, {})[part] = (raw[key], B, None if alpha is None else float(alpha.item()))
        counts[module] = n
    out = {}
    for module, parts in found.items():
        n = counts[module]
        if n == 1:
            A, B, alpha = parts[0]
            _, how = _diffusers_modules(module)
            out[module] = (A, swap_halves(B) if how == "swap" else B, alpha)
            continue
        alphas = {a for _, _, a in parts.values()}
        if len(alphas) > 1:
            raise LoraError(
                f"diffusers LoRA parts of {module} have different alphas {sorted(map(str, alphas))}; "
                "this reader needs one alpha per fused linear"
            )
        A, B = _fuse(module, {i: (a, b) for i, (a, b, _) in parts.items()}, n)
        out[module] = (A, B, alphas.pop())
    return out


def _header_number(path: Path, name: str, text, whole: bool) -> float:
    """A rank (whole) or alpha from a header entry, checked: positive and finite, else LoraError."""
    try:
        value = float(text) if not isinstance(text, bool) else math.nan
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value <= 0 or (whole and value != int(value)):
        kind = "a whole number of at least 1" if whole else "a finite number above 0"
        raise LoraError(
            f"{path}: header entry {name} is {text!r}, not {kind}; this LoRA file is damaged, write "
            "or download it again"
        )
    return int(value) if whole else value


def _adapter_metadata(path: Path, meta: dict[str, str]) -> dict | None:
    """diffusers' lora_adapter_metadata entry as a mapping (None when absent), else LoraError."""
    text = meta.get(DIFFUSERS_METADATA_KEY)
    if not text:
        return None
    try:
        am = parse_json(text)
    except ValueError:
        am = None
    if not isinstance(am, dict):
        raise LoraError(
            f"{path}: header entry {DIFFUSERS_METADATA_KEY} is not a JSON mapping of PEFT settings; "
            "this LoRA file is damaged, write or download it again"
        )
    return am


def _header_scale(path: Path, meta: dict[str, str], layout: str, ranks: list[int], alphas: list[float | None]):
    """(rank, alpha, tensor scale): the rank and alpha the file declares (ours, else diffusers' adapter metadata
    or kohya's ss_*, else module 0's), and the scale its tensors are at where no module `.alpha` says: what
    diffusers applies, lora_alpha / r of its entry, for a diffusers file that has one (ours fold the trained
    scale into B and declare 1), else the declared alpha / rank."""
    am = _adapter_metadata(path, meta) if layout == "diffusers" else None
    tensor_scale = None
    if am is not None:
        r = am.get(f"{DIFFUSERS_PREFIX}r", am.get("r"))
        if r is not None:
            r = _header_number(path, f"{DIFFUSERS_METADATA_KEY} r", r, whole=True)
            a = am.get(f"{DIFFUSERS_PREFIX}lora_alpha", am.get("lora_alpha"))
            a = r if a is None else _header_number(path, f"{DIFFUSERS_METADATA_KEY} lora_alpha", a, whole=False)
            tensor_scale = a / r
    if "fluxzero.rank" in meta and "fluxzero.alpha" in meta:
        rank = _header_number(path, "fluxzero.rank", meta["fluxzero.rank"], whole=True)
        alpha = _header_number(path, "fluxzero.alpha", meta["fluxzero.alpha"], whole=False)
    elif tensor_scale is not None:
        rank, alpha = r, a
    elif layout == "kohya" and _kohya_header(meta):
        rank, alpha = _kohya_header(meta)
    else:
        rank = Counter(ranks).most_common(1)[0][0] if ranks else 1
        first = next((a for r, a in zip(ranks, alphas) if r == rank and a is not None), None)
        alpha = float(first if first is not None else rank)
    return rank, alpha, alpha / rank if tensor_scale is None else tensor_scale


def _kohya_header(meta: dict[str, str]) -> tuple[int, float] | None:
    """(rank, alpha) of sd-scripts' ss_network_dim / ss_network_alpha entries; None when absent or unreadable
    (other trainers fill them loosely: the tensors then say)."""
    try:
        rank = int(meta.get("ss_network_dim", ""))
        alpha = float(meta.get("ss_network_alpha") or rank)
    except ValueError:
        return None
    return (rank, alpha) if rank > 0 and math.isfinite(alpha) and alpha > 0 else None


def _targets(path: Path, meta: dict[str, str]):
    """The fluxzero.targets entry: a preset name or a list of patterns (None when absent), else LoraError."""
    text = meta.get("fluxzero.targets")
    if not text:
        return None
    try:
        targets = parse_json(text)
    except ValueError:
        targets = None
    if not (isinstance(targets, str) or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        raise LoraError(
            f"{path}: header entry fluxzero.targets is {text[:80]!r}, not JSON naming a target preset "
            "or a list of module patterns; this LoRA file is damaged, write or download it again"
        )
    return targets


def read_lora(path: str | os.PathLike, scale: float | None = None) -> tuple[dict[str, Tensor], LoraFileInfo]:
    """Canonical LoRA tensors (our module names) and what the file says, from a diffusers or kohya file.

    The tensors' scale is info.alpha / info.rank; with `scale`, B is rescaled so that scale x B A is the
    file's delta. Text-encoder LoRAs in the same file are left out. A full-weights file is refused.
    """
    path = Path(path)
    raw, meta = _open(path)
    keys = list(raw)
    other = next((k for k in keys if ".lokr_" in k or k.endswith((".dora_scale", ".lora_magnitude_vector"))), None)
    if other:  # read as a LoRA, a DoRA would lose its magnitude (diffusers' reader drops it) and a LoKr everything
        kind = "LoKr" if ".lokr_" in other else "DoRA"
        raise LoraError(
            f"{path} is a {kind} ({other}), not a plain LoRA; `fluxzero convert {path} OUT --to kohya "
            f"--as-lora-rank R` writes it as one"
        )
    if any(k.endswith(".lora_down.weight") for k in keys):
        layout = "kohya"
        found, _ = _from_kohya(raw)
    elif any(k.endswith(".lora_A.weight") for k in keys):
        top = set(_module_names()["top"])
        if all(_BLOCK.match(k) or _LORA_KEY.match(k).group(1) in top for k in keys if _LORA_KEY.match(k)):
            layout = "fluxzero"  # our canonical names, e.g. torch.save(lora_state_dict(model)) as safetensors
            found = {module: (A, B, None) for module, (A, B) in _modules(raw).items()}
        else:
            layout = "diffusers"
            found = _from_diffusers(raw)
    else:
        if any(k.endswith((".weight", ".scale")) for k in keys):
            raise LoraError(
                f"{path} is a full model weights file, not a LoRA; give it to the run file's `weights:` "
                "and keep lora.weights for LoRA files"
            )
        raise LoraError(f"{path} holds no LoRA tensors (no lora_A / lora_B or lora_down / lora_up keys)")
    if not found:
        raise LoraError(f"{path} holds no FLUX.1 transformer LoRA (only text-encoder LoRAs); pass a transformer LoRA")
    ranks = [A.shape[0] for A, _, _ in found.values()]
    rank, alpha, tensor_scale = _header_scale(path, meta, layout, ranks, [a for _, _, a in found.values()])
    targets = _targets(path, meta)
    target_scale = alpha / rank if scale is None else scale
    sd = {}
    for module, (A, B, a) in found.items():
        file_scale = tensor_scale if a is None else a / A.shape[0]
        sd[f"{module}.lora_A.weight"] = A
        sd[f"{module}.lora_B.weight"] = _scale_b(B, file_scale / target_scale)
    info = LoraFileInfo(
        layout=meta.get("fluxzero.format", layout),
        rank=rank,
        alpha=alpha,
        modules=tuple(found),
        targets=targets,
        base_model=meta.get("fluxzero.base_model") or None,
    )
    return sd, info


# ------------------------------------------------------------------------------------------------------
# Merging
# ------------------------------------------------------------------------------------------------------
def merge_lora(base_state_dict: dict[str, Tensor], lora_sd: dict[str, Tensor], cfg: LoraConfig) -> dict[str, Tensor]:
    """W + (alpha / rank) B A for every adapted module, computed in fp32 and cast back to W's dtype.

    `base_state_dict` in our names (weights.load_weights, lora.base_state_dict); the result can be written
    in any full layout with weights.save_weights. Unadapted tensors are passed through (not copied).
    """
    out = dict(base_state_dict)
    for module, (A, B) in _modules(lora_sd).items():
        key = f"{module}.weight"
        if key not in out:
            raise LoraError(
                f"the LoRA adapts {module} but the base weights have no {key}; use base weights of the "
                "model the LoRA was made for"
            )
        Wt = out[key]
        if (B.shape[0], A.shape[1]) != tuple(Wt.shape):
            raise LoraError(
                f"LoRA for {module} makes a ({B.shape[0]}, {A.shape[1]}) update but {key} is "
                f"{tuple(Wt.shape)}; the LoRA was made for another model shape"
            )
        delta = cfg.scale * (B.to(Wt.device, torch.float32) @ A.to(Wt.device, torch.float32))
        out[key] = (Wt.float() + delta).to(Wt.dtype)
    return out
