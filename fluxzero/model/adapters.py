"""DoRA and LoKr beside the plain LoRA: each adapter as the change it makes to its linear's weight, their
files in LyCORIS' layout, and any adapter as a plain LoRA of a chosen rank (truncated SVD of that change).

What each computes (PEFT's and LyCORIS' definitions, which ComfyUI applies too), with s = alpha / rank:
  lora  delta = s B A
  dora  W' = m (W + s B A) / ||W + s B A||, the norm per output row (PEFT; LyCORIS' wd_on_out) or, for a
        `dora_scale` of shape (1, in) that LyCORIS writes without wd_on_out, per input column; delta = W' - W,
        which needs the base weight W
  lokr  delta = s kron(w1, w2), w1 = lokr_w1 or lokr_w1_a @ lokr_w1_b, w2 likewise; in a file s is alpha / the
        rank of the low-rank factor, or 1 when both factors are whole (ComfyUI's and LyCORIS' reading)

The LyCORIS layout (what ComfyUI, LyCORIS and kohya's tools read): `lora_unet_<BFL module, dots as
underscores>.` + `lokr_w1` / `lokr_w1_a` / `lokr_w1_b` / `lokr_w2` / `lokr_w2_a` / `lokr_w2_b` / `alpha` for a
LoKr, `lora_down.weight` / `lora_up.weight` / `alpha` / `dora_scale` (m, shape (out, 1)) for a DoRA. Files from
other trainers name modules as kohya (`lora_unet_`, BFL names), SimpleTuner's LyCORIS (`lycoris_`, diffusers
names with underscores), OneTrainer (`lora_transformer_`, the same) or diffusers (`transformer.`, dotted); a
diffusers-named adapter covers one part of our fused linears (to_q of qkv), and its change fills those rows.

The plain LoRA of rank R: per module the delta's SVD U S V^T cut to its R largest singular values, B = U sqrt(S),
A = sqrt(S) V^T (the best rank-R approximation in the Frobenius norm, Eckart-Young; a randomized SVD where R is
far below the layer's size, which FLUX.1-dev's 21504 x 3072 linears need to take seconds). The error reported is
||delta - B A|| / ||delta|| with B and A as written (rounded to the file's dtype), per module and over all
modules (sqrt of the summed squares over the summed squares).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..config.lora import LoraConfig
from .layouts import swap_halves
from .lora_keys import _ADAPTER_KEY, LoraError

_LOKR = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
# a file's tensor suffixes and the canonical role each stands for
_FILE_ROLES = {
    **{r: r for r in _LOKR},
    "lora_down.weight": "lora_A.weight",
    "lora_up.weight": "lora_B.weight",
    "lora_A.weight": "lora_A.weight",
    "lora_B.weight": "lora_B.weight",
    "dora_scale": "lora_magnitude_vector",
    "lora_magnitude_vector": "lora_magnitude_vector",
    "alpha": "alpha",
}
_SUFFIX = re.compile(r"^(.+?)\.(" + "|".join(re.escape(s) for s in sorted(_FILE_ROLES, key=len, reverse=True)) + r")$")
LYCORIS_PREFIX = "lora_unet_"
_DIFFUSERS_FLAT = ("lycoris_", "lora_transformer_")  # SimpleTuner's LyCORIS, OneTrainer: diffusers names, underscored
_TEXT = ("lora_te", "text_encoder", "te1_", "te2_", "lora_te1", "lora_te2")


@dataclass(frozen=True)
class Part:
    """One adapter of a file or a model: on `module` (ours), or on its row part `index` of `count` (a diffusers
    name on a fused linear); `swap`: its rows are ours with the two halves swapped (diffusers' norm_out)."""

    module: str
    kind: str  # lora, dora or lokr
    tensors: dict  # canonical role (lora_A.weight, lokr_w1, lora_magnitude_vector, ...) -> tensor
    scale: float
    index: int = 0
    count: int = 1
    swap: bool = False


def kind_of(roles) -> str:
    roles = set(roles)
    return "lokr" if roles & set(_LOKR) else "dora" if "lora_magnitude_vector" in roles else "lora"


def trained_parts(sd: dict[str, Tensor], cfg: LoraConfig) -> list[Part]:
    """The adapters of a canonical state dict (fluxzero.model.lora.lora_state_dict) trained under `cfg`."""
    by_module: dict[str, dict] = {}
    for k, t in sd.items():
        m = _ADAPTER_KEY.match(k)
        if m is None:
            raise LoraError(f"tensor {k} is not an adapter tensor; pass lora_state_dict(model)")
        by_module.setdefault(m.group(1), {})[m.group(2)] = t
    return [Part(module, kind_of(t), t, cfg.scale) for module, t in by_module.items()]


# ------------------------------------------------------------------------------------------------------
# The change each adapter makes
# ------------------------------------------------------------------------------------------------------
def _factor(t: dict, name: str) -> Tensor:
    whole = t.get(name)
    return whole.float() if whole is not None else t[f"{name}_a"].float() @ t[f"{name}_b"].float()


def part_delta(p: Part, weight: Tensor | None) -> Tensor:
    """delta W of one adapter, fp32 (out, in); `weight`: its base weight rows (needed by a DoRA only)."""
    t = p.tensors
    if p.kind == "lokr":
        return p.scale * torch.kron(_factor(t, "lokr_w1"), _factor(t, "lokr_w2"))
    low = p.scale * (t["lora_B.weight"].float() @ t["lora_A.weight"].float())
    if p.kind == "lora":
        return low
    if weight is None:
        raise LoraError(
            f"the DoRA on {p.module} rescales the base weight, so its change needs the base weights; "
            "pass the base model's weights file (--base)"
        )
    w = weight.float()
    if tuple(w.shape) != tuple(low.shape):
        raise LoraError(
            f"the DoRA on {p.module} makes a {tuple(low.shape)} change but the base weight is "
            f"{tuple(w.shape)}; pass the base weights of the model it was trained on"
        )
    merged = w + low
    m = t["lora_magnitude_vector"].float()
    if m.numel() == merged.shape[0] and (m.ndim == 1 or m.shape[0] == merged.shape[0]):  # per output row
        out = m.reshape(-1, 1) * merged / merged.norm(dim=1, keepdim=True)
    elif m.numel() == merged.shape[1]:  # LyCORIS without wd_on_out: per input column
        out = m.reshape(1, -1) * merged / merged.norm(dim=0, keepdim=True)
    else:
        raise LoraError(
            f"the DoRA magnitude of {p.module} has shape {tuple(m.shape)}, which matches neither the "
            f"rows nor the columns of its {tuple(merged.shape)} weight; the file is damaged"
        )
    return out - w


def _part_rows(module: str, count: int, present: dict[int, int], hidden: int) -> list[int]:
    """Row counts of the `count` diffusers parts of our fused `module` (missing parts as FLUX.1 has them)."""
    if module.endswith(".linear1"):
        return [hidden, hidden, hidden, present.get(3, 4 * hidden)][:count]
    return [hidden] * count


def module_deltas(parts: list[Part], base: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Our module -> its delta W (fp32), the parts of a fused linear placed in their rows. `base` (our names,
    weights.load_weights) is read for the DoRAs only."""
    grouped: dict[str, list[Part]] = {}
    for p in parts:
        grouped.setdefault(p.module, []).append(p)
    out = {}
    for module, ps in grouped.items():
        w = None if base is None else base.get(f"{module}.weight")
        if base is not None and w is None and any(p.kind == "dora" for p in ps):
            raise LoraError(
                f"the adapter on {module} needs the base weight {module}.weight, which the base "
                "weights do not have; pass the base weights of the model it was trained on"
            )
        if ps[0].count == 1:
            p = ps[0]
            rows = None if w is None else (swap_halves(w) if p.swap else w)
            d = part_delta(p, rows)
            out[module] = swap_halves(d) if p.swap else d
            continue
        deltas = {}
        hidden = None
        for p in ps:
            hidden = hidden or _shape(p)[1]
        sizes = (
            _part_rows(module, ps[0].count, {p.index: _shape(p)[0] for p in ps}, hidden)
            if w is None
            else _part_rows(module, ps[0].count, {3: w.shape[0] - 3 * w.shape[1]}, w.shape[1])
        )
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        for p in ps:
            rows = None if w is None else w[starts[p.index] : starts[p.index] + sizes[p.index]]
            deltas[p.index] = part_delta(p, rows)
        full = torch.zeros(sum(sizes), hidden)
        for i, d in deltas.items():
            if d.shape != (sizes[i], hidden):
                raise LoraError(
                    f"the adapter on part {i} of {module} makes a {tuple(d.shape)} change where the "
                    f"model has ({sizes[i]}, {hidden}); it was made for another model shape"
                )
            full[starts[i] : starts[i] + sizes[i]] = d
        out[module] = full
    return out


def _shape(p: Part) -> tuple[int, int]:
    """(out, in) of the change an adapter makes, from its tensors alone."""
    t = p.tensors
    if p.kind != "lokr":
        return t["lora_B.weight"].shape[0], t["lora_A.weight"].shape[1]
    w1 = t["lokr_w1"].shape if "lokr_w1" in t else (t["lokr_w1_a"].shape[0], t["lokr_w1_b"].shape[1])
    w2 = t["lokr_w2"].shape if "lokr_w2" in t else (t["lokr_w2_a"].shape[0], t["lokr_w2_b"].shape[1])
    return w1[0] * w2[0], w1[1] * w2[1]


def merge_deltas(base: dict[str, Tensor], deltas: dict[str, Tensor]) -> dict[str, Tensor]:
    """W + delta for every module (fp32 sum, cast back to W's dtype); other tensors passed through."""
    out = dict(base)
    for module, d in deltas.items():
        key = f"{module}.weight"
        if key not in out or tuple(out[key].shape) != tuple(d.shape):
            have = tuple(out[key].shape) if key in out else "absent"
            raise LoraError(
                f"the adapter on {module} makes a {tuple(d.shape)} change but {key} is {have} in the "
                "base weights; use the base weights of the model it was made for"
            )
        out[key] = (out[key].float() + d).to(out[key].dtype)
    return out


# ------------------------------------------------------------------------------------------------------
# As a plain LoRA
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlainLora:
    """A plain LoRA standing for adapters: canonical tensors (scale 1: alpha = rank) and its errors."""

    state_dict: dict
    config: LoraConfig
    errors: dict  # module -> relative Frobenius error of B A against the delta
    overall: float


def as_plain_lora(deltas: dict[str, Tensor], rank: int, dtype: torch.dtype = torch.float32) -> PlainLora:
    """Each delta cut to `rank` by SVD (see the module docstring); LoraError when a layer has fewer than `rank`
    rows or columns, before any work."""
    for module, d in deltas.items():
        if rank > min(d.shape):
            raise LoraError(
                f"rank {rank} is larger than layer {module} ({d.shape[0]} x {d.shape[1]}), whose change "
                f"has rank at most {min(d.shape)}; choose a rank of at most "
                f"{min(min(x.shape) for x in deltas.values())}"
            )
    sd, errors, lost, total = {}, {}, 0.0, 0.0
    device = "cuda" if torch.cuda.is_available() else "cpu"  # FLUX.1-dev's linear1 is 21504 x 3072
    for module, d in deltas.items():
        d = d.detach().to(device, torch.float32)  # a checkpoint's tensors may still require grad
        U, S, Vh = _truncated_svd(d, rank)
        root = S.sqrt()
        B, A = (U * root).to(dtype), (root[:, None] * Vh).to(dtype)
        sd[f"{module}.lora_A.weight"], sd[f"{module}.lora_B.weight"] = A.cpu().contiguous(), B.cpu().contiguous()
        norm = float(d.norm())
        miss = float((d - B.float() @ A.float()).norm())
        errors[module] = miss / norm if norm > 0 else 0.0
        lost, total = lost + miss**2, total + norm**2
    cfg = LoraConfig(rank=rank, alpha=float(rank), targets=list(deltas))
    return PlainLora(sd, cfg, errors, math.sqrt(lost / total) if total > 0 else 0.0)


_OVERSAMPLE, _NITER = 10, 4  # torch.svd_lowrank's sketch: q = rank + 10 columns, 4 power iterations


def _truncated_svd(d: Tensor, rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """(U, S, Vh) of the `rank` largest singular values of d: exact (LAPACK) when rank is near d's size, else
    torch.svd_lowrank's randomized sketch (Halko et al.), seeded so that an export is reproducible; either way
    as_plain_lora measures the error of what it writes."""
    if rank + _OVERSAMPLE >= min(d.shape) // 2:
        U, S, Vh = torch.linalg.svd(d.double(), full_matrices=False)
        return U[:, :rank].float(), S[:rank].float(), Vh[:rank].float()
    with torch.random.fork_rng(devices=[d.device] if d.is_cuda else []):
        torch.manual_seed(0)
        U, S, V = torch.svd_lowrank(d, q=rank + _OVERSAMPLE, niter=_NITER)
    return U[:, :rank], S[:rank], V[:, :rank].T


def error_report(plain: PlainLora) -> list[str]:
    """One line per module, worst first, then the overall figure."""
    lines = [f"  {e:10.3e}  {m}" for m, e in sorted(plain.errors.items(), key=lambda kv: -kv[1])]
    return [
        f"relative error of the rank-{plain.config.rank} LoRA per layer (||delta - B A|| / ||delta||):",
        *lines,
        f"  {plain.overall:10.3e}  overall",
    ]


def check_error(plain: PlainLora, max_error: float | None, source: str | None = None) -> None:
    """LoraError naming the worst layer (and `source`, a file) when any layer's error is above `max_error`."""
    if max_error is None:
        return
    module, worst = max(plain.errors.items(), key=lambda kv: kv[1])
    if worst > max_error:
        raise LoraError(
            f"{source + ': ' if source else ''}the rank-{plain.config.rank} LoRA is off by {worst:.3g} "
            f"(relative) on {module}, above --max-error {max_error:g} (overall {plain.overall:.3g}); "
            f"raise --as-lora-rank or --max-error"
        )


# ------------------------------------------------------------------------------------------------------
# The LyCORIS layout
# ------------------------------------------------------------------------------------------------------
def to_lycoris(parts: list[Part], cfg: LoraConfig) -> dict[str, Tensor]:
    """LyCORIS-named tensors of our trained DoRA or LoKr adapters (see the module docstring)."""
    out = {}
    for p in parts:
        key = LYCORIS_PREFIX + p.module.replace(".", "_")
        t = {r: v.detach() for r, v in p.tensors.items()}
        if p.kind == "lokr":
            whole = "lokr_w1" in t and "lokr_w2" in t
            if whole:  # readers apply scale 1 to whole factors: the scale goes into w2
                t["lokr_w2"] = (t["lokr_w2"].float() * p.scale).to(t["lokr_w2"].dtype)
            for r in _LOKR:
                if r in t:
                    out[f"{key}.{r}"] = t[r].clone().contiguous()
            if not whole:  # alpha / the factor's rank, the rank PEFT gives both factors
                rank = (t.get("lokr_w2_b") if "lokr_w2_b" in t else t["lokr_w1_b"]).shape[0]
                out[f"{key}.alpha"] = torch.tensor(float(p.scale * rank))
        else:
            A, B = t["lora_A.weight"], t["lora_B.weight"]
            out[f"{key}.lora_down.weight"] = A.clone().contiguous()
            out[f"{key}.lora_up.weight"] = B.clone().contiguous()
            out[f"{key}.alpha"] = torch.tensor(float(p.scale * A.shape[0]))
            if p.kind == "dora":
                out[f"{key}.dora_scale"] = t["lora_magnitude_vector"].reshape(-1, 1).clone()
    return out


def save_lycoris(
    path: str | os.PathLike,
    sd: dict[str, Tensor],
    cfg: LoraConfig,
    base_model: str | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write our trained DoRA / LoKr (a canonical state dict) in the LyCORIS layout; like lora_formats.save_lora."""
    from .weights import save_tensors

    tensors = to_lycoris(trained_parts(sd, cfg), cfg)
    if dtype is not None:
        tensors = {k: v if k.endswith(".alpha") else v.to(dtype) for k, v in tensors.items()}
    args = {"algo": "lokr" if cfg.type == "lokr" else "lora"}
    if cfg.type == "dora":
        args["dora_wd"] = "True"
    elif cfg.factor != -1:
        args["factor"] = str(cfg.factor)
    meta = {
        "format": "pt",
        "fluxzero.format": "lycoris",
        "fluxzero.type": cfg.type,
        "fluxzero.rank": str(cfg.rank),
        "fluxzero.alpha": repr(cfg.alpha),
        "fluxzero.targets": json.dumps(cfg.targets),
        "fluxzero.base_model": base_model or "",
        "ss_network_module": "lycoris.kohya",
        "ss_network_dim": str(cfg.rank),
        "ss_network_alpha": repr(cfg.alpha),
        "ss_network_args": json.dumps(args),
        "ss_base_model_version": "flux1",
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tensors(path, tensors, meta)


def _module_of(base: str) -> tuple[str, int, int, bool] | None:
    """(our module, part, parts, swapped) of a file's module name in any of the layouts read here."""
    from .layouts import diffusers_names
    from .lora_formats import diffusers_module, kohya_module

    if base.startswith(LYCORIS_PREFIX):
        module = kohya_module(base)
        return None if module is None else (module, 0, 1, False)
    if base.startswith("diffusion_model."):  # BFL names, dotted (ComfyUI's own)
        name = base.removeprefix("diffusion_model.")
        return (name, 0, 1, False) if kohya_module(LYCORIS_PREFIX + name.replace(".", "_")) == name else None
    if base.startswith(_DIFFUSERS_FLAT):
        flat = base.removeprefix(next(p for p in _DIFFUSERS_FLAT if base.startswith(p)))
        name = _diffusers_flat_names().get(flat)
    else:
        name = base.removeprefix("transformer.")
    hit = diffusers_module(name) if name else None
    if hit is None:
        return None
    module, part, count = hit
    return module, part, count, count == 1 and diffusers_names(module + ".weight")[1] == "swap"


def _diffusers_flat_names() -> dict[str, str]:
    """`transformer_blocks_0_attn_to_q` -> `transformer_blocks.0.attn.to_q`, for every block index a model may have."""
    from .lora_formats import _from_diffusers_table

    out = {}
    for kind, inner in _from_diffusers_table():
        if kind == "top":
            out[inner.replace(".", "_")] = inner
            continue
        block = "transformer_blocks" if kind == "double" else "single_transformer_blocks"
        for i in range(64):  # FLUX.1 has 19 and 38 blocks
            out[f"{block}_{i}_{inner.replace('.', '_')}"] = f"{block}.{i}.{inner}"
    return out


def read_adapters(path: str | os.PathLike) -> tuple[list[Part], dict[str, str]]:
    """Every adapter of a LoKr / DoRA / LoRA file in any layout named in the module docstring, and its header.
    One sentence naming the file for a key that is no adapter tensor, a module that is no FLUX.1 linear, an
    incomplete adapter or a non-finite value."""
    from .lora_formats import _open

    path = Path(path)
    raw, meta = _open(path)
    grouped: dict[str, dict[str, Tensor]] = {}
    for key, t in raw.items():
        if key.startswith(_TEXT):
            continue  # a text encoder's adapter: not the transformer's
        m = _SUFFIX.match(key)
        if m is None:
            raise LoraError(
                f"{path}: tensor {key} is not a LoKr, DoRA or LoRA tensor (lokr_w1, lokr_w2, lokr_w1_a/_b, "
                "lokr_w2_a/_b, lora_down/lora_up, dora_scale, alpha); this file is not an adapter this "
                "tool reads: convert it with the trainer that made it"
            )
        if not (t.is_floating_point() or m.group(2) == "alpha"):  # an alpha's own checks are below
            raise LoraError(
                f"{path}: {key} holds {str(t.dtype).removeprefix('torch.')} values, but adapter weights "
                "are floating point; this file is damaged, write or download it again"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t.float()).all()):
            raise LoraError(
                f"{path}: {key} holds NaN or infinite values; this file is damaged, write or download it again"
            )
        grouped.setdefault(m.group(1), {})[_FILE_ROLES[m.group(2)]] = t
    parts = []
    for base, t in grouped.items():
        where = _module_of(base)
        if where is None:
            raise LoraError(
                f"{path}: {base} names no FLUX.1 transformer linear (expected e.g. "
                "lora_unet_double_blocks_0_img_attn_qkv or lycoris_transformer_blocks_0_attn_to_q); this "
                "is not a FLUX.1 transformer adapter"
            )
        alpha = t.pop("alpha", None)
        if alpha is not None and (alpha.numel() != 1 or not float(alpha.float().reshape(())) > 0):
            raise LoraError(f"{path}: {base}.alpha is not one number above 0; this file is damaged")
        kind = kind_of(t)
        need = {"lora": ("lora_A.weight", "lora_B.weight"), "dora": ("lora_A.weight", "lora_B.weight")}.get(kind, ())
        missing = [r for r in need if r not in t]
        if kind == "lokr":
            missing = [f for f in ("lokr_w1", "lokr_w2") if f not in t and not (f"{f}_a" in t and f"{f}_b" in t)]
            stray = [r for r in t if r not in _LOKR]
            if stray:
                raise LoraError(
                    f"{path}: {base} mixes LoKr tensors with {stray[0]}; this file is not an adapter this tool reads"
                )
        if missing:
            raise LoraError(f"{path}: the adapter {base} has no {missing[0]}; the file is incomplete")
        _check_factors(path, base, t)
        parts.append(Part(where[0], kind, t, _file_scale(kind, t, alpha), where[1], where[2], where[3]))
    if not parts:
        raise LoraError(f"{path} holds no FLUX.1 transformer adapter")
    return parts, meta


def _check_factors(path, base: str, t: dict[str, Tensor]) -> None:
    """LoraError naming the file when an adapter's matrices are not 2-D or a low-rank pair does not multiply."""
    for role, x in t.items():
        if role != "lora_magnitude_vector" and x.ndim != 2:
            raise LoraError(
                f"{path}: {base}'s {role} has shape {tuple(x.shape)}, not a matrix; this file is damaged, "
                "write or download it again"
            )
    for up, down in (("lora_B.weight", "lora_A.weight"), ("lokr_w1_a", "lokr_w1_b"), ("lokr_w2_a", "lokr_w2_b")):
        if up in t and down in t and t[up].shape[1] != t[down].shape[0]:
            raise LoraError(
                f"{path}: {base}'s {up} {tuple(t[up].shape)} and {down} {tuple(t[down].shape)} do not "
                "multiply (their ranks differ); this file is damaged, write or download it again"
            )


def _file_scale(kind: str, t: dict, alpha: Tensor | None) -> float:
    """The scale a file's adapter is applied at (see the module docstring): alpha / rank of its low-rank factor,
    1 without an alpha, or for a LoKr of two whole factors."""
    if alpha is None:
        return 1.0
    if kind == "lokr":
        low = t.get("lokr_w2_b", t.get("lokr_w1_b"))
        return 1.0 if low is None else float(alpha) / low.shape[0]
    return float(alpha) / t["lora_A.weight"].shape[0]


def has_adapter_keys(path: str | os.PathLike) -> bool:
    """True when a .safetensors file holds LoKr or DoRA tensors (reads only the header)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
    except Exception:  # noqa: BLE001 - not a readable safetensors file
        return False
    return any(".lokr_" in k or k.endswith((".dora_scale", ".lora_magnitude_vector")) for k in keys)
