"""FLUX.1's frozen encoders, loaded from local files only: VAE (latents), T5 (sequence), CLIP-L (pooled)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fluxzero.config.user_files import parse_json
from fluxzero.data.errors import DataError
from fluxzero.dtypes import torch_dtype

# FLUX.1's autoencoder: latents are (z - shift) * scale; used when the VAE config does not carry them.
FLUX_VAE_SCALE = 0.3611
FLUX_VAE_SHIFT = 0.1159
T5_MAX_LENGTH = {"dev": 512, "schnell": 256}
# The longest T5 token row --t5-max-length may ask for: 8x FLUX.1-dev's; each caption is padded to it, so a typo
# (1000000000) would otherwise end in the tokenizer's out-of-memory abort
T5_MAX_TOKENS = 4096
CLIP_MAX_LENGTH = 77

LAYOUT = (
    "a FLUX.1 diffusers folder holds vae/ (AutoencoderKL), text_encoder/ (CLIP-L), text_encoder_2/ (T5), "
    "tokenizer/ (CLIP) and tokenizer_2/ (T5)"
)
# role -> (subfolder in a FLUX.1 diffusers folder, option name, what it is, file that must exist in it)
ROLES = {
    "vae": ("vae", "--vae", "diffusers AutoencoderKL folder", "config.json"),
    "t5": ("text_encoder_2", "--t5", "transformers T5EncoderModel folder", "config.json"),
    "clip": ("text_encoder", "--clip", "transformers CLIPTextModel folder", "config.json"),
    "t5_tokenizer": ("tokenizer_2", "--t5-tokenizer", "T5 tokenizer folder", None),
    "clip_tokenizer": ("tokenizer", "--clip-tokenizer", "CLIP tokenizer folder", None),
}


# role -> (config.json key, accepted values): a folder of another model would load as random weights
KINDS = {
    "vae": ("_class_name", ("AutoencoderKL",)),
    "t5": ("model_type", ("t5",)),
    "clip": ("model_type", ("clip_text_model", "clip")),  # "clip": a full CLIPModel folder; its text half loads
}
# tokenizer role -> (its family, the other family) as named in tokenizer_config.json's tokenizer_class
TOKENIZER_FAMILY = {"t5_tokenizer": ("T5", "CLIP"), "clip_tokenizer": ("CLIP", "T5")}


@dataclass(frozen=True)
class EncoderPaths:
    vae: str
    t5: str
    clip: str
    t5_tokenizer: str
    clip_tokenizer: str


def _read_json(path: Path) -> dict:
    try:
        doc = parse_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(
            f"{path} is not readable JSON ({str(e).splitlines()[0]}); restore it from the model's files."
        ) from None
    if not isinstance(doc, dict):
        raise DataError(f"{path} is not a JSON object; restore it from the model's files.")
    return doc


def latent_factors(vae) -> tuple[float, float]:
    """(scaling_factor, shift_factor) of a VAE, as latents are (z - shift) * scale: FLUX's own when the config
    carries no shift. FLUX's VAE config carries both; a config without a shift is not FLUX's, and its
    scaling_factor default (SD's) would be wrong. `fluxzero cache` encodes and `sample` decodes by this rule."""
    cfg = vae.config
    if getattr(cfg, "shift_factor", None) is not None:
        return float(cfg.scaling_factor), float(cfg.shift_factor)
    return FLUX_VAE_SCALE, FLUX_VAE_SHIFT


def check_model_folder(role: str, path: Path, what: str, where: str) -> None:
    """config.json names the right model class and the weights are .safetensors (never a silent pickle load)."""
    key, accepted = KINDS[role]
    cfg = _read_json(path / "config.json")
    if cfg.get(key) not in accepted:
        found = cfg.get("_class_name") or cfg.get("model_type") or "model of unknown type"
        raise DataError(
            f"{path} is a {found!r} model folder, not a {what} (whose config.json says {key} {accepted[0]!r}), "
            f"given by {where}; {LAYOUT}."
        )
    if not any(path.glob("*.safetensors")):
        if any(path.glob("*.bin")):
            raise DataError(
                f"{path} holds only pickled .bin weights and fluxzero cache loads .safetensors only; "
                f"re-save the model with save_pretrained(), which writes .safetensors."
            )
        raise DataError(f"{path} has no .safetensors weights, given by {where}; {LAYOUT}.")


def _check_tokenizer_folder(role: str, path: Path, what: str, where: str) -> None:
    mine, other = TOKENIZER_FAMILY[role]
    cfg_file = path / "tokenizer_config.json"
    cls = str(_read_json(cfg_file).get("tokenizer_class") or "") if cfg_file.exists() else ""
    if other.lower() in cls.lower() and mine.lower() not in cls.lower():
        raise DataError(f"{path} holds a {cls} (a {other} tokenizer), not a {what}, given by {where}; {LAYOUT}.")


def resolve_paths(flux_dir=None, **explicit) -> EncoderPaths:
    """Explicit paths win; the rest come from `flux_dir`'s subfolders. Paths come back absolute.

    A missing folder, a folder of another model (config.json's model type) or pickled-only weights ->
    DataError naming the folder and the expected layout. Reads only small JSON files (no torch).
    """
    out = {}
    for role, (sub, opt, what, must) in ROLES.items():
        given = explicit.get(role)
        if given:
            path = Path(given)
        elif flux_dir:
            path = Path(flux_dir) / sub
        else:
            raise DataError(f"no {what} given; pass {opt} DIR or --flux-dir DIR ({LAYOUT}).")
        where = f"{opt} {path}" if given else f"--flux-dir {flux_dir} (expected {sub}/ inside)"
        if not path.is_dir():
            raise DataError(f"{what} not found at {where}; {LAYOUT}.")
        if must and not (path / must).exists():
            raise DataError(f"{path} is not a {what} (no {must}) given by {where}; {LAYOUT}.")
        if not must and not any(
            (path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "spiece.model")
        ):
            raise DataError(
                f"{path} is not a {what} (no tokenizer.json, tokenizer_config.json, vocab.json or spiece.model) given by {where}; {LAYOUT}."
            )
        if role in KINDS:
            check_model_folder(role, path, what, where)
        else:
            _check_tokenizer_folder(role, path, what, where)
        out[role] = os.path.abspath(path)
    return EncoderPaths(**out)


def local_rank() -> int:
    """This process's index on its node: LOCAL_RANK (torchrun, deepspeed), else SLURM_LOCALID (srun), else 0."""
    text = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    try:
        return max(0, int(text))
    except ValueError:
        raise DataError(
            f"LOCAL_RANK / SLURM_LOCALID={text!r} is not a whole number; fix or unset it, or pass --device."
        ) from None


def pick_device_dtype(device: str = "auto", dtype: str = "auto"):
    """bf16 on a GPU when present (each process on cuda:LOCAL_RANK or cuda:SLURM_LOCALID), fp32 on CPU.

    A CUDA device that is not there -> DataError; a malformed device string -> torch's RuntimeError.
    """
    import torch

    if device == "auto":
        device = f"cuda:{local_rank() % max(1, torch.cuda.device_count())}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DataError(f"{device!r} asks for a GPU but PyTorch sees none here; use --device cpu (or auto).")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DataError(
                f"{device!r} does not exist: PyTorch sees {torch.cuda.device_count()} GPU(s), "
                f"cuda:0 to cuda:{torch.cuda.device_count() - 1}."
            )
    if dtype == "auto":
        dtype = "bf16" if dev.type == "cuda" else "fp32"
    return dev, torch_dtype(dtype)


def _check_loaded(model, info: dict, path: str):
    """The model, unless some of its weights were missing from the files (they would be random numbers)."""
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise DataError(
            f"{path} lacks {len(missing)} weight(s) its config.json needs (e.g. {missing[0]}), so they "
            f"would be random numbers; point the option at a complete {type(model).__name__} folder."
        )
    return model


class Encoders:
    """VAE + T5 + CLIP in eval mode on one device. `Encoders.load(paths, ...)` reads local folders only."""

    def __init__(
        self,
        vae,
        t5,
        clip,
        t5_tokenizer,
        clip_tokenizer,
        *,
        device,
        dtype,
        t5_max_length: int = 512,
        latent: str = "mode",
        paths: EncoderPaths | None = None,
    ):
        import torch

        def place(m):  # cast only when needed: diffusers warns on every dtype cast of a model
            m = m.to(device)
            return (m if next(m.parameters()).dtype == dtype else m.to(dtype)).eval()

        self.vae, self.t5, self.clip = place(vae), place(t5), place(clip)
        self.t5_tok, self.clip_tok = t5_tokenizer, clip_tokenizer
        self.device, self.dtype, self.t5_max_length, self.latent = device, dtype, t5_max_length, latent
        cfg = self.vae.config
        if getattr(cfg, "latent_channels", 16) != 16:
            raise DataError(
                f"the VAE has {cfg.latent_channels} latent channels but FLUX.1 needs 16; use FLUX's vae/ folder."
            )
        self.scale, self.shift = latent_factors(self.vae)
        self.paths = paths or EncoderPaths("<memory>", "<memory>", "<memory>", "<memory>", "<memory>")
        self._gen = torch.Generator(device=device)

    @classmethod
    def load(cls, paths: EncoderPaths, *, device, dtype, t5_max_length: int = 512, latent: str = "mode") -> Encoders:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub is imported: it reads this once
        import diffusers.utils.logging
        import transformers.utils.logging
        from diffusers import AutoencoderKL
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        transformers.utils.logging.disable_progress_bar()  # one progress bar (ours) is enough
        diffusers.utils.logging.disable_progress_bar()
        # use_safetensors: never fall back to pickled .bin files (resolve_paths said so already when only those exist)
        local = {"local_files_only": True, "use_safetensors": True, "output_loading_info": True}
        levels = transformers.utils.logging.get_verbosity(), diffusers.utils.logging.get_verbosity()
        # their load reports would list missing weights as a warning; _check_loaded says it in one sentence
        transformers.utils.logging.set_verbosity_error()
        diffusers.utils.logging.set_verbosity_error()
        try:
            vae = _check_loaded(
                *AutoencoderKL.from_pretrained(paths.vae, torch_dtype=dtype, low_cpu_mem_usage=False, **local),
                paths.vae,
            )
            t5 = _check_loaded(*T5EncoderModel.from_pretrained(paths.t5, dtype=dtype, **local), paths.t5)
            clip = _check_loaded(*CLIPTextModel.from_pretrained(paths.clip, dtype=dtype, **local), paths.clip)
            t5_tok = AutoTokenizer.from_pretrained(paths.t5_tokenizer, local_files_only=True)
            clip_tok = AutoTokenizer.from_pretrained(paths.clip_tokenizer, local_files_only=True)
        except (OSError, ValueError) as e:
            raise DataError(f"could not load the encoders ({str(e).splitlines()[0]}); {LAYOUT}.") from None
        finally:
            transformers.utils.logging.set_verbosity(levels[0])
            diffusers.utils.logging.set_verbosity(levels[1])
        return cls(
            vae,
            t5,
            clip,
            t5_tok,
            clip_tok,
            device=device,
            dtype=dtype,
            t5_max_length=t5_max_length,
            latent=latent,
            paths=paths,
        )

    @property
    def dims(self) -> dict:
        return {
            "latent_channels": 16,
            "t5_len": self.t5_max_length,
            "t5_dim": self.t5.config.d_model,
            "clip_dim": self.clip.config.hidden_size,
        }

    def encode_images(self, pixels, seeds=None):
        """Shape: pixels (B, 3, H, W) in [-1, 1] -> latents (B, 16, H/8, W/8) float32 on CPU.

        `seeds`: one per image for latent="sample"; each image's noise comes from its own seed, so a
        sample's latent does not depend on which batch it was encoded in (default: 0, 1, ...).
        """
        import torch

        with torch.inference_mode():
            dist = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist
            if self.latent == "sample":
                seeds = range(len(pixels)) if seeds is None else seeds
                noise = []
                for s in seeds:
                    self._gen.manual_seed(int(s))
                    noise.append(
                        torch.randn(dist.mean.shape[1:], generator=self._gen, device=self.device, dtype=dist.mean.dtype)
                    )
                z = dist.mean + dist.std * torch.stack(noise)
            else:
                z = dist.mode()
            return ((z.float() - self.shift) * self.scale).cpu()

    def t5_cut(self, captions: list[str]) -> list[bool]:
        """Whether each caption has more T5 tokens (its end-of-text token included) than t5_max_length, so that
        encode_text keeps only its first t5_max_length tokens: the start, where a caption prefix stands, survives."""
        ids = self.t5_tok(captions, truncation=False, verbose=False).input_ids
        return [len(i) > self.t5_max_length for i in ids]

    def encode_text(self, captions: list[str]):
        """Shape: B captions -> t5 (B, L, D), t5_len (B,) real token counts, clip (B, V); float32 on CPU.

        As in FLUX.1's pipeline: T5 padded to max length, no attention mask; CLIP's pooled output, 77 tokens.
        """
        import torch

        with torch.inference_mode():
            t = self.t5_tok(
                captions, padding="max_length", max_length=self.t5_max_length, truncation=True, return_tensors="pt"
            )
            t5 = self.t5(input_ids=t.input_ids.to(self.device)).last_hidden_state
            c = self.clip_tok(
                captions, padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True, return_tensors="pt"
            )
            clip = self.clip(input_ids=c.input_ids.to(self.device)).pooler_output
            return t5.float().cpu(), t.attention_mask.sum(1).to(torch.int32), clip.float().cpu()
