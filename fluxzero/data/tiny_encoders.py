"""Tiny random-weight encoders in FLUX.1's diffusers folder layout, for trying `fluxzero cache` without weights.

FOR TRYING THE PIPELINE ONLY: the VAE, T5 and CLIP here have random weights and a vocabulary of a few words,
so their latents and embeddings carry no meaning. Their widths are flux-tiny's (16 latent channels, T5 width
64, CLIP width 32): shards made with them train flux-tiny, and are useless for training any real model. The
tests build their encoders with this module too (`fluxzero tiny-encoders` writes the same folder).
"""

from __future__ import annotations

from pathlib import Path

# flux-tiny: context_in_dim 64 (tiny T5 d_model), vec_in_dim 32 (tiny CLIP hidden size)
T5_DIM, CLIP_DIM = 64, 32
WORDS = [
    "a",
    "an",
    "the",
    "photo",
    "of",
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
]
NOTE_FILE = "TINY_ENCODERS.txt"
NOTE = (
    "Tiny random-weight VAE, T5 and CLIP written by `fluxzero tiny-encoders`, in FLUX.1's diffusers layout.\n"
    "For trying the pipeline only (fluxzero cache, encode-prompts, sample, training flux-tiny): random weights,\n"
    f"a vocabulary of {len(WORDS)} words (others become <unk>); their output is useless for training a real model.\n"
)


def _tokenizer(kind: str, out: Path) -> tuple[int, int]:
    """A word-level tokenizer with T5's or CLIP's special tokens, saved to `out`; returns (vocab size, eos id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    bos, unk, eos = ("<pad>", "<unk>", "</s>") if kind == "t5" else ("<|startoftext|>", "<unk>", "<|endoftext|>")
    vocab = {w: i for i, w in enumerate([bos, unk, *WORDS, eos])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if kind == "t5":  # T5: "... </s>", padded with <pad> (id 0)
        tok.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, vocab[eos])])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=bos, unk_token=unk, eos_token=eos)
    else:  # CLIP: "<|startoftext|> ... <|endoftext|>", padded with <|endoftext|>
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}", special_tokens=[(bos, 0), (eos, vocab[eos])]
        )
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=eos, unk_token=unk, bos_token=bos, eos_token=eos)
    fast.save_pretrained(out)
    return len(vocab), vocab[eos]


def write_tiny_encoders(root: str | Path) -> Path:
    """Random-initialised VAE (16 latent channels), T5 (d_model 64) and CLIP (hidden 32) in FLUX's diffusers layout.

    Seeded (the same folder every time), without touching the caller's random state.
    """
    import torch
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    root = Path(root)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        n5, eos5 = _tokenizer("t5", root / "tokenizer_2")
        nc, eosc = _tokenizer("clip", root / "tokenizer")
        T5EncoderModel(
            T5Config(
                vocab_size=n5,
                d_model=T5_DIM,
                d_kv=16,
                d_ff=128,
                num_layers=1,
                num_heads=4,
                pad_token_id=0,
                eos_token_id=eos5,
            )
        ).save_pretrained(root / "text_encoder_2")
        # eos id != 2, so CLIP pools at the first <|endoftext|> like the real CLIP-L
        CLIPTextModel(
            CLIPTextConfig(
                vocab_size=nc,
                hidden_size=CLIP_DIM,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                max_position_embeddings=77,
                projection_dim=CLIP_DIM,
                bos_token_id=0,
                eos_token_id=eosc,
                pad_token_id=eosc,
            )
        ).save_pretrained(root / "text_encoder")
        AutoencoderKL(
            latent_channels=16,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            norm_num_groups=4,
            scaling_factor=0.3611,
            shift_factor=0.1159,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ).save_pretrained(root / "vae")
    (root / NOTE_FILE).write_text(NOTE)
    return root


def is_tiny(flux_dir: str | Path | None) -> bool:
    """Whether `flux_dir` is a folder `write_tiny_encoders` made (it leaves its note there)."""
    return flux_dir is not None and (Path(flux_dir) / NOTE_FILE).is_file()
