"""Latents -> pixels with FLUX.1's autoencoder (a local diffusers AutoencoderKL folder)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from ..data.encode import check_model_folder, latent_factors
from ..data.errors import DataError

VAE_LAYOUT = "a diffusers AutoencoderKL folder (config.json and .safetensors), e.g. FLUX.1's vae/"


def load_vae(path: str | os.PathLike, *, device="cpu", dtype: torch.dtype = torch.float32):
    """AutoencoderKL from a local folder, eval mode; a missing or wrong folder -> DataError (one sentence)."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"VAE folder {path} does not exist; pass --vae {VAE_LAYOUT}.")
    if not (path / "config.json").exists():
        raise DataError(f"{path} has no config.json, so it is not {VAE_LAYOUT}; pass the right folder to --vae.")
    check_model_folder("vae", path, "diffusers AutoencoderKL folder", f"--vae {path}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import AutoencoderKL

    try:
        vae = AutoencoderKL.from_pretrained(
            path, torch_dtype=dtype, local_files_only=True, use_safetensors=True, low_cpu_mem_usage=False
        )
    except (OSError, ValueError) as e:
        raise DataError(
            f"could not load the VAE from {path} ({str(e).splitlines()[0]}); pass --vae {VAE_LAYOUT}."
        ) from None
    if vae.config.latent_channels != 16:
        raise DataError(
            f"{path} has {vae.config.latent_channels} latent channels but FLUX.1 needs 16; use FLUX's vae/ folder."
        )
    return vae.to(device).eval()


@torch.no_grad()
def decode(vae, latents: Tensor) -> Tensor:
    """Scaled latents (what `sample` returns) -> uint8 RGB images, as FluxPipeline's decode + postprocess:
    z / scaling_factor + shift_factor, VAE decode, [-1, 1] -> [0, 1] clamped, * 255 rounded.

    Shape: (B, 16, H/8, W/8) -> (B, H, W, 3) uint8 on CPU
    """
    scale, shift = latent_factors(vae)
    p = next(vae.parameters())
    out = []
    for z in latents:  # one image at a time: the decoder's activations at 1024 px are several GB each
        z = z[None].to(p.device, p.dtype) / scale + shift
        img = vae.decode(z, return_dict=False)[0]  # (1, 3, H, W) in about [-1, 1]
        img = (img.float() / 2 + 0.5).clamp(0, 1)
        out.append((img * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu())
    return torch.cat(out)


@torch.no_grad()
def encode_reference(vae, path: str | os.PathLike, *, height: int, width: int) -> Tensor:
    """A FLUX.1 Kontext reference for `sample`: an image resized to cover (height, width) and center-cropped
    (as `fluxzero cache` puts a reference into its target's bucket), encoded to the posterior's mode and
    scaled as the trainer's latents; or a .safetensors file holding such latents under "latents" as they are.
    DataError (one sentence naming the file) when it cannot be read.

    Shape: -> (1, 16, h, w): height/8 x width/8 for an image, the file's own size for latents
    """
    from ..data.images import load_bucketed

    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            z = load_file(str(path))["latents"].float()
        except Exception as e:  # noqa: BLE001 - unreadable file or no such key: the same fix
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(
                f"reference {path} holds no readable latents tensor ({why}); save the scaled VAE latents "
                f"(16, h, w) under the key 'latents', or pass an image."
            ) from None
        z = z[None] if z.ndim == 3 else z
        if z.ndim != 4 or z.shape[:2] != (1, 16) or z.shape[2] % 2 or z.shape[3] % 2:
            raise DataError(
                f"reference {path} holds latents of shape {tuple(z.shape)}; save one (16, h, w) tensor "
                f"with even h and w."
            )
        return z
    try:
        pixels = load_bucketed(path, (height, width), flip=False)  # (3, H, W) in [-1, 1]
    except Exception as e:  # noqa: BLE001 - any unreadable image: one sentence
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"reference image {path} cannot be read ({why}); pass a PNG, JPEG or WebP image.") from None
    scale, shift = latent_factors(vae)
    p = next(vae.parameters())
    z = vae.encode(pixels[None].to(p.device, p.dtype)).latent_dist.mode()  # diffusers' Kontext: sample_mode="argmax"
    return ((z - shift) * scale).float().cpu()
