"""A quantized frozen base for LoRA (QLoRA-style): the transformer blocks' linear weights stored at 1 byte a weight,
either weight-only through torchao (dequantized inside each matmul) or for FP8 matmuls; the adapters PEFT puts on
top (its torchao tuner, peft/tuners/lora/torchao.py, or its plain lora.Linear) train in the usual dtypes.

- int8: torchao's Int8WeightOnlyConfig, symmetric absmax with one float32 scale per output row: 1 byte a weight
  instead of bf16's 2. FLUX.1-dev's blocks hold 11.8B of its 11.9B parameters, so the base goes from 23.8 GB
  to 12.0 GB.
- fp8: Float8WeightOnlyConfig (e4m3, one scale per row): the same size, 3 mantissa bits instead of int8's ~7.
- fp8-matmul: the same e4m3 storage, but the forward's matmul runs in FP8 on the tensor cores with each activation
  quantized per token (our own layer, fluxzero/model/fp8_matmul.py, which says why not torchao's); it needs a GPU
  of compute capability 8.9+ (Ada, Hopper), or the CPU.

Only the linears of `double_blocks` / `single_blocks` are quantized; the embedders, norms, biases and final
layer stay in the model's dtype (0.6% of FLUX.1-dev). A quantized weight becomes a non-persistent buffer, not a
parameter: DeepSpeed broadcasts every parameter through a uint8 view that torchao's tensors do not implement,
while buffers it neither broadcasts, partitions, hands to the optimizer nor saves (every rank quantizes the same
weights, so the ranks agree without a broadcast). Exports never see them: a LoRA file holds the adapters only
and a merged export merges them into the base weights file, never into these quantized copies.
"""

from __future__ import annotations

import torch
from torch import nn

BLOCKS = ("double_blocks.", "single_blocks.")


class QuantError(ValueError):
    """A quantized base that this installation or configuration cannot train."""


FP8_MATMUL = "fp8-matmul"  # the kind served by fluxzero.model.fp8_matmul rather than torchao


def _config(kind: str):
    try:
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig
    except ImportError:
        raise QuantError(f"lora.base_quant {kind} needs torchao: pip install -e '.[lowmem]'") from None
    # set_inductor_config=False: torchao's default turns on Inductor's coordinate-descent tuning for the whole
    # process, which made the first compiled step of a FLUX.1-dev LoRA take minutes (benchmarks/RESULTS.md); the
    # trainer's compile settings stay its own
    return {"int8": Int8WeightOnlyConfig, "fp8": Float8WeightOnlyConfig}[kind](set_inductor_config=False)


def check_quant(kind: str) -> None:
    """Raise QuantError (one sentence saying what to install or set) when `kind` cannot be made here: torchao's kinds
    need torchao; fp8-matmul needs no package, but the GPU this process trains on (the current CUDA device, where
    there is one) must have FP8 tensor cores."""
    if kind == FP8_MATMUL:
        if torch.cuda.is_available():
            _check_device(torch.device("cuda", torch.cuda.current_device()))
    elif kind != "none":
        _config(kind)


def _check_device(device) -> None:
    from .fp8_matmul import device_problem

    problem = device_problem(device)
    if problem:
        raise QuantError(problem)


def quantizes(name: str, module: nn.Module) -> bool:
    """True for the modules `quantize_linear` is applied to: the nn.Linear layers of the transformer blocks."""
    return type(module) is nn.Linear and name.startswith(BLOCKS)


def quantize_linear(module: nn.Linear, kind: str) -> None:
    """Replace `module`'s weight by its `kind` (int8, fp8, fp8-matmul) quantized copy, kept as a non-persistent
    buffer (module docstring: why); its bias stays a frozen parameter. fp8-matmul also changes the module's class (to
    fp8_matmul.Fp8MatmulLinear, in place) and raises QuantError for a module on a CUDA device without FP8 matmuls."""
    if kind == FP8_MATMUL:
        from .fp8_matmul import make_fp8_matmul

        _check_device(module.weight.device)
        make_fp8_matmul(module)
        return
    from torchao.quantization import quantize_

    quantize_(module, _config(kind))
    weight = module.weight.detach()
    del module.weight
    module.register_buffer("weight", weight, persistent=False)


def is_quantized(module: nn.Module) -> bool:
    """True for a module `quantize_linear` quantized, of any kind."""
    from .fp8_matmul import Fp8MatmulLinear

    if isinstance(module, Fp8MatmulLinear):
        return True
    try:
        from torchao.utils import TorchAOBaseTensor
    except ImportError:
        return False
    return isinstance(getattr(module, "weight", None), TorchAOBaseTensor)
