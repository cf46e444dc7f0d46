"""LoRA adapters on our Flux module tree, through PEFT's `inject_adapter_in_model`.

The model stays our Flux class (no PeftModel wrapper): each targeted nn.Linear becomes PEFT's lora.Linear
holding the original as `.base_layer`, so activation checkpointing and compile applied from outside still
find `double_blocks` / `single_blocks`. Note that the base parameters' state-dict names gain `.base_layer`
(`double_blocks.0.img_attn.qkv.base_layer.weight`): load full weights before `apply_lora`, or read them back
with `base_state_dict`.

ZeRO-3: PEFT builds A (rank x in_features) and B (out_features x rank) from nn.Linear.in_features /
out_features and reads only the base weight's dtype and device, so base parameters that are ZeRO-3
placeholders (numel 0) are fine for the initialisations offered (LORA_INITS). The adapters themselves are
ordinary tensors until `deepspeed.initialize` partitions them; `lora_state_dict` then needs them gathered.

Canonical adapter names are PEFT's saved names on our modules: `<module>.lora_A.weight` (rank, in) and
`<module>.lora_B.weight` (out, rank); the scale alpha / rank is not in the tensors but in LoraConfig. A DoRA
(lora.type: dora) adds `<module>.lora_magnitude_vector` (out,); a LoKr (lora.type: lokr) has `<module>.lokr_w1`
or `.lokr_w1_a` / `.lokr_w1_b`, and `.lokr_w2` or `.lokr_w2_a` / `.lokr_w2_b` (fluxzero.model.adapters says what
each computes).
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import re
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..config.lora import TARGET_PRESETS, LoraConfig
from .lora_keys import _ADAPTER_KEY, LoraError, _linear_names, _looks_full, canonical_adapter_name

ADAPTER = "default"  # PEFT's adapter name; one adapter per model here
_SHOW = 6


def _generic(names: Sequence[str]) -> list[str]:
    """`double_blocks.3.img_attn.qkv` -> `double_blocks.*.img_attn.qkv`, deduplicated in order."""
    return list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in names))


def target_modules(model: nn.Module, targets: str | Sequence[str]) -> list[str]:
    """Module names (in model order) that a preset name or a list of fnmatch patterns selects.

    Only linear layers are candidates, so `double_blocks.0.*` means every linear of that block. A pattern
    that selects nothing raises LoraError naming module names of the right form.
    """
    if isinstance(targets, str):
        if targets not in TARGET_PRESETS:
            raise LoraError(
                f"lora.targets {targets!r} is not a preset; use one of {', '.join(TARGET_PRESETS)} or a "
                "list of module-name patterns"
            )
        patterns = TARGET_PRESETS[targets]
    else:
        patterns = tuple(targets)
    names = _linear_names(model)
    chosen = set()
    for pattern in patterns:
        hit = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hit and not (isinstance(targets, str) and pattern.startswith(("double_blocks", "single_blocks"))):
            generic = _generic(names)
            close = difflib.get_close_matches(pattern, generic, n=_SHOW, cutoff=0.0)
            raise LoraError(
                f"lora.targets pattern {pattern!r} matches no linear layer of the model; patterns are "
                f"fnmatch globs over whole module names, e.g. {', '.join(close)}"
            )
        chosen.update(hit)
    if not chosen:  # a preset on a model without blocks of that kind
        raise LoraError(f"lora.targets {targets!r} selects no linear layer of this model; name patterns instead")
    return [n for n in names if n in chosen]


def require_peft():
    """peft, or one sentence naming the extra that installs it (every rank of a LoRA run gets here)."""
    try:
        import peft
    except ImportError:
        raise LoraError("a LoRA run needs the peft package, which is not installed: pip install -e '.[lora]'") from None
    return peft


def _peft_config(cfg: LoraConfig, names: list[str]):
    peft = require_peft()
    if cfg.type == "lokr":  # PEFT's default init: w1 = 0 (the base model's output at step 0), w2 as LyCORIS draws it
        return peft.LoKrConfig(
            r=cfg.rank,
            alpha=cfg.alpha,
            target_modules=names,
            decompose_factor=cfg.factor,
            decompose_both=cfg.decompose_both,
            init_weights=True,
        )
    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=names,
        bias="none",
        init_lora_weights=True if cfg.init == "default" else cfg.init,
        use_dora=cfg.type == "dora",
    )


def has_lora(model: nn.Module) -> bool:
    """The model carries adapters of any type."""
    return any(canonical_adapter_name(n, ADAPTER) for n, _ in model.named_parameters())


def apply_lora(model: nn.Module, cfg: LoraConfig, gather=None) -> list[str]:
    """Inject LoRA adapters into `model` in place; return the adapted module names.

    Every base parameter is frozen; adapter parameters are trainable and float32 whatever the base dtype
    (PEFT casts the adapter's input to float32 and its output back). With `cfg.weights` the adapters start
    from that LoRA file (its B rescaled when the file's alpha / rank differs from cfg's).

    A DoRA starts its magnitude at the norm of each base weight row, so on partitioned (ZeRO-3) base weights
    `gather` (deepspeed.zero.GatheredParameters) makes one linear's weight whole while its adapter is made:
    one linear at a time, never the whole model.
    """
    peft = require_peft()
    from peft.tuners.tuners_utils import cast_adapter_dtype

    if has_lora(model):
        raise LoraError("the model already has LoRA adapters; apply_lora once per model (build a fresh one)")
    names = target_modules(model, cfg.targets)
    with warnings.catch_warnings():
        # on a quantized base (model/quant.py) PEFT's torchao tuner warns that merge() would need a requantizing
        # hook: nothing merges into the quantized model (exports merge into the base weights file)
        warnings.filterwarnings("ignore", message=".*without `get_apply_tensor_subclass`")
        if gather is None or cfg.type != "dora":
            peft.inject_adapter_in_model(_peft_config(cfg, names), model, adapter_name=ADAPTER)
        else:
            for name in names:
                with gather(list(model.get_submodule(name).parameters())):
                    peft.inject_adapter_in_model(_peft_config(cfg, [name]), model, adapter_name=ADAPTER)
    cast_adapter_dtype(model, ADAPTER, autocast_adapter_dtype=True)  # bf16 / fp16 adapters -> fp32
    if cfg.type == "dora":
        from peft.tuners.lora.dora import DoraLinearLayer

        dora = _dora_layer_class()
        for m in model.modules():
            if type(m) is DoraLinearLayer:
                m.__class__ = dora
    for name, p in model.named_parameters():
        p.requires_grad_(canonical_adapter_name(name, ADAPTER) is not None)
    if cfg.weights is not None:
        from .lora_formats import read_lora

        sd, info = read_lora(cfg.weights, scale=cfg.scale)
        try:
            load_lora_state_dict(model, sd)
        except LoraError as e:
            raise LoraError(f"{cfg.weights}: {e}") from None
    return names


@functools.cache
def _dora_layer_class() -> type:
    """PEFT's DoraLinearLayer, its weight norm's B A built without autograd.

    PEFT builds B A as B(A(I)) in every forward with autograd on, then detaches it before the norm (the DoRA paper
    keeps the norm out of the gradient): the graph it records is never used by backward, but under selective
    activation checkpointing its two matmul outputs, (in, rank) and (in, out) per adapted linear, are kept until
    backward (fluxzero.train.recompute.selective_policy keeps matmul outputs). Without autograd the values are the
    same, nothing is recorded, and the policy keeps nothing of it (it keeps only what runs with gradients)."""
    from peft.tuners.lora.dora import DoraLinearLayer

    class DoraLayer(DoraLinearLayer):
        def get_lora_weight(self, lora_A, lora_B, adapter_name=None):
            with torch.no_grad():
                return super().get_lora_weight(lora_A, lora_B, adapter_name=adapter_name)

    return DoraLayer


def _adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Canonical name -> adapter parameter."""
    out = {}
    for name, p in model.named_parameters():
        key = canonical_adapter_name(name, ADAPTER)
        if key:
            out[key] = p
    return out


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Adapter tensors only, canonical names (`<module>.lora_A.weight`, `<module>.lora_B.weight`, ...), detached.

    Under ZeRO-3 gather the adapters first (deepspeed.zero.GatheredParameters over the trainable parameters).
    """
    params = _adapter_params(model)
    if not params:
        raise LoraError("the model has no LoRA adapters; call apply_lora first")
    empty = [k for k, p in params.items() if p.numel() == 0]
    if empty:
        raise LoraError(
            f"LoRA tensor {empty[0]} is a ZeRO-3 placeholder (numel 0); gather the adapter parameters "
            "(deepspeed.zero.GatheredParameters) before reading them"
        )
    return {k: p.detach() for k, p in params.items()}


def load_lora_state_dict(model: nn.Module, sd: dict[str, Tensor]) -> None:
    """Copy canonical adapter tensors into the model's adapters (exact set and shapes, else LoraError)."""
    params = _adapter_params(model)
    if not params:
        raise LoraError("the model has no LoRA adapters; call apply_lora before loading a LoRA")
    full = [k for k in _looks_full(sd) if not _ADAPTER_KEY.match(k)]
    if full and not any(_ADAPTER_KEY.match(k) for k in sd):
        raise LoraError(
            f"this holds full model weights ({full[0]}, ...), not LoRA adapters; load it as the model's "
            "weights (run file `weights:`) and give LoRA files to lora.weights"
        )
    other = [k for k in sd if not _ADAPTER_KEY.match(k)]
    if other:
        raise LoraError(
            f"tensor {other[0]} is not a LoRA tensor (<module>.lora_A.weight / .lora_B.weight); pass an "
            "adapter-only state dict"
        )
    modules = lambda keys: sorted({_ADAPTER_KEY.match(k).group(1) for k in keys})  # noqa: E731
    unknown = sorted(set(sd) - set(params))
    if unknown:
        mods = modules(unknown)
        if set(mods) <= set(modules(params)):  # the modules are adapted, by another kind of adapter
            raise LoraError(
                f"the file holds {unknown[0]}, which adapters of this lora.type / lora.rank do not have; "
                "set lora.type (lora, dora, lokr) and lora.rank to the file's"
            )
        raise LoraError(
            f"the LoRA has tensors for {len(mods)} module(s) the model has no adapter on "
            f"(e.g. {mods[0]}); add them to lora.targets or use a LoRA made for these targets"
        )
    missing = sorted(set(params) - set(sd))
    if missing:
        mods = modules(missing)
        if set(mods) <= set(modules(sd)):
            raise LoraError(
                f"the file has no {missing[0]}, which adapters of this lora.type / lora.rank have; set "
                "lora.type (lora, dora, lokr) and lora.rank to the file's"
            )
        raise LoraError(
            f"the LoRA has no tensors for {len(mods)} adapted module(s) (e.g. {mods[0]}); set "
            "lora.targets to the targets the file was made for"
        )
    for k, p in params.items():  # model order: the first mismatch named is the first layer's
        t = sd[k]
        shape = tuple(getattr(p, "ds_shape", p.shape))
        if tuple(t.shape) != shape:
            raise LoraError(
                f"LoRA tensor {k} has shape {tuple(t.shape)} in the file but {shape} in the model; the "
                "file was made for another model shape or rank: set lora.rank to the file's or use a LoRA "
                "made for this model"
            )
    with torch.no_grad():
        for k, t in sd.items():
            params[k].copy_(t)


def base_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The base model's state dict in our (BFL) names, adapters left out: what weights.save_weights takes."""
    return {
        k.replace(".base_layer.", "."): v
        for k, v in model.state_dict().items()
        if not canonical_adapter_name(k, ADAPTER)
    }
