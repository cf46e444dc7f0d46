"""fluxzero: fine-tune the FLUX.1 transformer with DeepSpeed ZeRO.

Kept import-light on purpose: `fluxzero gen-config` must run without importing torch or deepspeed.
"""

__version__ = "0.1.0"
