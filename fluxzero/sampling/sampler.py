"""Euler sampling of FLUX.1 from text embeddings: noise -> latents, with the model the caller holds.

`sample` is the one entry point, for `fluxzero sample` and for the trainer's in-run previews alike: it
takes a Flux (or anything with Flux.forward's signature and a `.config`), puts it in eval mode under
no_grad for the call and restores its mode afterwards. The numbers follow diffusers' FluxPipeline step
for step (tests/sampling/test_sampling.py compares them): the same noise for the same seed, the same time grid,
the same Euler update and true-CFG combination.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from ..model.math import ATTENTION_BACKENDS
from ..model.packing import img_ids as make_img_ids
from ..model.packing import pack, reference_ids, unpack
from .schedule import image_tokens
from .schedule import sigmas as make_sigmas

LATENT_CHANNELS = 16
# callback(step, steps, sigma, latents): after each Euler step; step counts from 1, sigma is the new time,
# latents are the packed tokens (B, HW/256, 64). For progress bars and for watching a sample form.
StepCallback = Callable[[int, int, float, Tensor], None]


def check_size(height: int, width: int) -> None:
    """FLUX.1 images are multiples of 16 pixels on each side (8x VAE, then 2x2 patches)."""
    for name, v in (("height", height), ("width", width)):
        if v < 16 or v % 16:
            raise ValueError(f"{name} must be a positive multiple of 16 pixels, got {v}; use {size_hint(v)}")


def size_hint(v: int) -> str:
    """The multiples of 16 around v, for error messages."""
    lo = v // 16 * 16
    return "16" if lo == 0 else f"{lo} or {lo + 16}"


def initial_noise(
    batch: int,
    height: int,
    width: int,
    *,
    seed: int | Sequence[int] | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Tensor:
    """The starting noise FluxPipeline.prepare_latents draws for the same generator(s).

    A list of seeds (or generators) gives each image its own stream, so an image's noise depends only on
    its seed, not on the batch it is sampled in; one int seed (or one generator) draws the whole batch
    from one stream, as FluxPipeline(generator=torch.Generator().manual_seed(seed)) does. Seeds use CPU
    generators, so a seed gives the same noise on any device. Drawn directly in `dtype`, as diffusers
    draws it in the prompt embeddings' dtype (the transformer's dtype in a standard pipeline).
    Shape: -> (B, 16, H/8, W/8)
    """
    check_size(height, width)
    if (seed is None) == (generator is None):
        raise ValueError("pass exactly one of seed and generator (or give the noise itself)")
    if seed is not None:
        generator = (
            [torch.Generator().manual_seed(int(s)) for s in seed]
            if isinstance(seed, Sequence)
            else torch.Generator().manual_seed(int(seed))
        )
    shape = (batch, LATENT_CHANNELS, height // 8, width // 8)
    if isinstance(generator, Sequence):
        if len(generator) != batch:
            raise ValueError(f"got {len(generator)} seeds or generators for {batch} images; give one per image")
        if len(generator) == 1:  # diffusers treats a list of one as a single generator
            generator = generator[0]
        else:
            return torch.cat(
                [torch.randn((1, *shape[1:]), generator=g, device=g.device, dtype=dtype) for g in generator]
            ).to(device)
    return torch.randn(shape, generator=generator, device=generator.device, dtype=dtype).to(device)


def _batch_rows(t: Tensor, batch: int, name: str) -> Tensor:
    if t.shape[0] == batch:
        return t
    if t.shape[0] == 1:  # one negative prompt for every image
        return t.expand(batch, *t.shape[1:])
    raise ValueError(f"{name} has {t.shape[0]} rows for {batch} images; give one row per image or a single row")


def _model_sdpa_flags(model):
    """torch's SDPA flags set to what the model's attention allows, for the whole loop: each attention call
    then finds them matching and skips its own `sdpa_kernel` (fluxzero.model.math.attention; ~60 calls a
    step). The same kernels either way, so the same numbers; the flags are restored after the loop, so the
    VAE decode and anything else outside it see the process's own."""
    name = getattr(model, "attention", None)
    if name not in ATTENTION_BACKENDS:  # not a Flux (a wrapper, a stand-in): the blocks choose per call
        return contextlib.nullcontext()
    return sdpa_kernel(ATTENTION_BACKENDS[name])


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    txt: Tensor,
    y: Tensor,
    *,
    height: int,
    width: int,
    steps: int,
    guidance: float = 3.5,
    seed: int | Sequence[int] | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    txt_ids: Tensor | None = None,
    true_cfg: float = 1.0,
    neg_txt: Tensor | None = None,
    neg_y: Tensor | None = None,
    noise: Tensor | None = None,
    shift: bool | None = None,
    callback: StepCallback | None = None,
    reference: Tensor | None = None,
) -> Tensor:
    """Sample B images' latents from text embeddings with `steps` Euler steps.

    txt: T5 embeddings (B, L, context_in_dim); y: CLIP pooled (B, vec_in_dim); txt_ids (B, L, 3), default
    zeros (FLUX.1 gives text no position). Keyword-only after y, so the optional txt_ids need no
    placeholder. Noise: `noise` (B, 16, H/8, W/8) as given, else drawn by `initial_noise` from `seed` or
    `generator`. `guidance` feeds the guidance embedding of guidance-distilled models (dev) and is
    ignored by models without one (schnell). `true_cfg` > 1 with `neg_txt`/`neg_y` (one row, or one per
    image) runs real classifier-free guidance as diffusers' true_cfg_scale: v = v_neg + s (v - v_neg),
    both halves in one batched model call. `shift`: resolution-shifted grid, default on for models that
    embed guidance (dev) and off otherwise (schnell), as FLUX.1's released schedulers do.
    `reference` (one row, or one per image; 16 channels, scaled as the VAE encoder's output, any size that packs):
    a FLUX.1 Kontext model edits it. Its tokens follow the target's in every model call (reference ids: 1 on the
    first axis), the velocity is read off the target's tokens and the schedule counts the target's alone, as
    diffusers' FluxKontextPipeline does; without one a Kontext model samples from text alone.
    Shape: -> latents (B, 16, H/8, W/8) in the model's dtype, still scaled (decode with sampling.vae).
    """
    check_size(height, width)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    cfg = model.config
    b = txt.shape[0]
    if txt.ndim != 3 or y.ndim != 2 or y.shape[0] != b:
        raise ValueError(
            f"txt must be (B, L, D) and y (B, V) with the same B; got {tuple(txt.shape)} and {tuple(y.shape)}"
        )
    h, w = height // 8, width // 8
    if noise is None:
        noise = initial_noise(b, height, width, seed=seed, generator=generator, dtype=dtype, device=device)
    elif tuple(noise.shape) != (b, LATENT_CHANNELS, h, w):
        raise ValueError(f"noise must be (B, 16, H/8, W/8) = {(b, LATENT_CHANNELS, h, w)}, got {tuple(noise.shape)}")
    if txt_ids is None:
        txt_ids = torch.zeros(b, txt.shape[1], 3)

    do_cfg = true_cfg > 1
    if do_cfg:
        if neg_txt is None or neg_y is None:
            raise ValueError("true_cfg > 1 needs a negative prompt: pass neg_txt and neg_y (or set true_cfg to 1)")
        neg_txt, neg_y = _batch_rows(neg_txt, b, "neg_txt"), _batch_rows(neg_y, b, "neg_y")
        if neg_txt.shape[1:] != txt.shape[1:]:
            raise ValueError(
                f"neg_txt {tuple(neg_txt.shape[1:])} and txt {tuple(txt.shape[1:])} must have the same "
                f"length and width; pad both prompts to the same T5 length"
            )
        # conditional and negative halves go through the model as one batch of 2B
        txt, y, txt_ids = torch.cat([txt, neg_txt]), torch.cat([y, neg_y]), torch.cat([txt_ids, txt_ids])
    rows = txt.shape[0]
    ids = make_img_ids(rows, h, w, device=device)  # float32: positions stay exact in any dtype
    ref_tokens = None
    if reference is not None:
        if not cfg.kontext:
            raise ValueError(
                f"model {cfg.name!r} is not FLUX.1 Kontext, so it takes no reference image; sample a "
                f"Kontext model (flux-kontext-dev) or leave the reference out"
            )
        if (
            reference.ndim != 4
            or reference.shape[1] != LATENT_CHANNELS
            or reference.shape[2] % 2
            or reference.shape[3] % 2
        ):
            raise ValueError(f"reference must be latents (B, 16, h, w) with even h and w, got {tuple(reference.shape)}")
        reference = _batch_rows(reference, b, "reference")
        reference = torch.cat([reference, reference]) if do_cfg else reference
        ref_tokens = pack(reference.to(device, dtype))  # (rows, hw/4, 64)
        ids = torch.cat([ids, reference_ids(rows, *reference.shape[2:], device=device)], dim=1)
    inputs = {
        "img_ids": ids,
        "txt": txt.to(device, dtype),
        "txt_ids": txt_ids.to(device, torch.float32),
        "y": y.to(device, dtype),
        # diffusers: torch.full(guidance_scale) in float32 for guidance-embedding models, None otherwise
        "guidance": torch.full((rows,), float(guidance), device=device) if cfg.guidance_embed else None,
    }
    sig = make_sigmas(steps, image_tokens(height, width), shift=cfg.guidance_embed if shift is None else shift)
    sig_dev = sig.to(device)

    was_training = model.training
    model.eval()
    try:
        with _model_sdpa_flags(model):
            x = pack(noise.to(device, dtype))  # (B, HW/256, 64)
            for i in range(steps):
                # timesteps in float32, as the trainer feeds them (diffusers and BFL round t to the model dtype
                # first; in bf16 that moves t by up to 0.4%, so here bf16 sampling differs from theirs in that)
                t = sig_dev[i].expand(rows)
                img = torch.cat([x, x]) if do_cfg else x
                if ref_tokens is not None:  # Kontext: reference tokens after the target's; keep the target's output
                    img = torch.cat([img, ref_tokens], dim=1)
                v = model(img=img, timesteps=t, **inputs)[:, : x.shape[1]]  # (rows, HW/256, 64)
                if do_cfg:
                    v_pos, v_neg = v.chunk(2)
                    v = v_neg + true_cfg * (v_pos - v_neg)
                # diffusers' Euler step: the state upcast to float32, dt (float32 scalar) * v in v's dtype, then
                # back to the model dtype, so bf16 runs round where theirs do
                x = (x.float() + (sig_dev[i + 1] - sig_dev[i]) * v).to(v.dtype)
                if callback is not None:
                    callback(i + 1, steps, float(sig[i + 1]), x)
    finally:
        model.train(was_training)
    return unpack(x, h, w)  # (B, 16, H/8, W/8)
