"""Configuration, pure Python (no torch, no deepspeed): model presets, the run file, the DeepSpeed config
builder and its parsed view. `fluxzero gen-config` and `estimate` import only this package and the memory planner
(fluxzero.plan).
"""

from fluxzero.config.lora import LoraConfig, lora_param_count
from fluxzero.config.models import MODEL_PRESETS, ModelConfig, get_model_config, reshaped, resolve_model
from fluxzero.config.run import FlowConfig, TrainConfig

__all__ = [
    "MODEL_PRESETS",
    "ModelConfig",
    "get_model_config",
    "reshaped",
    "resolve_model",
    "FlowConfig",
    "TrainConfig",
    "LoraConfig",
    "lora_param_count",
]
