"""`fluxzero cache`: encode a folder of images and captions into training shards."""

from __future__ import annotations

import json

import click

from fluxzero.commands import options
from fluxzero.commands.options import Finite
from fluxzero.config.run import MAX_SEED

_DIR = options.DIR
# import name -> pip name of what `fluxzero cache` needs beyond the trainer (setup.cfg's [cache] extra)
_NEEDS = {
    "torch": "torch",
    "numpy": "numpy",
    "safetensors": "safetensors",
    "tqdm": "tqdm",
    "PIL": "Pillow",
    "transformers": "transformers",
    "diffusers": "diffusers",
}


def check_dependencies(command: str = "fluxzero cache", without: tuple[str, ...] = ()) -> None:
    """One sentence naming the cache extra when a package `command` needs is missing (`without`: import names
    it does not need)."""
    import importlib.util

    missing = [pip for mod, pip in _NEEDS.items() if mod not in without and importlib.util.find_spec(mod) is None]
    if missing:
        raise click.ClickException(
            f"{command} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
            f"not installed; install them with pip install -e '.[cache]'."
        )


@click.command("cache")
@click.argument("images_dir", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.argument("out_dir", type=_DIR)
@click.option(
    "--variant",
    type=click.Choice(["dev", "schnell"]),
    default="dev",
    show_default=True,
    help="FLUX.1 variant: sets the T5 length (dev 512 tokens, schnell 256).",
)
@options.encoders("T5 tokens per caption (padded); overrides the variant's length.")
@click.option(
    "--resolution",
    type=click.IntRange(min=16),
    default=1024,
    show_default=True,
    help="Bucket pixel area is at most RESOLUTION squared; a multiple of 16.",
)
@click.option(
    "--min-side",
    type=click.IntRange(min=16),
    default=None,
    help="Smallest bucket side in pixels, a multiple of --bucket-step  [default: resolution/4, rounded down to the step].",
)
@click.option(
    "--max-aspect",
    type=Finite(min=1.0, example="a ratio such as 4"),
    default=4.0,
    show_default=True,
    help="Largest bucket aspect ratio (long side / short side).",
)
@click.option(
    "--bucket-step",
    type=click.IntRange(min=16),
    default=None,
    help="Bucket sides are multiples of this many pixels (a multiple of 16); larger means fewer buckets (64: 33 at "
    "1024 px, 16: 129)  [default: 64 where it divides a --resolution of 256 or more, else 16; a folder cached before "
    "keeps its step].",
)
@click.option(
    "--min-image-side",
    type=click.IntRange(min=0),
    default=None,
    help="Skip (and report) images whose shorter side is below this many pixels; 0 keeps all  [default: half the smallest bucket side].",
)
@click.option(
    "--flip",
    type=click.Choice(["none", "random", "both"]),
    default="none",
    show_default=True,
    help="Horizontal flip: none, a seeded coin per image, or both copies (doubles the samples).",
)
@click.option(
    "--caption-dropout",
    type=Finite(0.0, 1.0, max_open=True, example="a share such as 0.1"),
    default=0.0,
    show_default=True,
    help="Share of samples stored with the empty caption (its embedding is encoded once).",
)
@click.option(
    "--captions",
    "caption_file",
    type=click.Path(exists=True, dir_okay=False, path_type=str),
    default=None,
    help="metadata .jsonl/.csv mapping file names to captions  [default: IMAGES_DIR/metadata.jsonl or .csv, else same-name .txt].",
)
@click.option(
    "--caption-prefix",
    default="",
    show_default=False,
    help="Text put before every caption, e.g. a trigger word with its separator ('ohwx person, '); images without a caption get it alone.",
)
@click.option(
    "--mask-from-alpha",
    is_flag=True,
    default=False,
    help="Use an image's alpha channel as its loss mask (opaque trains) where it has no NAME.mask.png.",
)
@click.option(
    "--latent",
    type=click.Choice(["mode", "sample"]),
    default="mode",
    show_default=True,
    help="Cache the VAE posterior's mode, or one seeded sample of it.",
)
@click.option("--shard-size", type=click.IntRange(min=1), default=64, show_default=True, help="Samples per shard.")
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Images per encoder batch."
)
@click.option(
    "--seed",
    type=click.IntRange(0, MAX_SEED),
    default=0,
    show_default=True,
    help="Seed of flip, caption-dropout and VAE-sample draws.",
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="Encoder device: auto = cuda:LOCAL_RANK (or SLURM_LOCALID) when a GPU is present, else cpu.",
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "bf16", "fp32"]),
    default="auto",
    show_default=True,
    help="Encoder precision and shard dtype: auto = bf16 on GPU, fp32 on CPU.",
)
@click.option(
    "--rank",
    type=click.IntRange(min=0),
    default=None,
    help="This process's part of the work  [default: env RANK or SLURM_PROCID, else 0].",
)
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    default=None,
    help="Number of processes sharing the work  [default: env WORLD_SIZE or SLURM_NTASKS, else 1].",
)
def cache(  # noqa: C901
    images_dir,
    out_dir,
    flux_dir,
    vae,
    t5,
    clip,
    t5_tokenizer,
    clip_tokenizer,
    variant,
    t5_max_length,
    resolution,
    min_side,
    max_aspect,
    bucket_step,
    min_image_side,
    flip,
    caption_dropout,
    caption_file,
    caption_prefix,
    mask_from_alpha,
    latent,
    shard_size,
    batch_size,
    seed,
    device,
    dtype,
    rank,
    world_size,
):
    """Encode a folder of images and captions into training shards (VAE latents, T5 and CLIP embeddings).

    Images (png, jpg, webp; subfolders too) go to aspect-ratio buckets, are resized and center-cropped,
    and are encoded in batches. A same-name NAME.mask.png beside an image is its loss mask (white trains,
    black does not; the image's size). A caption table whose rows name a control_file_name holds FLUX.1 Kontext
    pairs: each target is cached with its reference image's latents, resized to the target's bucket
    (docs/kontext.md). Several processes split the work by --rank/--world-size (or the
    launcher's RANK/WORLD_SIZE); rerunning skips finished shards. Unreadable images are skipped and
    listed in OUT_DIR/cache_report.json. Cache each dataset of a run (a regularization set, say) into its
    own OUT_DIR.
    """
    import os

    check_dependencies()
    from fluxzero.data.buckets import STEP, default_step
    from fluxzero.data.cache import (
        SMALL_BUCKET,
        CacheOptions,
        env_rank_world,
        planned_bucket_step,
        run_cache,
        small_buckets,
    )
    from fluxzero.data.encode import T5_MAX_LENGTH, pick_device_dtype, resolve_paths
    from fluxzero.data.errors import DataError, InputFileError

    if resolution % STEP:
        raise click.BadParameter(f"must be a multiple of {STEP}, got {resolution}", param_hint="--resolution")
    if bucket_step is None:  # a folder cached (or half cached) before keeps the step its plan was made with
        planned = planned_bucket_step(out_dir)
        bucket_step = planned if planned and resolution % planned == 0 else default_step(resolution)
    if bucket_step % STEP or resolution % bucket_step:
        raise click.BadParameter(
            f"must be a multiple of {STEP} that divides --resolution {resolution}, got {bucket_step}",
            param_hint="--bucket-step",
        )
    if min_side is not None and (min_side % bucket_step or min_side > resolution):
        raise click.BadParameter(
            f"must be a multiple of --bucket-step {bucket_step} no larger than --resolution, got {min_side}"
            + ("" if bucket_step == STEP else f" (--bucket-step {STEP} allows any multiple of {STEP})"),
            param_hint="--min-side",
        )
    if rank is None or world_size is None:
        try:
            env_rank, env_world = env_rank_world()
        except DataError as e:
            raise click.UsageError(str(e)) from None
        rank = env_rank if rank is None else rank
        world_size = env_world if world_size is None else world_size
    if rank >= world_size:
        raise click.UsageError(f"--rank {rank} must be smaller than --world-size {world_size}.")
    try:
        paths = resolve_paths(
            flux_dir, vae=vae, t5=t5, clip=clip, t5_tokenizer=t5_tokenizer, clip_tokenizer=clip_tokenizer
        )
    except DataError as e:
        raise click.UsageError(str(e)) from None
    from fluxzero.data.tiny_encoders import is_tiny

    if any(is_tiny(os.path.dirname(p)) for p in vars(paths).values()):
        click.echo(
            "note: these are the tiny random-weight encoders of `fluxzero tiny-encoders`, for trying the "
            "pipeline only: the shards fit flux-tiny and are useless for training a real model",
            err=True,
        )
    try:
        dev, dt = pick_device_dtype(device, dtype)
    except (RuntimeError, DataError) as e:
        raise click.BadParameter(str(e).splitlines()[0], param_hint="--device") from None
    encoder_key = json.dumps({**{k: os.path.abspath(v) for k, v in vars(paths).items()}, "dtype": str(dt)})
    opts = CacheOptions(
        images_dir=images_dir,
        out_dir=out_dir,
        resolution=resolution,
        min_side=min_side,
        max_aspect=max_aspect,
        bucket_step=bucket_step,
        min_image_side=min_image_side,
        flip=flip,
        caption_dropout=caption_dropout,
        caption_file=caption_file,
        caption_prefix=caption_prefix,
        mask_from_alpha=mask_from_alpha,
        shard_size=shard_size,
        batch_size=batch_size,
        seed=seed,
        t5_max_length=t5_max_length or T5_MAX_LENGTH[variant],
        latent=latent,
        rank=rank,
        world_size=world_size,
        encoder_key=encoder_key,
    )

    def load_encoders():
        import torch

        from fluxzero.data.encode import Encoders

        if dev.type == "cpu" and world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # processes share the cores
        click.echo(f"loading encoders on {dev} ({str(dt).replace('torch.', '')})", err=True)
        return Encoders.load(paths, device=dev, dtype=dt, t5_max_length=opts.t5_max_length, latent=latent)

    try:
        result = run_cache(opts, load_encoders, log=lambda m: click.echo(m, err=True))
    except InputFileError as e:
        raise click.UsageError(str(e)) from None
    except DataError as e:
        raise click.ClickException(str(e)) from None
    m, report = result["manifest"], result["report"]
    if m is not None:
        buckets = ", ".join(f"{k} px: {v['num_samples']}" for k, v in m["cache"]["pixel_buckets"].items())
        masked = m["cache"].get("num_masked")
        with_masks = f", {masked} with a mask" if masked else ""
        click.echo(
            f"wrote {m['num_samples']} samples{with_masks} in {len(m['shards'])} shards to {out_dir} ({buckets})"
        )
        small = sum(s["reason"].startswith("too small") for s in report["skipped"])
        kinds = [
            f"{n} {what}" for n, what in ((len(report["skipped"]) - small, "unreadable"), (small, "too small")) if n
        ]
        if kinds:
            click.echo(f"skipped {' and '.join(kinds)} image(s); see {out_dir}/cache_report.json")
        if report["captions_truncated"]:
            cut, n = report["captions_truncated"], opts.t5_max_length
            top = max(T5_MAX_LENGTH.values())  # FLUX.1's own pipelines go no further
            more = f", or raise --t5-max-length (FLUX.1-dev's pipeline uses {top})" if n < top else ""
            click.echo(
                f"{len(cut)} of {report['num_images']} image(s) have captions longer than {n} T5 tokens, cut at the "
                f"end (a --caption-prefix, at the start, is kept; first: {cut[0]}; all listed in "
                f"{out_dir}/cache_report.json); shorten them{more}",
                err=True,
            )
        n_small, n_in_small, n_buckets = small_buckets(m)
        if n_small:
            click.echo(
                f"{n_small} of {n_buckets} buckets hold fewer than {SMALL_BUCKET} samples ({n_in_small} samples in all); "
                f"the trainer repeats the samples of a bucket smaller than a global batch (micro batch x GPUs) to fill "
                f"one, so a larger --bucket-step (this run's: {opts.bucket_step}) or a smaller --max-aspect (both merge "
                f"buckets) may suit this data better."
            )


@click.command("tiny-encoders")
@click.argument("out_dir", type=_DIR)
def tiny_encoders(out_dir):
    """Write tiny random-weight encoders in FLUX.1's folder layout, for trying the pipeline only.

    OUT_DIR gets vae/, text_encoder/ (CLIP), text_encoder_2/ (T5), tokenizer/ and tokenizer_2/, as a FLUX.1
    diffusers folder has, so `fluxzero cache IMAGES SHARDS --flux-dir OUT_DIR` (and encode-prompts, sample)
    run without FLUX.1's weights. The weights are random and the tokenizers know 19 words: the shards fit
    flux-tiny and are useless for training a real model. The same folder every time (seeded).
    """
    from pathlib import Path

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise click.UsageError(f"{out} is not empty; give a new folder for the tiny encoders.")
    check_dependencies("fluxzero tiny-encoders")
    from fluxzero.data.tiny_encoders import NOTE_FILE, write_tiny_encoders

    try:
        write_tiny_encoders(out)
    except OSError as e:
        raise click.ClickException(
            f"cannot write the tiny encoders to {out} ({e.strerror or e}); choose a folder you can write to."
        ) from None
    click.echo(
        f"wrote tiny random-weight encoders to {out} (see {out / NOTE_FILE}): for trying the pipeline only; "
        f"try `fluxzero cache IMAGES SHARDS --flux-dir {out} --resolution 256`, then train flux-tiny on SHARDS"
    )
