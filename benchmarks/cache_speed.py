"""Throughput of `fluxzero cache` with FLUX.1-sized encoders (random weights: speed does not depend on them).

    PYTHONPATH=. python benchmarks/cache_speed.py            # GPU: full-size VAE, T5-XXL, CLIP-L in bf16
    PYTHONPATH=. python benchmarks/cache_speed.py --tiny     # CPU smoke test with tiny encoders

Measures (1) each encoder alone: VAE encode at 1024x1024 px per batch size, T5-XXL at 512 tokens, CLIP-L at
77 tokens; (2) the whole pipeline (`fluxzero.data.cache.run_cache`: JPEG decode + bucket resize in threads,
encoders, bf16 shard writes) over generated JPEGs of several aspect ratios. Writes JSON to
$OUT/cache_speed_<device>_<yyyy-mm>.json and prints a markdown table.

FLOPs are not the point here (the VAE encoder dominates and is convolution-bound); images/s is.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # runner, also when this file is loaded by path
import runner  # noqa: E402

WORDS = [
    "a",
    "photo",
    "of",
    "the",
    "cat",
    "dog",
    "red",
    "blue",
    "green",
    "house",
    "tree",
    "sky",
    "on",
    "in",
    "with",
    "small",
    "big",
    "person",
    "car",
    "street",
    "city",
    "night",
    "day",
    "light",
    "dark",
    "water",
    "mountain",
    "river",
    "sunset",
    "portrait",
    "close",
    "up",
    "old",
    "new",
    "wooden",
    "table",
]


def scratch_tokenizer(kind: str, vocab_size: int):
    """A word-level tokenizer built offline with ids valid for the model's vocabulary (speed only)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    bos, unk, eos = ("<pad>", "<unk>", "</s>") if kind == "t5" else ("<|startoftext|>", "<unk>", "<|endoftext|>")
    vocab = {w: i for i, w in enumerate([bos, unk, *WORDS, eos])}
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if kind == "t5":
        tok.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, vocab[eos])])
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=bos, unk_token=unk, eos_token=eos), vocab[eos]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, 0), (eos, vocab[eos])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=eos, unk_token=unk, bos_token=bos, eos_token=eos
    ), vocab[eos]


def build_vae(tiny: bool, device, dtype):
    from diffusers import AutoencoderKL

    if tiny:
        kw = dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4)
    else:  # FLUX.1's autoencoder shapes
        kw = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32)
    with torch.device(device):
        vae = AutoencoderKL(
            latent_channels=16,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            scaling_factor=0.3611,
            shift_factor=0.1159,
            use_quant_conv=False,
            use_post_quant_conv=False,
            **kw,
        )
    return (vae if dtype == torch.float32 else vae.to(dtype)).eval()


def vae_only_encode(vae, dtype):
    """Same computation as Encoders.encode_images, for machines without transformers."""

    def encode(px):
        with torch.inference_mode():
            z = vae.encode(px.to(dtype)).latent_dist.mode()
            return ((z.float() - 0.1159) * 0.3611).cpu()

    return encode


def build_encoders(tiny: bool, device, dtype):
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from fluxzero.data.encode import Encoders

    t5_tok, eos5 = scratch_tokenizer("t5", 32128)
    clip_tok, eosc = scratch_tokenizer("clip", 49408)
    vae = build_vae(tiny, device, dtype)
    if tiny:
        t5_cfg = T5Config(vocab_size=32128, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4)
        clip_cfg = CLIPTextConfig(
            vocab_size=49408,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=77,
            projection_dim=32,
        )
    else:  # google/t5-v1_1-xxl, openai/clip-vit-large-patch14 (text) shapes
        t5_cfg = T5Config(
            vocab_size=32128,
            d_model=4096,
            d_kv=64,
            d_ff=10240,
            num_layers=24,
            num_heads=64,
            feed_forward_proj="gated-gelu",
        )
        clip_cfg = CLIPTextConfig(
            vocab_size=49408,
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            max_position_embeddings=77,
            projection_dim=768,
            hidden_act="quick_gelu",
        )
    t5_cfg.eos_token_id, t5_cfg.pad_token_id = eos5, 0
    clip_cfg.eos_token_id, clip_cfg.bos_token_id, clip_cfg.pad_token_id = eosc, 0, eosc
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build directly in bf16 on the GPU: T5-XXL is 4.7B parameters
    try:
        with torch.device(device):
            t5 = T5EncoderModel(t5_cfg)
            clip = CLIPTextModel(clip_cfg)
    finally:
        torch.set_default_dtype(prev)
    return Encoders(vae, t5, clip, t5_tok, clip_tok, device=device, dtype=dtype, t5_max_length=512)


def timed(fn, sync, reps=3):
    fn()  # warm-up (cuDNN autotune, allocator)
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps


def make_images(root: Path, n: int, scale: float) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    sizes = [(1024, 1024), (1344, 768), (768, 1344), (1536, 1024), (1024, 1536), (1216, 832)]
    for i in range(n):
        w, h = (int(s * scale) for s in sizes[i % len(sizes)])
        # smooth gradients plus mild noise: JPEG sizes (~0.3-0.6 MB at 1 Mpx) like photos, not like pure noise
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        base = np.stack([x / w, y / h, (x + y) / (w + h)], -1) * 200 + rng.normal(0, 12, (h, w, 3))
        Image.fromarray(base.clip(0, 255).astype(np.uint8)).save(root / f"img{i:04d}.jpg", quality=90)
        (root / f"img{i:04d}.txt").write_text(" ".join(rng.choice(WORDS, 24)))


def main():
    ap = runner.parser(__doc__)
    ap.add_argument("--tiny", action="store_true", help="tiny encoders, small images (CPU smoke test)")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    out_dir = runner.out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    res = 64 if args.tiny else 1024
    n_images = min(args.images, 16) if args.tiny else args.images
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    result = {
        "device": name,
        "dtype": str(dtype),
        "torch": torch.__version__,
        "tiny": args.tiny,
        "stages": [],
        "pipeline": {},
    }

    try:
        import transformers  # noqa: F401

        have_text = True
    except ImportError:
        have_text = False
        print(
            "transformers is not installed here: measuring the VAE only (install transformers and "
            "tokenizers, as in the development venv, for T5/CLIP and the whole pipeline)",
            file=sys.stderr,
        )
    t0 = time.perf_counter()
    enc = build_encoders(args.tiny, device, dtype) if have_text else None
    encode_images = enc.encode_images if enc else vae_only_encode(build_vae(args.tiny, device, dtype), dtype)
    result["build_s"] = round(time.perf_counter() - t0, 1)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    # ---- each encoder alone
    for bs in (1, 4, 8, 16):
        px = torch.randn(bs, 3, res, res, device=device, dtype=dtype).clamp(-1, 1)
        s = timed(lambda: encode_images(px), sync)
        result["stages"].append(
            {"stage": f"VAE encode {res}x{res}", "batch": bs, "ms_per_item": round(1000 * s / bs, 2)}
        )
    if cuda:
        result["vae_peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if not have_text:
        return finish(result, out_dir, args, name, dtype, cuda)
    caps = [" ".join(WORDS[i % len(WORDS)] for i in range(k, k + 20)) for k in range(32)]
    for bs in (8, 32):
        s = timed(lambda: enc.encode_text(caps[:bs]), sync)
        result["stages"].append(
            {"stage": "T5 (512 tok) + CLIP (77 tok)", "batch": bs, "ms_per_item": round(1000 * s / bs, 2)}
        )

    # ---- whole pipeline on JPEG files
    from fluxzero.data.cache import CacheOptions, run_cache

    with tempfile.TemporaryDirectory() as tmp:
        imgs, shards = Path(tmp) / "images", Path(tmp) / "shards"
        imgs.mkdir()
        t = time.perf_counter()
        make_images(imgs, n_images, res / 1024)
        result["pipeline"]["make_images_s"] = round(time.perf_counter() - t, 1)
        opts = CacheOptions(
            str(imgs),
            str(shards),
            resolution=res,
            min_side=res // 4 // 16 * 16 or 16,
            batch_size=args.batch_size,
            shard_size=64,
        )
        t = time.perf_counter()
        r = run_cache(opts, lambda: enc, log=lambda m: None)
        wall = time.perf_counter() - t
        m = r["manifest"]
        nbytes = sum(s["bytes"] for s in m["shards"])
        result["pipeline"].update(
            {
                "images": n_images,
                "batch_size": args.batch_size,
                "wall_s": round(wall, 2),
                "images_per_s": round(n_images / wall, 2),
                "bytes_per_sample": nbytes // m["num_samples"],
                "buckets": {k: v["num_samples"] for k, v in m["cache"]["pixel_buckets"].items()},
            }
        )
    if cuda:
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    finish(result, out_dir, args, name, dtype, cuda)


def finish(result, out_dir, args, name, dtype, cuda):
    tag = "tiny" if args.tiny else name.lower().replace("nvidia ", "").replace(" ", "-")
    path = out_dir / f"cache_speed_{tag}_{time.strftime('%Y-%m')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"# fluxzero cache speed on {name} ({dtype}), encoders built in {result['build_s']} s\n")
    print("| stage | batch | ms / item |\n|---|---|---|")
    for s in result["stages"]:
        print(f"| {s['stage']} | {s['batch']} | {s['ms_per_item']} |")
    p = result["pipeline"]
    if p:
        print(
            f"\npipeline: {p['images']} JPEGs ({p['buckets']}), batch {p['batch_size']}: {p['wall_s']} s, "
            f"{p['images_per_s']} images/s, {p['bytes_per_sample'] / 2**20:.2f} MiB per sample on disk"
        )
    if cuda:
        print(f"peak GPU memory {result.get('peak_memory_gib', result['vae_peak_memory_gib'])} GiB")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
