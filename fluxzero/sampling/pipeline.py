"""Prompts x seeds -> PNG files: the loop `fluxzero sample` runs, public so training previews write the same files."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..model import compile as block_compile  # the module: tests swap its apply_compile
from ..model.math import check_attention_backend
from .embeddings import PromptEmbeddings
from .images import grid, save_png
from .sampler import sample
from .schedule import image_tokens
from .vae import decode

PNG_THREADS = min(4, os.cpu_count() or 1)  # a batch's PNGs and the grid at once; more buys nothing at 4 images


def sample_images(
    model,
    vae,
    emb: PromptEmbeddings,
    out_dir: str | Path | None,
    *,
    width: int,
    height: int,
    steps: int,
    seeds: Sequence[int],
    guidance: float = 3.5,
    true_cfg: float = 1.0,
    batch_size: int = 1,
    weights: str | None = None,
    lora: dict | None = None,
    on_step: Callable[[], None] | None = None,
    write_grid: bool = True,
    reference: torch.Tensor | None = None,
    reference_path: str | None = None,
) -> list[Path]:
    """Sample every prompt once per seed, write NNNN-pP-sS.png files (parameters in their text chunks) and
    grid.png (a row per prompt, a column per seed; not with write_grid=False) into out_dir; return the PNG
    paths in order. `lora` (the LoRA merged into `model`: its path, layout, scale, ...) goes into the
    parameters as it is.

    Each image's noise comes from its own seed, so the files do not depend on batch_size. The negative
    prompt of `emb` is used when true_cfg > 1. `on_step()` is called after every Euler step of every
    batch (len(prompts) * len(seeds) / batch_size * steps calls, rounded up per batch), for progress bars.
    `reference` (1, 16, h, w): the scaled latents a FLUX.1 Kontext model edits in every image (`reference_path`,
    recorded in the PNGs, names where it came from).
    Under ZeRO-3 every rank must call this with the same arguments (the forward gathers parameters
    collectively); the others pass out_dir=None (and may pass vae=None): they run the model's forward passes
    and decode, write and return nothing.

    The PNGs are encoded in a few threads (Pillow's encoder releases the GIL) while the next batch samples, so
    only the last batch's PNGs and the grid wait at the end (lossless, Pillow's default level; what they cost:
    benchmarks/RESULTS.md, "Figures behind code choices").
    """
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    cfg_on = true_cfg > 1
    if cfg_on and not emb.has_negative:
        raise ValueError("true_cfg > 1 needs a negative prompt in the embeddings; encode one with the prompts")
    jobs = [(p, s) for p in range(len(emb.prompts)) for s in seeds]  # row per prompt, column per seed
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    images, pending = [], []
    with ThreadPoolExecutor(max_workers=PNG_THREADS) as pool:
        for start in range(0, len(jobs), batch_size):
            batch = jobs[start : start + batch_size]
            rows = torch.tensor([p for p, _ in batch])
            latents = sample(
                model,
                emb.t5[rows],
                emb.clip_pooled[rows],
                height=height,
                width=width,
                steps=steps,
                guidance=guidance,
                seed=[s for _, s in batch],
                true_cfg=true_cfg,
                neg_txt=emb.neg_t5 if cfg_on else None,
                neg_y=emb.neg_clip_pooled if cfg_on else None,
                callback=(lambda *_: on_step()) if on_step else None,
                reference=reference,
            )
            if out_dir is None:  # a ZeRO-3 peer: its part was the forward passes
                continue
            for (p, s), image in zip(batch, decode(vae, latents)):
                params = {
                    "prompt": emb.prompts[p],
                    "negative_prompt": emb.negative_prompt if cfg_on else None,
                    "seed": s,
                    "steps": steps,
                    "guidance": guidance if cfg.guidance_embed else None,
                    "true_cfg": true_cfg if cfg_on else None,
                    "width": width,
                    "height": height,
                    "model": cfg.name,
                    "weights": weights,
                    "sampler": "euler",
                    "dtype": dtype,
                }
                if lora is not None:
                    params["lora"] = lora
                if reference is not None:
                    params["reference"] = reference_path
                pending.append(pool.submit(save_png, image, out_dir / f"{len(pending):04d}-p{p}-s{s}.png", params))
                if write_grid:
                    images.append(image)
        if out_dir is not None and write_grid:
            pool.submit(
                lambda: grid(images, cols=len(seeds)).save(out_dir / "grid.png")
            ).result()  # beside the last PNGs
        return [f.result() for f in pending]  # in order; a failed write raises here


# --compile auto: compiling FLUX.1's blocks costs seconds once (again for a new batch shape) and saves a fixed share of
# every model call's pointwise work, which grows with the image tokens: it pays off from about this many
# image-steps at 1024 x 1024 px (4096 image tokens) on one GPU (the compile time and the time saved an image a step:
# benchmarks/RESULTS.md, "The 48 GB full fine-tune's steady state, ...", the sampling rows)
COMPILE_PAYS_OFF_IMAGE_STEPS = 256
AUTO_BATCH = 4  # images per model call at --batch-size auto on a GPU (a forward pass keeps no activations)


def auto_speed(
    device_type: str, images: int, steps: int, tokens: int, batch_size: int | None, compile: bool | None
) -> tuple[int, bool]:
    """`fluxzero sample`'s --batch-size auto (None) and --compile auto (None) -> (batch_size, compile); `tokens`:
    the image tokens of one image's model call (a FLUX.1 Kontext reference's included).

    On a GPU: compile when the image-steps, weighted by image tokens, reach COMPILE_PAYS_OFF_IMAGE_STEPS; batch up
    to AUTO_BATCH images a call, and when compiling the largest batch that divides the images (a smaller last
    batch would compile again). On the CPU: one image a call, eager (a compile there takes longer than it saves
    on the test models this runs)."""
    gpu = device_type == "cuda"
    if compile is None:
        compile = gpu and images * steps * tokens >= COMPILE_PAYS_OFF_IMAGE_STEPS * image_tokens(1024, 1024)
    if batch_size is None:
        if not gpu:
            batch_size = 1
        elif compile:
            batch_size = max(b for b in range(1, min(AUTO_BATCH, images) + 1) if images % b == 0)
        else:
            batch_size = min(AUTO_BATCH, images)
    return batch_size, compile


def prepare_model(model, *, attention: str | None = None, compile: bool = False, backend: str = "inductor") -> None:
    """What `fluxzero sample --attention/--compile` does to the loaded model before sampling, in place:
    `attention` (None: leave the model's) switches every block's SDPA backend (Flux.set_attention); `compile`
    compiles every block with the trainer's helper (fluxzero.model.compile.apply_compile: one graph per block
    class, compiled at the first call, again for each new batch shape). `backend`:
    Dynamo's, as the trainer's `compile.backend` (`eager` / `aot_eager` only for tests and debugging)."""
    if attention is not None:
        model.set_attention(check_attention_backend(attention))
    if compile:
        block_compile.apply_compile(model, backend=backend)
