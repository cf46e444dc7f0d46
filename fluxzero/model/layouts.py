"""FLUX.1 weight layouts in memory: what our (BFL-named) state dict is called in the BFL, ComfyUI and diffusers
layouts, the conversions between them, and the ModelConfig a set of BFL-named tensor shapes describes.

Our state dict uses BFL's names, so a BFL file is read as is; ComfyUI adds the `model.diffusion_model.`
prefix; diffusers renames everything and splits fused tensors:
  double block  qkv (3C, C)          -> to_q / to_k / to_v (image), add_q_proj / add_k_proj / add_v_proj (text)
  single block  linear1 (3C + M, C)  -> attn.to_q / to_k / to_v, proj_mlp;  linear2 -> proj_out
  final layer   adaLN_modulation.1 rows [shift | scale] -> norm_out.linear rows [scale | shift]
Reading and writing files is fluxzero.model.weights.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from ..config import MODEL_PRESETS, ModelConfig

LAYOUTS = ("bfl", "comfyui", "diffusers")
COMFY_PREFIX = "model.diffusion_model."
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
# Metadata key of a single BFL / ComfyUI file holding its ModelConfig (JSON of ModelConfig.to_dict()), written
# for shapes no preset has: the RoPE axes and theta are not in any tensor's shape.
MODEL_METADATA = "fluxzero_model"
_SHOW = 5  # offenders listed in an error message


class WeightsError(ValueError):
    """A weights file or folder that cannot be read as FLUX.1 transformer weights."""


# ------------------------------------------------------------------------------------------------------
# BFL <-> diffusers names
# ------------------------------------------------------------------------------------------------------
_TOP = {  # BFL module -> diffusers module
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",  # halves swapped
}
_DOUBLE = {  # inside double_blocks.N -> inside transformer_blocks.N; a list = row-split of a fused tensor
    "img_mod.lin": "norm1.linear",
    "txt_mod.lin": "norm1_context.linear",
    "img_attn.qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "txt_attn.qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    "img_attn.norm.query_norm": "attn.norm_q",
    "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q",
    "txt_attn.norm.key_norm": "attn.norm_added_k",
    "img_attn.proj": "attn.to_out.0",
    "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.net.0.proj",
    "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj",
    "txt_mlp.2": "ff_context.net.2",
}
_SINGLE = {  # inside single_blocks.N -> inside single_transformer_blocks.N
    "linear1": ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"],
    "linear2": "proj_out",
    "norm.query_norm": "attn.norm_q",
    "norm.key_norm": "attn.norm_k",
    "modulation.lin": "norm.linear",
}
_BLOCK = re.compile(r"^(double_blocks|single_blocks)\.(\d+)\.(.+)$")


def diffusers_names(bfl_key: str) -> tuple[list[str], str]:
    """Diffusers keys holding one BFL tensor and how they combine: "copy", "cat" (rows) or "swap" (halves)."""
    module, _, param = bfl_key.rpartition(".")
    dparam = "weight" if param == "scale" else param  # RMSNorm scale is diffusers' weight
    m = _BLOCK.match(module)
    if m:
        kind, index, inner = m.groups()
        if kind == "double_blocks":
            table, dprefix = _DOUBLE, "transformer_blocks"
        else:
            table, dprefix = _SINGLE, "single_transformer_blocks"
        target = table.get(inner)
        if target is None:
            raise KeyError(bfl_key)
        targets = target if isinstance(target, list) else [target]
        names = [f"{dprefix}.{index}.{t}.{dparam}" for t in targets]
        return names, "cat" if isinstance(target, list) else "copy"
    if module not in _TOP:
        raise KeyError(bfl_key)
    return [f"{_TOP[module]}.{dparam}"], "swap" if module == "final_layer.adaLN_modulation.1" else "copy"


def swap_halves(t: Tensor) -> Tensor:
    """The two halves of dim 0 exchanged: final_layer.adaLN_modulation is (shift, scale) in BFL's layout and
    (scale, shift) in diffusers'. Its own inverse."""
    return torch.cat(t.chunk(2, dim=0)[::-1], dim=0)


def split_sizes(name: str, rows: int, hidden: int) -> list[int]:
    """Row counts of the diffusers parts of a fused linear `name` (a module or its parameter): a qkv's 3 x C,
    a single block's linear1 [q | k | v | mlp]."""
    if "linear1" in name.split("."):
        return [hidden, hidden, hidden, rows - 3 * hidden]
    return [rows // 3] * 3


def _diffusers_parts(bfl_key: str, rows: int, hidden: int) -> list[tuple[str, str, tuple[int, int] | None]]:
    """(diffusers name, "copy" or "swap", (first row, row count) of a split or None) per tensor it becomes."""
    names, how = diffusers_names(bfl_key)
    if how != "cat":
        return [(names[0], how, None)]
    sizes = split_sizes(bfl_key, rows, hidden)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(name, "copy", (start, size)) for name, start, size in zip(names, starts, sizes)]


def _part(t: Tensor, how: str, rows: tuple[int, int] | None, dtype=None, device=None) -> Tensor:
    """One output tensor, contiguous: a view of `t` unless a swap or a dtype / device change copies it."""
    t = t.detach()
    if rows is not None:  # narrow before converting, so only this part is ever copied
        t = t.narrow(0, *rows)
    t = t.to(device=device or t.device, dtype=dtype or t.dtype)
    return (swap_halves(t) if how == "swap" else t).contiguous()


def bfl_to_diffusers(state_dict: dict[str, Tensor], hidden_size: int | None = None) -> dict[str, Tensor]:
    """Rename and split a BFL-named state dict into diffusers' FluxTransformer2DModel names.

    `hidden_size` is read from img_in when not given (needed to split single-block linear1).
    """
    hidden = hidden_size or state_dict["img_in.weight"].shape[0]
    return {
        name: _part(t, how, rows)
        for key, t in state_dict.items()
        for name, how, rows in _diffusers_parts(key, t.shape[0], hidden)
    }


def diffusers_to_bfl(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Inverse of `bfl_to_diffusers`; raises WeightsError on missing or unexpected keys."""
    plan, unexpected = _plan_from_diffusers(state_dict)
    missing = sorted({p for parts, _ in plan.values() for p in parts} - set(state_dict))
    _raise_if(missing, unexpected, [], "diffusers")
    return {key: _combine([state_dict[p] for p in parts], how) for key, (parts, how) in plan.items()}


def _combine(parts: list[Tensor], how: str) -> Tensor:
    if how == "copy":
        return parts[0]
    if how == "swap":
        return swap_halves(parts[0])
    if len({p.shape[1:] for p in parts}) > 1 or any(p.dim() == 0 for p in parts):
        raise WeightsError(
            f"parts of shapes {', '.join(str(tuple(p.shape)) for p in parts)} cannot be fused into one "
            f"tensor (their widths differ); pass weights of one FLUX.1 model"
        )
    return torch.cat(parts, dim=0)


def _bfl_keys(depth: int, depth_single: int, guidance: bool, qkv_bias: bool) -> list[str]:
    # The names of our own module tree with this structure (built on meta with tiny widths: instant).
    from .flux import build_model

    cfg = MODEL_PRESETS["flux-tiny"].replace(
        depth=depth, depth_single_blocks=depth_single, guidance_embed=guidance, qkv_bias=qkv_bias
    )
    return list(build_model(cfg, device="meta").state_dict())


def _plan_from_diffusers(keys) -> tuple[dict[str, tuple[list[str], str]], list[str]]:
    """BFL key -> (diffusers parts, how) for the structure those diffusers keys describe; plus unexpected keys."""
    keys = set(keys)

    def count(prefix: str) -> int:
        idx = [int(k.split(".")[1]) for k in keys if k.startswith(prefix + ".") and k.split(".")[1].isdigit()]
        return max(idx) + 1 if idx else 0

    bfl = _bfl_keys(
        count("transformer_blocks"),
        count("single_transformer_blocks"),
        any(k.startswith("time_text_embed.guidance_embedder.") for k in keys),
        "transformer_blocks.0.attn.to_q.bias" in keys or not count("transformer_blocks"),
    )
    plan = {k: diffusers_names(k) for k in bfl}
    used = {p for parts, _ in plan.values() for p in parts}
    return plan, sorted(keys - used)


def _raise_if(missing, unexpected, wrong_shape, layout, path="", wrong_dtype=()):
    if not (missing or unexpected or wrong_shape or wrong_dtype):
        return
    problems = []
    for label, items in (
        ("missing", missing),
        ("unexpected", unexpected),
        ("wrong shape", wrong_shape),
        ("not floating point", wrong_dtype),
    ):
        if items:
            more = f" (+{len(items) - _SHOW} more)" if len(items) > _SHOW else ""
            problems.append(f"{len(items)} {label}: {', '.join(items[:_SHOW])}{more}")
    where = f"{path}: " if path else ""
    fix = "pass weights of the same FLUX.1 variant as the model preset"
    if wrong_dtype and not (missing or unexpected or wrong_shape):
        fix = "pass the released floating-point weights (integer tensors are not FLUX.1 weights)"
    raise WeightsError(f"{where}weights in {layout} layout do not match the model: {'; '.join(problems)}; {fix}")


def infer_config(
    shapes: dict[str, tuple[int, ...]],
    name: str = "custom",
    axes_dim=None,
    theta: int | None = None,
    kontext: bool = False,
) -> ModelConfig:
    """The ModelConfig a BFL-named set of tensor shapes describes (a preset when one matches exactly).

    The tensors do not show the RoPE axes and theta: `axes_dim` / `theta` given (declared by the weights or
    the user) win; without them a head dim of 128 gets FLUX.1's (16, 56, 56) and theta 10000. Nor do they show
    FLUX.1 Kontext (FLUX.1-dev's tensors): `kontext` says so where the weights declare it.
    """
    fix = (
        "name the model the weights belong to (--model PRESET, PRESET:field=value,... such as "
        "flux-dev:head_dim=16,num_heads=2,axes_dim=4,6,6, or a diffusers config.json)"
    )
    try:
        hidden, in_channels = shapes["img_in.weight"]
        norm = next(k for k in shapes if k.endswith("query_norm.scale"))  # StopIteration: no blocks at all
        head_dim = shapes[norm][0]
        mlp = (
            shapes["double_blocks.0.img_mlp.0.weight"][0]
            if "double_blocks.0.img_mlp.0.weight" in shapes
            else shapes["single_blocks.0.linear1.weight"][0] - 3 * hidden
        )
        fields = dict(
            in_channels=in_channels,
            out_channels=shapes["final_layer.linear.weight"][0],
            vec_in_dim=shapes["vector_in.in_layer.weight"][1],
            context_in_dim=shapes["txt_in.weight"][1],
            hidden_size=hidden,
            mlp_ratio=mlp / hidden,
            num_heads=hidden // head_dim,
            depth=len({k.split(".")[1] for k in shapes if k.startswith("double_blocks.")}),
            depth_single_blocks=len({k.split(".")[1] for k in shapes if k.startswith("single_blocks.")}),
            qkv_bias="double_blocks.0.img_attn.qkv.bias" in shapes,
            guidance_embed="guidance_in.in_layer.weight" in shapes,
            kontext=kontext,
        )
    except KeyError as e:
        raise WeightsError(f"cannot infer the model shape: tensor {e.args[0]} is missing; {fix}") from None
    except StopIteration:
        raise WeightsError(f"cannot infer the model shape: no transformer blocks in the weights; {fix}") from None
    except (ValueError, TypeError, IndexError, ZeroDivisionError):  # a tensor of another rank, parts that don't fuse
        raise WeightsError(
            "cannot infer the model shape: img_in, txt_in, vector_in, final_layer or the first blocks have shapes "
            f"no FLUX.1 transformer has; {fix} to list every mismatch"
        ) from None
    for preset in MODEL_PRESETS.values():
        if (
            all(getattr(preset, f) == v for f, v in fields.items())
            and axes_dim in (None, preset.axes_dim)
            and theta in (None, preset.theta)
        ):
            return preset
    if axes_dim is None:
        if head_dim != 128:
            raise WeightsError(f"cannot infer RoPE axes for head dim {head_dim}; {fix}")
        axes_dim = (16, 56, 56)
    if sum(axes_dim) != head_dim:
        raise WeightsError(
            f"RoPE axes {tuple(axes_dim)} do not sum to the head dim {head_dim} of the tensors; fix "
            f"axes_dims_rope in the diffusers config.json or {fix}"
        )
    try:
        return ModelConfig(name=name, axes_dim=tuple(axes_dim), theta=theta or 10_000, **fields)
    except ValueError as e:  # e.g. a hidden size that the head count does not divide
        raise WeightsError(f"the tensor shapes describe no valid model ({e}); {fix}") from None


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    from .flux import build_model

    return {k: tuple(v.shape) for k, v in build_model(cfg, device="meta").state_dict().items()}


def _wrong_shapes(shapes, expected) -> list[str]:
    return [f"{k} {shapes[k]} != {expected[k]}" for k in expected if k in shapes and shapes[k] != expected[k]]
