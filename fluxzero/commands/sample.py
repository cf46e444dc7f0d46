"""`fluxzero sample` (images from FLUX.1 weights) and `fluxzero encode-prompts` (prompt embeddings to a file)."""

from __future__ import annotations

from pathlib import Path

import click

from fluxzero.commands import options
from fluxzero.config.run import MAX_SEED

from . import refuse_existing

# fluxzero.model.math.ATTENTION_BACKENDS' names, spelled here so `--help` needs no torch (tests/sampling checks they agree)
ATTENTION_CHOICES = ("auto", "any", "flash", "efficient", "cudnn", "math")
CUDA_ONLY_ATTENTION = ("efficient", "cudnn")  # torch's CPU SDPA has flash and math only
_DIR = options.DIR
_FILE = click.Path(dir_okay=False, path_type=Path)


def _prompt_options(f):
    for decorator in reversed(
        [
            click.option("--prompt", "prompt_texts", multiple=True, help="A prompt; repeat for several."),
            click.option(
                "--prompts",
                "prompts_file",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                default=None,
                help="UTF-8 text file with one prompt per line (blank lines are skipped).",
            ),
            click.option(
                "--negative-prompt",
                default=None,
                help="Negative prompt for true classifier-free guidance (acts only with --true-cfg above 1).",
            ),
        ]
    ):
        f = decorator(f)
    return f


def _device_options(f):
    for decorator in reversed(
        [
            click.option(
                "--device",
                default="auto",
                show_default=True,
                help="auto = cuda:LOCAL_RANK when a GPU is present, else cpu.",
            ),
            click.option(
                "--dtype",
                type=click.Choice(["auto", "bf16", "fp32"]),
                default="auto",
                show_default=True,
                help="Model and encoder precision: auto = bf16 on GPU, fp32 on CPU.",
            ),
        ]
    ):
        f = decorator(f)
    return f


def _read_prompts(prompt_texts, prompts_file: Path | None) -> list[str]:
    from fluxzero.config.user_files import check_regular

    prompts = list(prompt_texts)
    if prompts_file is not None:
        check_regular(
            prompts_file,
            "prompts file",
            "pass a UTF-8 text file with one prompt per line",
            lambda sentence: click.BadParameter(sentence, param_hint="--prompts"),
        )
        try:
            lines = prompts_file.read_text(encoding="utf-8-sig").splitlines()
        except UnicodeDecodeError:
            raise click.BadParameter(
                f"{prompts_file} is not UTF-8 text; save it as UTF-8", param_hint="--prompts"
            ) from None
        from_file = [line.strip() for line in lines if line.strip()]
        if not from_file:
            raise click.BadParameter(
                f"{prompts_file} holds no prompts; write one prompt per line", param_hint="--prompts"
            )
        prompts += from_file
    return prompts


def _negative(negative_prompt, true_cfg: float):
    if negative_prompt is not None and true_cfg <= 1:
        raise click.UsageError(
            "--negative-prompt acts only with --true-cfg above 1 (e.g. --true-cfg 4); "
            "pass one or drop --negative-prompt."
        )
    if true_cfg > 1 and negative_prompt is None:
        raise click.UsageError(
            '--true-cfg above 1 needs a negative prompt; pass --negative-prompt TEXT (an empty "" is allowed).'
        )


def _paths(flux_dir, **explicit):
    from ..data.encode import resolve_paths
    from ..data.errors import DataError

    try:
        return resolve_paths(flux_dir, **explicit)
    except DataError as e:
        raise click.UsageError(str(e)) from None


def _device(device, dtype):
    from ..data.encode import pick_device_dtype
    from ..data.errors import DataError

    try:
        return pick_device_dtype(device, dtype)
    except (RuntimeError, DataError) as e:
        raise click.BadParameter(str(e).splitlines()[0], param_hint="--device") from None


def _load_encoders(paths, dev, dt, t5_max_length: int):
    from ..data.encode import Encoders
    from ..data.errors import DataError

    click.echo(f"loading encoders on {dev} ({str(dt).replace('torch.', '')})", err=True)
    try:
        return Encoders.load(paths, device=dev, dtype=dt, t5_max_length=t5_max_length)
    except DataError as e:
        raise click.UsageError(str(e)) from None


def _vae_folder(vae, flux_dir) -> str:
    if vae:
        return vae
    if flux_dir:
        return str(Path(flux_dir) / "vae")
    raise click.UsageError("no VAE given; pass --vae DIR (a diffusers AutoencoderKL folder) or --flux-dir DIR.")


def _load_model(weights: Path, preset: str | None, dev, dt):
    from ..config import get_model_config
    from ..model.layouts import WeightsError
    from ..model.weights import load_model

    try:
        cfg = get_model_config(preset) if preset else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--model") from None
    try:
        return load_model(weights, cfg=cfg, dtype=dt, device=dev)
    except WeightsError as e:
        raise click.BadParameter(str(e), param_hint="WEIGHTS") from None


def _apply_adapters(model, lora: Path | None, scale: float = 1.0):
    """Merge the `--lora FILE` (diffusers/PEFT or kohya layout) into `model`'s weights, module by module in
    place (W + scale (alpha / rank) B A in fp32, rounded to the model's dtype), so the sampler never needs to
    know about adapters and no second copy of the weights is ever held. Returns (model, what the PNGs record
    of the LoRA: None without one)."""
    if lora is None:
        return model, None
    import torch

    from ..config.lora import LoraConfig
    from ..model.adapters import has_adapter_keys
    from ..model.lora_formats import merge_lora, read_lora
    from ..model.lora_keys import LoraError

    if has_adapter_keys(lora):
        return _apply_lycoris(model, lora, scale)
    try:
        sd, info = read_lora(lora)
        if scale != 1.0:  # the strength of the whole delta, as diffusers' lora_scale and ComfyUI's strength
            sd = {k: v.float() * scale if k.endswith(".lora_B.weight") else v for k, v in sd.items()}
        lcfg = LoraConfig(rank=info.rank, alpha=info.alpha)  # the file's own scale: read_lora's tensors use it
        params = dict(model.named_parameters())
        modules = [k.removesuffix(".lora_A.weight") for k in sd if k.endswith(".lora_A.weight")]
        # every module checked (merge_lora on meta tensors) before the first weight changes
        merge_lora(
            {f"{m}.weight": params[f"{m}.weight"].to("meta") for m in modules if f"{m}.weight" in params},
            {k: v.to("meta") for k, v in sd.items()},
            lcfg,
        )
        for m in modules:
            weight = params[f"{m}.weight"]
            pair = {f"{m}.lora_A.weight": sd[f"{m}.lora_A.weight"], f"{m}.lora_B.weight": sd[f"{m}.lora_B.weight"]}
            with torch.no_grad():
                weight.copy_(merge_lora({f"{m}.weight": weight.detach()}, pair, lcfg)[f"{m}.weight"])
    except LoraError as e:
        raise click.BadParameter(str(e), param_hint="--lora") from None
    return model, {
        "path": str(Path(lora).resolve()),
        "layout": info.layout,
        "scale": scale,
        "rank": info.rank,
        "alpha": info.alpha,
    }


def _apply_lycoris(model, lora: Path, scale: float):
    """_apply_adapters for a LoKr / DoRA file (fluxzero.model.adapters): W + scale x delta, one module at a time."""
    import torch

    from ..model import adapters
    from ..model.lora_keys import LoraError

    try:
        parts, meta = adapters.read_adapters(lora)
        params = dict(model.named_parameters())
        by_module: dict[str, list] = {}
        for p in parts:
            by_module.setdefault(p.module, []).append(p)
        absent = [m for m in by_module if f"{m}.weight" not in params]
        if absent:
            raise LoraError(
                f"{lora} adapts {absent[0]}, which the model has no weight for; use an adapter made for this model"
            )
        for module, ps in by_module.items():
            weight = params[f"{module}.weight"]
            delta = adapters.module_deltas(ps, {f"{module}.weight": weight.detach()})[module]
            with torch.no_grad():
                weight.copy_((weight.float() + scale * delta).to(weight.dtype))
    except LoraError as e:
        raise click.BadParameter(str(e), param_hint="--lora") from None
    kinds = sorted({p.kind for p in parts})
    return model, {
        "path": str(Path(lora).resolve()),
        "layout": "lycoris",
        "scale": scale,
        "type": ",".join(kinds),
        "rank": int(meta.get("fluxzero.rank") or 0) or None,
    }


def _check_dims(emb, cfg):
    from ..sampling.embeddings import EmbeddingsError

    try:
        emb.check_model(cfg)
    except EmbeddingsError as e:
        raise click.UsageError(str(e)) from None


def _check_lora_scale(lora, scale: float) -> None:
    import math

    if not math.isfinite(scale):
        raise click.BadParameter(
            f"must be a finite number, got {scale}; use 1 for the LoRA as trained", param_hint="--lora-scale"
        )
    if lora is None and scale != 1.0:
        raise click.UsageError("--lora-scale sets the strength of a --lora; pass --lora FILE or drop --lora-scale.")


def _check_attention(attention: str, dev) -> None:
    import torch

    if attention in CUDA_ONLY_ATTENTION and torch.device(dev).type != "cuda":
        raise click.BadParameter(
            f"{attention} attention runs on CUDA only, and this samples on {dev}; use auto (or flash, math) here",
            param_hint="--attention",
        )


def _check_size(height: int, width: int) -> None:
    from ..sampling.sampler import size_hint

    for name, v in (("--height", height), ("--width", width)):
        if v % 16:  # FLUX.1: 8x VAE, then 2x2 patches
            raise click.BadParameter(f"must be a multiple of 16 pixels, got {v}; use {size_hint(v)}", param_hint=name)


def _embeddings_file(embeddings: Path | None, prompts: list[str], negative_prompt, true_cfg: float):
    """The --embeddings file's contents (None when prompts come as text), checked against the other options."""
    if embeddings is not None and prompts:
        raise click.UsageError("give prompts either as text (--prompt / --prompts) or as --embeddings, not both.")
    if embeddings is None:
        if not prompts:
            raise click.UsageError("no prompts; pass --prompt TEXT (repeatable), --prompts FILE or --embeddings FILE.")
        return None
    from ..sampling.embeddings import EmbeddingsError, load_embeddings

    try:
        emb = load_embeddings(embeddings)
    except EmbeddingsError as e:
        raise click.BadParameter(str(e), param_hint="--embeddings") from None
    if negative_prompt is not None:
        raise click.UsageError(
            "--negative-prompt needs the text encoders; encode it into the --embeddings file "
            "with fluxzero encode-prompts --negative-prompt."
        )
    if true_cfg > 1 and not emb.has_negative:
        raise click.UsageError(
            f"--true-cfg above 1 needs a negative prompt, and {embeddings} holds none; "
            "encode one with fluxzero encode-prompts --negative-prompt."
        )
    return emb


def _make_folder(out_dir: Path) -> None:
    """--out made now, so an unwritable place stops the command before minutes of loading; a folder made here
    and still empty when the command ends (a later refusal) is removed again."""
    made = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise click.BadParameter(
            f"cannot create {out_dir} ({e.strerror or e}); choose a writable place", param_hint="--out"
        ) from None
    if made:
        click.get_current_context().call_on_close(
            lambda: out_dir.is_dir() and not any(out_dir.iterdir()) and out_dir.rmdir()
        )


def _load_vae(vae_dir, dev, dt):
    from ..data.errors import DataError
    from ..sampling.vae import load_vae

    try:
        return load_vae(vae_dir, device=dev, dtype=dt)
    except DataError as e:
        raise click.UsageError(str(e)) from None


def _encode(encoders, prompts, negative_prompt):
    from ..sampling.embeddings import EmbeddingsError, encode_prompts

    try:
        return encode_prompts(encoders, prompts, negative_prompt)
    except EmbeddingsError as e:  # the encoders gave NaN (T5 overflowing in fp16)
        raise click.UsageError(f"the text encoders' output is unusable: {e}") from None


def _reference(model, reference: Path | None, preset: str | None, vae, height: int, width: int):
    """The --reference latents (None without one). A model inferred from its tensors alone is taken as Kontext
    (FLUX.1 Kontext [dev] has FLUX.1-dev's tensors); a --model that is not Kontext is refused."""
    if reference is None:
        return None
    from ..config import MODEL_PRESETS
    from ..data.errors import DataError
    from ..sampling.vae import encode_reference

    cfg = model.config
    if not cfg.kontext:
        if preset:
            raise click.UsageError(
                f"--reference needs a FLUX.1 Kontext model, and --model {preset} is not one; pass "
                f"--model flux-kontext-dev (or a model spec with kontext=true)."
            )
        kontext = cfg.replace(kontext=True)
        model.config = next((p for p in MODEL_PRESETS.values() if p.same_shape(kontext)), kontext)
    try:
        return encode_reference(vae, reference, height=height, width=width)
    except DataError as e:
        raise click.BadParameter(str(e), param_hint="--reference") from None


@click.command("sample")
@click.argument("weights", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Folder for the PNGs (one per image) and grid.png; created if missing.",
)
@click.option(
    "--model",
    "preset",
    default=None,
    help="Model preset the weights must match (default: inferred from the tensor shapes).",
)
@_prompt_options
@click.option(
    "--embeddings",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Prompt embeddings written by `fluxzero encode-prompts` instead of --prompt/--prompts (no T5 needed).",
)
@options.encoders("T5 tokens per prompt (padded)  [default: 512 for dev, 256 for schnell].")
@click.option(
    "--width",
    type=click.IntRange(min=16),
    default=1024,
    show_default=True,
    help="Image width in pixels, a multiple of 16.",
)
@click.option(
    "--height",
    type=click.IntRange(min=16),
    default=1024,
    show_default=True,
    help="Image height in pixels, a multiple of 16.",
)
@click.option(
    "--steps", type=click.IntRange(min=1), default=None, help="Euler steps  [default: 28 for dev, 4 for schnell]."
)
@click.option(
    "--guidance",
    type=float,
    default=3.5,
    show_default=True,
    help="Distilled guidance value for FLUX.1-dev (ignored by schnell, which has no guidance embedding).",
)
@click.option(
    "--true-cfg",
    type=click.FloatRange(min=1.0),
    default=1.0,
    show_default=True,
    help="Real classifier-free guidance scale with --negative-prompt (diffusers' true_cfg_scale); "
    "above 1 doubles the model work.",
)
@click.option(
    "--seed",
    "seeds",
    type=click.IntRange(0, MAX_SEED),
    multiple=True,
    default=(0,),
    show_default=True,
    help="Noise seed; repeat for several. Every prompt is sampled once per seed, each image from its own seed.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=None,
    help="Images per model call (the images do not depend on it)  [default: up to 4 on a GPU (with "
    "--compile, the most that divides the images), 1 on the CPU].",
)
@click.option(
    "--lora",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A LoRA .safetensors file (diffusers/PEFT or kohya/ComfyUI layout, e.g. a run's lora.safetensors; "
    "or a LoKr / DoRA in LyCORIS' layout) "
    "merged into WEIGHTS before sampling.",
)
@click.option(
    "--lora-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Strength of the --lora: its change to the weights times this (1 = as trained, 0 = none).",
)
@click.option(
    "--compile/--no-compile",
    "compile_blocks",
    default=None,
    help="torch.compile every transformer block (as the trainer does). The first model call compiles "
    "(seconds, again for a new batch shape), so it pays off over many images  [default: on a GPU "
    "when the images x steps are enough for it to pay off (docs/sampling.md), off on the CPU].",
)
@click.option(
    "--attention",
    type=click.Choice(ATTENTION_CHOICES),
    default="any",
    show_default=True,
    help="SDPA kernels of the transformer's attention: any = torch's own choice (cuDNN's on Hopper, as "
    "FluxPipeline gets; faster than flash there for the forward pass), auto = flash, "
    "then efficient, then math (the trainer's: cuDNN's backward gave non-finite gradients). "
    "efficient and cudnn need a CUDA device.",
)
@click.option(
    "--reference",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="FLUX.1 Kontext: the image to edit (resized to cover --width x --height and center-cropped), or a "
    ".safetensors file of its scaled VAE latents under 'latents'. Makes an inferred model Kontext.",
)
@click.option(
    "--grid/--no-grid",
    "write_grid",
    default=True,
    show_default=True,
    help="Also write grid.png (a row per prompt, a column per seed).",
)
@_device_options
def sample(
    weights,
    out_dir,
    preset,
    prompt_texts,
    prompts_file,
    negative_prompt,
    embeddings,
    flux_dir,
    vae,
    t5,
    clip,
    t5_tokenizer,
    clip_tokenizer,
    t5_max_length,
    width,
    height,
    steps,
    guidance,
    true_cfg,
    seeds,
    batch_size,
    lora,
    lora_scale,
    compile_blocks,
    attention,
    reference,
    write_grid,
    device,
    dtype,
):
    """Sample images from FLUX.1 transformer weights with the Euler flow sampler.

    WEIGHTS is any full transformer layout `fluxzero convert` reads (BFL or ComfyUI .safetensors, a
    diffusers folder). Prompts come as text (--prompt, --prompts; encoded with the T5 and CLIP folders)
    or pre-encoded (--embeddings). With --reference a FLUX.1 Kontext model edits that image as each prompt says
    (docs/kontext.md). Writes one PNG per prompt and seed, with the sampling parameters in
    its text chunks, and grid.png (a row per prompt, a column per seed; --no-grid leaves it out).
    Faster: --compile, --attention cudnn (on Hopper), --batch-size; docs/sampling.md has the measurements.
    """
    from .cache import check_dependencies

    check_dependencies("fluxzero sample", without=("transformers",) if embeddings else ())
    from tqdm import tqdm

    from ..data.encode import T5_MAX_LENGTH
    from ..sampling.pipeline import auto_speed, prepare_model, sample_images
    from ..sampling.schedule import image_tokens

    _check_size(height, width)
    _check_lora_scale(lora, lora_scale)
    # Cheap checks first (prompts, folders, the embeddings file), before minutes of loading weights.
    prompts = _read_prompts(prompt_texts, prompts_file)
    emb = _embeddings_file(embeddings, prompts, negative_prompt, true_cfg)
    if emb is None:
        _negative(negative_prompt, true_cfg)
        paths = _paths(flux_dir, vae=vae, t5=t5, clip=clip, t5_tokenizer=t5_tokenizer, clip_tokenizer=clip_tokenizer)
        vae_dir = paths.vae
    else:
        vae_dir = _vae_folder(vae, flux_dir)
    dev, dt = _device(device, dtype)
    _check_attention(attention, dev)
    _make_folder(out_dir)
    vae_model = _load_vae(vae_dir, dev, dt)

    click.echo(f"loading {weights} on {dev} ({str(dt).replace('torch.', '')})", err=True)
    model, lora_record = _apply_adapters(_load_model(weights, preset, dev, dt), lora, lora_scale)
    ref_latents = _reference(model, reference, preset, vae_model, height, width)
    cfg = model.config
    if emb is None:
        encoders = _load_encoders(
            paths, dev, dt, t5_max_length or T5_MAX_LENGTH["dev" if cfg.guidance_embed else "schnell"]
        )
        emb = _encode(encoders, prompts, negative_prompt if true_cfg > 1 else None)
        del encoders  # T5-XXL is ~9 GB in bf16: free it before sampling
    _check_dims(emb, cfg)
    steps = steps or (28 if cfg.guidance_embed else 4)
    images = len(emb.prompts) * len(seeds)
    tokens = image_tokens(height, width) + (0 if ref_latents is None else ref_latents[0, 0].numel() // 4)  # 2x2 packed
    batch_size, compile_on = auto_speed(dev.type, images, steps, tokens, batch_size, compile_blocks)
    click.echo(f"{images} image(s), {batch_size} a model call{', compiled blocks' if compile_on else ''}", err=True)
    prepare_model(model, attention=attention, compile=compile_on)
    batches = -(-images // batch_size)
    with tqdm(total=batches * steps, desc="sample", unit="step", dynamic_ncols=True) as bar:
        written = sample_images(
            model,
            vae_model,
            emb,
            out_dir,
            width=width,
            height=height,
            steps=steps,
            seeds=list(seeds),
            guidance=guidance,
            true_cfg=true_cfg,
            batch_size=batch_size,
            weights=str(Path(weights).resolve()),
            lora=lora_record,
            on_step=bar.update,
            write_grid=write_grid,
            reference=ref_latents,
            reference_path=str(reference.resolve()) if reference else None,
        )
    click.echo(f"wrote {len(written)} images{' and grid.png' if write_grid else ''} to {out_dir}")


@click.command("encode-prompts")
@click.argument("out", metavar="OUT.safetensors", type=_FILE)
@_prompt_options
@options.encoders("T5 tokens per prompt (padded)  [default: 512 for dev, 256 for schnell].")
@_device_options
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
def encode_prompts_cmd(
    out,
    prompt_texts,
    prompts_file,
    negative_prompt,
    flux_dir,
    vae,
    t5,
    clip,
    t5_tokenizer,
    clip_tokenizer,
    t5_max_length,
    device,
    dtype,
    overwrite,
):
    """Encode prompts with T5 and CLIP into a file for `fluxzero sample --embeddings` (and training previews).

    Run it where the encoders are; the file (t5, clip_pooled and the prompt texts, see
    fluxzero/sampling/embeddings.py) lets a training node sample without loading T5. The T5 length
    must be the one the model is sampled with: 512 tokens for dev (the default here), 256 for schnell.
    """
    from .cache import check_dependencies

    check_dependencies("fluxzero encode-prompts")
    from ..data.encode import T5_MAX_LENGTH
    from ..sampling.embeddings import save_embeddings

    if out.suffix != ".safetensors":
        raise click.BadParameter(f"give the file a .safetensors name, got {out.name}", param_hint="OUT.safetensors")
    refuse_existing(out, overwrite)
    prompts = _read_prompts(prompt_texts, prompts_file)
    if not prompts:
        raise click.UsageError("no prompts; pass --prompt TEXT (repeatable) or --prompts FILE.")
    paths = _paths(flux_dir, vae=vae, t5=t5, clip=clip, t5_tokenizer=t5_tokenizer, clip_tokenizer=clip_tokenizer)
    dev, dt = _device(device, dtype)
    encoders = _load_encoders(paths, dev, dt, t5_max_length or T5_MAX_LENGTH["dev"])
    emb = _encode(encoders, prompts, negative_prompt)
    try:
        save_embeddings(out, emb)
    except OSError as e:
        raise click.BadParameter(
            f"cannot write {out} ({e.strerror or e}); choose a writable place", param_hint="OUT.safetensors"
        ) from None
    click.echo(f"wrote {len(prompts)} prompt embeddings ({emb.t5.shape[1]} T5 tokens) to {out}")
