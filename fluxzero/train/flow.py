"""Rectified flow for FLUX.1: noising, targets, timestep sampling and shift.

Small pure functions on tensors; `prepare_batch` strings them together (with the model's input format,
fluxzero.model.packing: 2x2 packing and position ids) for the training loop.
Convention (BFL / SD3): t = 0 is data, t = 1 is noise, x_t = (1 - t) x0 + t noise, and the model
predicts the velocity dx_t/dt = noise - x0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fluxzero.model.packing import img_ids, pack, txt_ids, with_reference

TIMESTEP_SAMPLING = ("uniform", "logit_normal")
SHIFTS = ("none", "fixed", "resolution")


# ---------------------------------------------------------------------------------------------------------
# Flow matching
# ---------------------------------------------------------------------------------------------------------
def _bcast(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *([1] * (x.dim() - 1))).to(x.dtype)


def noisy(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t noise, with t (B,) broadcast over the other dims."""
    t = _bcast(t, x0)
    return (1 - t) * x0 + t * noise


def target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Velocity the model learns: d x_t / dt = noise - x0."""
    return noise - x0


def loss(pred: torch.Tensor, tgt: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error in fp32 (bf16 predictions are upcast so the reduction does not lose bits).

    weight (B, L), from `loss_weights`, scales each token's squared errors before the mean (the mean is still
    over every element, so a token of weight 0 adds nothing and a half-masked image counts half); None is the
    plain mean, bit for bit. Shape: pred (B, L + R, C), tgt (B, L, C): a FLUX.1 Kontext prediction also holds
    its R reference tokens, after the target's, and the loss covers the target's tokens only.
    """
    pred = target_tokens(pred, tgt)
    if weight is None:
        return F.mse_loss(pred.float(), tgt.float())
    return ((pred.float() - tgt.float()).square() * weight.to(pred.device, torch.float32)[..., None]).mean()


def target_tokens(pred: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """The prediction of the target's tokens: the first L of a FLUX.1 Kontext output (reference tokens follow).

    Shape: pred (B, L + R, C), tgt (B, L, C) -> (B, L, C)
    """
    return pred if pred.shape[1] == tgt.shape[1] else pred[:, : tgt.shape[1]]


def loss_weights(batch: dict, mask_floor: float = 0.0) -> torch.Tensor | None:
    """Per-token loss weights of a batch: its cached masks (a masked-out token weighs `mask_floor`, flow.mask_floor)
    times its datasets' loss weights; None when the batch has neither, so `loss` is the plain mean.

    Shape: batch["mask"] (B, H/2, W/2) in `pack`'s row-major patch order, batch["loss_weight"] (B,) -> (B, HW/4).
    """
    mask, per_sample = batch.get("mask"), batch.get("loss_weight")
    if mask is None and per_sample is None:
        return None
    b, _, h, w = batch["latents"].shape
    weight = torch.ones(b, (h // 2) * (w // 2))
    if mask is not None:
        weight = mask_floor + (1.0 - mask_floor) * mask.float().reshape(b, -1)
    if per_sample is not None:
        weight = weight * per_sample.float()[:, None]
    return weight


def sample_losses(pred: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """`loss` per sample (target tokens only, as `loss`). Shape: pred (B, L + R, C), tgt (B, L, C) -> (B,) fp32."""
    pred = target_tokens(pred, tgt)
    return (pred.float() - tgt.float()).square().flatten(1).mean(1)


def sample_timesteps(
    n: int, sampling: str = "uniform", mean: float = 0.0, std: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Draw n timesteps in (0, 1): uniform, or logit-normal (sigmoid of N(mean, std), SD3 section 3.1)."""
    if sampling == "uniform":
        return torch.rand(n, generator=generator)
    if sampling == "logit_normal":
        return torch.sigmoid(mean + std * torch.randn(n, generator=generator))
    raise ValueError(f"unknown timestep sampling {sampling!r}; choose one of {TIMESTEP_SAMPLING}")


def time_shift(t: torch.Tensor, mu: float) -> torch.Tensor:
    """t' = e^mu / (e^mu + 1/t - 1): pushes t toward noise for mu > 0 (equals s t / (1 + (s-1) t), s = e^mu)."""
    em = math.exp(mu)
    return em / (em + 1 / t - 1)


def resolution_mu(
    image_tokens: int, base_tokens: int = 256, max_tokens: int = 4096, base_shift: float = 0.5, max_shift: float = 1.15
) -> float:
    """mu linear in the number of packed image tokens: 256 -> 0.5, 4096 -> 1.15 (BFL's schedule)."""
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    return base_shift + slope * (image_tokens - base_tokens)


def shift_timesteps(t: torch.Tensor, shift: str, image_tokens: int, shift_value: float = 3.0) -> torch.Tensor:
    """Apply no shift, a fixed shift factor s (mu = ln s), or the resolution-dependent shift."""
    if shift == "none":
        return t
    if shift == "fixed":
        return time_shift(t, math.log(shift_value))
    if shift == "resolution":
        return time_shift(t, resolution_mu(image_tokens))
    raise ValueError(f"unknown timestep shift {shift!r}; choose one of {SHIFTS}")


# ---------------------------------------------------------------------------------------------------------
# Batch -> model inputs
# ---------------------------------------------------------------------------------------------------------
def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample's noise and timestep (splitmix64 of seed, epoch, index)."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & (2**63 - 1)


def draw_noise(
    latents: torch.Tensor, index: torch.Tensor, seed: int, epoch: int, cfg
) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise (B, C, H, W) and timesteps (B,) on CPU, drawn per sample from (seed, epoch, sample index).

    Why per sample: each data-parallel rank must draw different noise and timesteps (same-seeded ranks
    would repeat one noise pattern and one t across the whole global batch). Keying the generator on the
    sample also keeps the draws independent of world size, micro batch and accumulation, so those layouts
    train on identical numbers (the parity tests rely on it) and resume needs no generator state.
    """
    b, c, h, w = latents.shape
    noise = torch.empty(b, c, h, w)
    t = torch.empty(b)
    g = torch.Generator()
    for i, idx in enumerate(index.tolist()):
        g.manual_seed(sample_seed(seed, epoch, idx))
        t[i] = sample_timesteps(1, cfg.timestep_sampling, cfg.logit_mean, cfg.logit_std, generator=g)[0]
        noise[i] = torch.randn(c, h, w, generator=g)
    t = shift_timesteps(t, cfg.shift, image_tokens=(h // 2) * (w // 2), shift_value=cfg.shift_value)
    return noise, t


def prepare_batch(
    batch: dict,
    cfg,
    seed: int,
    epoch: int,
    *,
    guidance_embed: bool,
    device=None,
    dtype: torch.dtype = torch.float32,
    timesteps: torch.Tensor | None = None,
) -> tuple[dict, torch.Tensor]:
    """Turn a data batch into Flux.forward keyword arguments and the velocity target.

    timesteps (B,), when given, replace the drawn (and shifted) ones: validation evaluates fixed t values.

    batch: {"latents": (B,16,H,W), "t5": (B,L,D), "clip": (B,V), "index": (B,)}; cfg: a FlowConfig.
    Shape: -> inputs {img (B,HW/4,64), img_ids (B,HW/4,3), txt (B,L,D), txt_ids (B,L,3), timesteps (B,),
    y (B,V), guidance (B,) or None}, target (B,HW/4,64) in fp32.
    A FLUX.1 Kontext batch also holds "reference": (B,16,h,w), the clean reference latents; their tokens follow
    the noisy target's in img and img_ids (packing.with_reference), and the target stays the target's alone.
    """
    x0 = batch["latents"].float()
    b, _, h, w = x0.shape
    noise, t = draw_noise(x0, batch["index"], seed, epoch, cfg)
    if timesteps is not None:
        t = timesteps.float().expand(b).clone()
    x_t = pack(noisy(x0, noise, t))  # (B, HW/4, 64)
    tgt = pack(target(x0, noise))  # (B, HW/4, 64)

    def dev(x: torch.Tensor, to_dtype: torch.dtype | None = dtype) -> torch.Tensor:
        # Copy first (asynchronous from pinned memory), cast on the device: casting the T5 embeddings on the
        # host is a single-threaded pass over ~8 MB per sample, a large part of a GPU step (benchmarks/RESULTS.md).
        return x.to(device, non_blocking=True).to(to_dtype)

    ids = img_ids(b, h, w)
    if "reference" in batch:
        x_t, ids = with_reference(x_t, ids, batch["reference"].float())
    txt = batch["t5"]
    inputs = {
        "img": dev(x_t),
        "img_ids": dev(ids, torch.float32),  # positions stay exact whatever the model dtype
        "txt": dev(txt),
        "txt_ids": dev(txt_ids(b, txt.shape[1]), torch.float32),
        "timesteps": dev(t, torch.float32),  # the model embeds t in float32; rounding t to bf16 would not help
        "y": dev(batch["clip"]),
        # FLUX.1-dev is guidance distilled: it needs a guidance value. A constant keeps the distilled
        # behaviour stable while the velocity target itself is the plain conditional one (no CFG in it).
        "guidance": torch.full((b,), cfg.guidance, device=device, dtype=torch.float32) if guidance_embed else None,
    }
    return inputs, dev(tgt, torch.float32)
