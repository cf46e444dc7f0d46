"""The FLUX.1 transformer in plain PyTorch (BFL parameter names), its weights layouts and converters."""
from .flux import Flux, build_model
from .math import set_attention_backend

__all__ = ["Flux", "build_model", "set_attention_backend"]
