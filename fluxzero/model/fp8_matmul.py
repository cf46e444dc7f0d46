"""A frozen linear whose forward multiplies in FP8 (lora.base_quant: fp8-matmul): the weight stored once as float8
e4m3 with one fp32 scale per output row (absmax / 448), the activation quantized the same way per token at every
call, and torch._scaled_mm multiplying the two on the FP8 tensor cores (Ada / Hopper: compute capability 8.9+).

Our own rather than torchao's Float8DynamicActivationFloat8WeightConfig, which serves inference only: torchao 0.18
refuses it at quantization on a CPU or a GPU below 8.9, and its linear has no backward ("derivative for
aten::_scaled_mm is not implemented"), while a LoRA's frozen base must hand its input a gradient.

Backward makes that gradient only, grad_x = grad_y W, in the activation's dtype from the dequantized weight (no FP8
in backward): the weight is frozen, so nothing is saved for backward but the weight the layer already holds, and
the dequantized copy lives for one linear's backward at a time.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
MIN_CAPABILITY = (8, 9)  # torch._scaled_mm with row-wise scales: Ada (8.9) and Hopper (9.0)
_ALIGN = 16  # torch._scaled_mm's K and N must be multiples of 16


def capability_problem(capability: tuple[int, int], gpu: str = "this GPU") -> str | None:
    """One sentence saying why a CUDA device of `capability` (major, minor) cannot run fp8-matmul, or None if it can."""
    if tuple(capability) >= MIN_CAPABILITY:
        return None
    major, minor = capability
    return (
        f"lora.base_quant fp8-matmul needs FP8 tensor cores (compute capability 8.9 or higher: Ada or Hopper), and "
        f"{gpu} has {major}.{minor}; use lora.base_quant: fp8 (weight-only) or int8 instead"
    )


def device_problem(device: torch.device | str) -> str | None:
    """capability_problem for `device` when it is a CUDA device; None on any other device (the CPU runs it too)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if torch.version.hip:  # ROCm's FP8 GPUs (MI300) multiply e4m3fnuz, another variant than this layer's e4m3fn
        return (
            "lora.base_quant fp8-matmul multiplies NVIDIA's FP8 (e4m3fn), which this ROCm GPU does not; use "
            "lora.base_quant: fp8 (weight-only) or int8 instead"
        )
    name = torch.cuda.get_device_name(device)
    return capability_problem(torch.cuda.get_device_capability(device), name) or _probe(device, name)


@functools.cache
def _probe(device: torch.device, name: str = "this device") -> str | None:
    """Run one small layer as training will (row-wise scales, bias in the epilogue): None when it works, else one
    sentence. An FP8 GPU is not enough: torch's row-wise _scaled_mm kernels came to Ada later than to Hopper, and
    the first forward would otherwise fail minutes into a run, after the model loaded."""
    try:
        x = torch.linspace(-1, 1, 256, device=device, dtype=torch.bfloat16).reshape(16, 16)
        codes, scale = quantize_rows(x)
        y = fp8_linear(x, codes, scale.reshape(-1), torch.zeros(16, device=device, dtype=torch.bfloat16))
        if not torch.isfinite(y).all():
            raise RuntimeError("a non-finite result")
    except RuntimeError as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (
            f"lora.base_quant fp8-matmul: torch {torch.__version__} cannot multiply FP8 with row-wise scales on "
            f"{name} ({why}); use a newer torch, or lora.base_quant: fp8 (weight-only) or int8 instead"
        )
    return None


def quantize_rows(t: Tensor) -> tuple[Tensor, Tensor]:
    """(codes, scale): `t` as e4m3 codes with one fp32 scale per row, absmax / 448, so codes * scale ~ t.

    Shape: t (R, C) -> codes (R, C) float8_e4m3fn, scale (R, 1) float32.
    """
    amax = torch.linalg.vector_norm(t, float("inf"), dim=-1, keepdim=True).float()  # max |t| per row, exact
    scale = amax.clamp(min=1e-12) / E4M3_MAX  # an all-zero row keeps codes 0 with a finite scale
    # t / scale is a new float32 tensor (type promotion), the one copy of t made here
    return (t / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def dequantize(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """codes * scale (one scale per row), computed in float32 and rounded once to `dtype`.

    Shape: codes (N, K), scale (N,) -> (N, K).
    """
    return codes.float().mul_(scale[:, None]).to(dtype)


class _Fp8Matmul(torch.autograd.Function):
    """y = x W^T + b with x and W in e4m3 (torch._scaled_mm), the gradient to x in x's dtype, none to W."""

    @staticmethod
    def forward(ctx, x: Tensor, codes: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
        xq, x_scale = quantize_rows(x)  # (M, K) e4m3, (M, 1): per token, made anew at every call
        # _scaled_mm adds the bias in its epilogue only in the output's dtype, and on CUDA not to a float32 output:
        # otherwise it is added after it
        fused = bias is not None and bias.dtype == x.dtype != torch.float32
        y = torch._scaled_mm(
            xq, codes.t(), scale_a=x_scale, scale_b=scale[None, :], bias=bias if fused else None, out_dtype=x.dtype
        )  # (M, N)
        if bias is not None and not fused:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(codes, scale)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        codes, scale = ctx.saved_tensors
        grad_x = grad_y @ dequantize(codes, scale, grad_y.dtype) if ctx.needs_input_grad[0] else None  # (M, K)
        grad_b = grad_y.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return grad_x, None, None, grad_b


def fp8_linear(x: Tensor, codes: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, codes * scale, bias) with the matmul in FP8: x quantized per token to e4m3, then torch._scaled_mm.

    Shape: x (..., K), codes (N, K) e4m3, scale (N,) fp32, bias (N,) -> (..., N) in x's dtype.
    """
    N, K = codes.shape
    if K % _ALIGN or N % _ALIGN:
        # _scaled_mm cannot take this shape (FLUX.1's block linears all can): the dequantized matmul instead
        return F.linear(x, dequantize(codes, scale, x.dtype), bias)
    y = _Fp8Matmul.apply(x.reshape(-1, K), codes, scale, bias)  # tokens flattened: (M, K) -> (M, N)
    return y.reshape(*x.shape[:-1], N)


class Fp8MatmulLinear(nn.Linear):
    """An nn.Linear whose frozen weight is an e4m3 buffer (out, in) with its fp32 row scales `weight_scale` (out,);
    its forward is fp8_linear. Made from a plain nn.Linear in place by `make_fp8_matmul`.

    It stays an nn.Linear so that PEFT wraps it as any linear (its default LoRA dispatch checks for one) and the
    adapters compute beside it in the usual dtypes; `compute_dtype` (the dtype the weight had, which PEFT reads for
    a quantized base layer as bitsandbytes' layers provide it) keeps PEFT from making the adapters in float8.
    """

    weight_scale: Tensor
    compute_dtype: torch.dtype

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def _apply(self, fn, recurse=True):
        # A module-wide cast (model.bfloat16(), .to(dtype)) would turn the codes into bf16 and round the fp32
        # scales: only moves between devices reach them.
        kept = {name: self._buffers[name] for name in ("weight", "weight_scale")}
        super()._apply(fn, recurse)
        for name, t in kept.items():
            self._buffers[name] = t.to(self._buffers[name].device)
        return self

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8-matmul (e4m3, row-wise scales)"


def make_fp8_matmul(module: nn.Linear) -> None:
    """Turn the nn.Linear `module` into an Fp8MatmulLinear in place (its class changed, so the module tree keeps the
    same object): its weight becomes e4m3 codes and fp32 row scales, both non-persistent buffers; its bias stays a
    parameter. The caller checks the device first (device_problem)."""
    dtype = module.weight.dtype
    with torch.no_grad():
        codes, scale = quantize_rows(module.weight.detach())
    del module.weight
    module.register_buffer("weight", codes, persistent=False)
    module.register_buffer("weight_scale", scale.reshape(-1), persistent=False)
    module.compute_dtype = dtype
    module.__class__ = Fp8MatmulLinear
