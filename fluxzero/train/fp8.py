"""FP8 training of the transformer blocks' linear layers (fluxzero.fp8), applied from outside the model with torchao's
float8 training: which layers (fp8_layer) and the conversion (apply_fp8). fluxzero.train.engine applies it before the
LoRA adapters.
"""

from __future__ import annotations

import torch

from fluxzero.train.distributed import TrainingError


def fp8_layer(module: torch.nn.Module, name: str) -> bool:
    """The linear layers that get FP8 matmuls: the attention and MLP layers of the transformer blocks (where
    the FLOPs are) whose sides are multiples of 16 (FP8 matmul kernels need that). The modulation layers (one
    row per sample: nothing to gain from FP8, only the cast), the embedders and the final layer stay in bf16,
    as torchtitan keeps its input and output layers."""
    return (
        isinstance(module, torch.nn.Linear)
        and name.startswith(("double_blocks.", "single_blocks."))
        and "mod" not in name.rsplit(".", 2)[-2]
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def apply_fp8(model: torch.nn.Module, recipe: str) -> int:
    """torchao float8 training (dynamic scaling, `recipe` tensorwise or rowwise) on fp8_layer's layers; returns
    how many. Weights and their state-dict names stay as they are (Float8Linear keeps the Linear's parameters
    and casts them at each matmul), so checkpoints, exports and EMA do not change. Fast only when compiled.
    Not at ZeRO-3, which the DeepSpeed config check refuses (ds_check.combination_problems)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise TrainingError("fluxzero.fp8 needs torchao: pip install -e '.[lowmem]'") from None
    names = [n for n, m in model.named_modules() if fp8_layer(m, n)]
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=fp8_layer)
    return len(names)
