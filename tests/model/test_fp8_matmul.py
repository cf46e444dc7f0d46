"""The FP8-matmul frozen linear (fluxzero.model.fp8_matmul, lora.base_quant: fp8-matmul) on CPU, whose
torch._scaled_mm takes float8_e4m3fn operands with row-wise scales as a Hopper GPU does: the forward within FP8's
tolerance of the full-precision layer (and a wrong scale outside it), the input's gradient equal to grad_y times
the dequantized weight, no gradient for the weight, the refusal of a GPU without FP8 matmuls, and PEFT's LoRA on it.
"""

import pytest
import torch
import torch.nn.functional as F

from fluxzero.model.fp8_matmul import (
    E4M3,
    Fp8MatmulLinear,
    capability_problem,
    dequantize,
    fp8_linear,
    quantize_rows,
)
from fluxzero.model.quant import is_quantized, quantize_linear

# e4m3 keeps 3 mantissa bits: weight and activation each rounded to within 2^-4 of their value, so on random data a
# product lands a few percent from the full-precision one (measured 0.036 here); a scale 10% off lands ~0.1 away
FP8_TOLERANCE = 0.06


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _layer(n_in=256, n_out=512, dtype=torch.bfloat16, seed=0):
    """(the layer made fp8-matmul, its full-precision fp32 twin)."""
    torch.manual_seed(seed)
    layer = torch.nn.Linear(n_in, n_out, dtype=dtype)
    ref = torch.nn.Linear(n_in, n_out)
    ref.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    quantize_linear(layer, "fp8-matmul")
    return layer, ref


def test_weight_becomes_e4m3_codes_with_a_scale_per_row():
    layer, ref = _layer()
    assert type(layer) is Fp8MatmulLinear and is_quantized(layer) and isinstance(layer, torch.nn.Linear)
    assert layer.weight.dtype == E4M3 and layer.weight_scale.dtype == torch.float32
    assert [n for n, _ in layer.named_parameters()] == ["bias"] and list(layer.state_dict()) == ["bias"]
    w = ref.weight.detach().bfloat16().float()  # the bf16 weight the layer was made from
    assert torch.allclose(layer.weight_scale, w.abs().amax(dim=1) / 448, rtol=1e-6)
    # round to nearest on 3 mantissa bits: each weight within 2^-4 of its value (relative), the row max exact
    back = dequantize(layer.weight, layer.weight_scale, torch.float32)
    assert ((back - w).abs() <= w.abs() * 2**-4 + layer.weight_scale[:, None] * 2**-9).all()


def test_forward_is_fp8_accurate_and_a_wrong_scale_is_not():
    layer, ref = _layer()
    x = torch.randn(2, 50, 256, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (2, 50, 512) and y.dtype == torch.bfloat16
    full = ref(x.float())
    assert _rel(y, full) < FP8_TOLERANCE
    # the very product torch._scaled_mm is asked for: x and W each rounded to e4m3 with their row scales, summed in
    # fp32, rounded once to bf16 (bias added in its epilogue)
    xq, xs = quantize_rows(x.reshape(-1, 256))
    exact = (xq.float() * xs) @ dequantize(layer.weight, layer.weight_scale, torch.float32).t() + ref.bias
    assert _rel(y.reshape(-1, 512), exact) < 4e-3  # bf16 rounding of the output (2^-9) and the bias
    layer.weight_scale.mul_(1.1)  # what a wrong scale convention would give
    assert _rel(layer(x), full) > FP8_TOLERANCE


def test_input_gradient_is_grad_y_times_the_dequantized_weight_and_the_weight_gets_none():
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 4e-3)):  # bf16: grad_x rounded once to bf16
        layer, _ = _layer(dtype=dtype)
        layer.bias.requires_grad_(False)  # frozen, as under a LoRA
        x = torch.randn(3, 7, 256, dtype=dtype, requires_grad=True)
        g = torch.randn(3, 7, 512, dtype=dtype)
        layer(x).backward(g)
        want = g.float() @ dequantize(layer.weight, layer.weight_scale, torch.float32)
        assert _rel(x.grad, want) < tol, dtype
        assert not layer.weight.requires_grad and layer.weight.grad is None and layer.bias.grad is None
    # a bias left trainable still gets its gradient (the sum over tokens)
    layer, _ = _layer()
    x = torch.randn(4, 256, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(4, 512, dtype=torch.bfloat16)
    layer(x).backward(g)
    assert torch.allclose(layer.bias.grad.float(), g.float().sum(0), rtol=1e-2, atol=1e-2)


def test_a_shape_scaled_mm_cannot_take_falls_back_to_the_dequantized_matmul():
    layer, ref = _layer(n_in=24, n_out=40)  # _scaled_mm needs K and N in multiples of 16
    x = torch.randn(5, 24, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    assert torch.equal(y, F.linear(x, dequantize(layer.weight, layer.weight_scale, torch.bfloat16), layer.bias))
    y.float().sum().backward()
    assert x.grad is not None and _rel(y, ref(x.float())) < FP8_TOLERANCE


def test_a_module_wide_cast_leaves_the_codes_and_scales_alone():
    """model.bfloat16() / .to(dtype) (a DeepSpeed that casts the whole module, a user's cast) must not round the
    scales or widen the codes: only device moves reach them."""
    layer, _ = _layer()
    codes, scale = layer.weight.clone(), layer.weight_scale.clone()
    layer.bfloat16()
    layer.to(torch.float32)
    assert layer.weight.dtype == E4M3 and torch.equal(layer.weight.view(torch.uint8), codes.view(torch.uint8))
    assert layer.weight_scale.dtype == torch.float32 and torch.equal(layer.weight_scale, scale)
    assert layer.bias.dtype == torch.float32  # the rest of the module is cast as asked


@pytest.mark.parametrize(
    "capability,ok", [((8, 0), False), ((8, 6), False), ((7, 5), False), ((8, 9), True), ((9, 0), True)]
)
def test_a_gpu_without_fp8_matmuls_is_refused_in_one_sentence(capability, ok):
    msg = capability_problem(capability, "NVIDIA A100-SXM4-80GB")
    if ok:
        assert msg is None
        return
    assert msg == (
        "lora.base_quant fp8-matmul needs FP8 tensor cores (compute capability 8.9 or higher: Ada or Hopper), and "
        f"NVIDIA A100-SXM4-80GB has {capability[0]}.{capability[1]}; use lora.base_quant: fp8 (weight-only) or "
        "int8 instead"
    )


def test_the_startup_probe_runs_the_layer_and_says_what_to_change_when_torch_cannot(monkeypatch):
    """An FP8 GPU whose torch has no row-wise _scaled_mm kernel for it fails at startup in one sentence, not at the
    first forward minutes later. The probe runs the real layer (here on the CPU, which has the kernel); the
    missing kernel is stood in for by a _scaled_mm that raises as torch does."""
    from fluxzero.model import fp8_matmul

    fp8_matmul._probe.cache_clear()
    assert fp8_matmul._probe(torch.device("cpu")) is None

    def missing(*args, **kwargs):
        raise RuntimeError("Only sm90+ supports row-wise scaling\n(further lines)")

    monkeypatch.setattr(torch, "_scaled_mm", missing)
    fp8_matmul._probe.cache_clear()
    try:
        msg = fp8_matmul._probe(torch.device("cpu"), "NVIDIA GeForce RTX 4090")
    finally:
        fp8_matmul._probe.cache_clear()
    assert msg == (
        f"lora.base_quant fp8-matmul: torch {torch.__version__} cannot multiply FP8 with row-wise scales on NVIDIA "
        "GeForce RTX 4090 (Only sm90+ supports row-wise scaling); use a newer torch, or lora.base_quant: fp8 "
        "(weight-only) or int8 instead"
    )


def test_peft_wraps_it_as_a_plain_linear_whose_adapters_train():
    pytest.importorskip("peft")
    from fluxzero.config import LoraConfig
    from fluxzero.model import build_model
    from fluxzero.model.lora import apply_lora
    from fluxzero.model.quant import quantizes

    model = build_model("flux-tiny", dtype=torch.bfloat16)
    for name, m in list(model.named_modules()):
        if quantizes(name, m):
            quantize_linear(m, "fp8-matmul")
    apply_lora(model, LoraConfig(rank=2, targets=["double_blocks.0.img_attn.qkv"]))
    qkv = model.double_blocks[0].img_attn.qkv
    assert type(qkv).__name__ == "Linear" and type(qkv.base_layer) is Fp8MatmulLinear  # PEFT's lora.Linear
    a = qkv.lora_A["default"].weight
    # fp32 adapters drawn in bf16 as on a bf16 base (compute_dtype): not rounded to e4m3 on the way
    assert a.dtype == torch.float32 and torch.equal(a, a.bfloat16().float())
    assert not torch.equal(a, a.to(E4M3).float())
    out = qkv(torch.randn(3, 64, dtype=torch.bfloat16))
    out.float().sum().backward()
    assert qkv.lora_B["default"].weight.grad.abs().sum() > 0 and qkv.base_layer.weight.grad is None


def test_fp8_linear_compiles_with_inductor_on_cpu():
    """Inductor lowers the per-token quantization and calls _scaled_mm as an extern kernel on the CPU: one graph,
    no break, the same output and input gradient as eager (the trainer's compiled path: tests/train/test_base_quant.py)."""
    torch._dynamo.reset()
    codes, scale = quantize_rows(torch.randn(96, 64))
    bias = torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(2, 40, 64, dtype=torch.bfloat16, requires_grad=True)
    eager = fp8_linear(x, codes, scale.reshape(-1), bias)
    eager.float().sum().backward()
    g_eager, x.grad = x.grad, None
    compiled = torch.compile(fp8_linear, backend="inductor", fullgraph=True)(x, codes, scale.reshape(-1), bias)
    compiled.float().sum().backward()
    assert torch.equal(compiled, eager) and torch.equal(x.grad, g_eager)
