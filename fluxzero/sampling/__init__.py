"""Sampling FLUX.1: the Euler time grid, the sampler, VAE decode, prompt-embedding files and PNG output.

Torch only (no DeepSpeed), so the trainer can call `sample` on the model it trains and a sampling node
needs nothing of the training stack. diffusers / PIL / safetensors are imported where they are used.
"""

from .embeddings import PromptEmbeddings, load_embeddings, save_embeddings
from .pipeline import sample_images
from .sampler import check_size, initial_noise, sample
from .schedule import image_tokens, sigmas

__all__ = [
    "PromptEmbeddings",
    "check_size",
    "image_tokens",
    "initial_noise",
    "load_embeddings",
    "sample",
    "sample_images",
    "save_embeddings",
    "sigmas",
]
