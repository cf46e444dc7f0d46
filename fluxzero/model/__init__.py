"""The FLUX.1 transformer in plain PyTorch (BFL parameter names), its weights layouts and converters."""

from .flux import Flux, build_model

__all__ = ["Flux", "build_model"]
