"""FLUX.1's input format for image latents: 2x2 patch packing and the position ids of image and text tokens.

One definition shared by training (fluxzero.train.flow.prepare_batch) and inference (fluxzero.sampling.sampler);
tests check it against diffusers' FluxPipeline bit for bit.
"""

from __future__ import annotations

import torch


def pack(latents: torch.Tensor) -> torch.Tensor:
    """Fold 2x2 latent patches into channels, row-major over patches.

    Shape: (B, C, H, W) -> (B, H/2 * W/2, C*4)  [FLUX: C=16 -> 64 channels]
    """
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"latent height and width must be even to pack 2x2 patches, got {h}x{w}")
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2)  # b c h ph w pw
    x = x.permute(0, 2, 4, 1, 3, 5)  # b h w c ph pw
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of `pack`; height and width are the latent (not token) sizes.

    Shape: (B, H/2 * W/2, C*4) -> (B, C, H, W)
    """
    b, n, d = tokens.shape
    h, w = height // 2, width // 2
    if n != h * w or d % 4:
        raise ValueError(f"cannot unpack {n} tokens of width {d} into a {height}x{width} latent")
    x = tokens.reshape(b, h, w, d // 4, 2, 2)  # b h w c ph pw
    x = x.permute(0, 3, 1, 4, 2, 5)  # b c h ph w pw
    return x.reshape(b, d // 4, height, width)


def img_ids(batch: int, height: int, width: int, device=None) -> torch.Tensor:
    """Position ids of packed image tokens: (0, row, col) of each 2x2 patch, row-major like `pack`.

    Shape: -> (B, H/2 * W/2, 3)
    """
    h, w = height // 2, width // 2
    ids = torch.zeros(h, w, 3, device=device)
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None, :]
    return ids.reshape(1, h * w, 3).expand(batch, -1, -1)


def txt_ids(batch: int, length: int, device=None) -> torch.Tensor:
    """Text tokens carry no position in FLUX.1's RoPE: all-zero ids.

    Shape: -> (B, L, 3)
    """
    return torch.zeros(batch, length, 3, device=device)


def reference_ids(batch: int, height: int, width: int, device=None) -> torch.Tensor:
    """Position ids of a FLUX.1 Kontext reference image's packed tokens: its own (row, col) grid, as `img_ids`,
    with 1 on the first axis (the target's tokens have 0 there), as diffusers' FluxKontextPipeline sets them.

    Shape: -> (B, H/2 * W/2, 3)
    """
    ids = img_ids(batch, height, width, device).clone()
    ids[..., 0] = 1
    return ids


def with_reference(img: torch.Tensor, ids: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX.1 Kontext's image input: the reference latents' packed tokens and ids appended after the target's.

    The model's output keeps this order, so its first N tokens are the target's prediction.
    Shape: img (B, N, C*4), ids (B, N, 3), reference (B, C, h, w) -> (B, N + hw/4, C*4), (B, N + hw/4, 3)
    """
    b, _, h, w = reference.shape
    ref_ids = reference_ids(b, h, w, ids.device).to(ids.dtype)
    return torch.cat((img, pack(reference).to(img.dtype)), dim=1), torch.cat((ids, ref_ids), dim=1)
