"""Which Adam(W) DeepSpeed builds: the one table between gen-config's `--adam-impl`, the DeepSpeed JSON's
`optimizer.params` and the memory model's `optimizer_impl` (pure, no imports).

What deepspeed 0.19.8 builds for {"type": "AdamW"} (engine.get_optimizer_configuration): `torch_adam` true ->
torch.optim.AdamW (with the remaining params, so `fused` reaches torch), whatever the offload; else optimizer
offload cpu/nvme -> DeepSpeedCPUAdam; else FusedAdam.
"""

from __future__ import annotations

# --adam-impl: torch = torch.optim.AdamW(fused=True), fused = DeepSpeed's FusedAdam, cpu = DeepSpeedCPUAdam
ADAM_IMPLS = ("torch", "fused", "cpu")
# The memory model's names, by the temporaries a step allocates: "fused" (FusedAdam / CPUAdam: none),
# "torch" (torch AdamW, foreach: an fp32 copy), "torch-fused" (torch AdamW(fused=True): none)
OPTIMIZER_IMPLS = ("fused", "torch", "torch-fused")
_MEMORY_NAME = {"torch": "torch-fused", "fused": "fused", "cpu": "fused"}


def adam_params(impl: str) -> dict:
    """The `optimizer.params` keys gen-config writes for `impl`. With torch, fused=True picks torch's single
    fused kernel (CPU and CUDA, torch >= 2.4) instead of the foreach path and its fp32 temporary per step."""
    return {"torch_adam": True, "fused": True} if impl == "torch" else {"torch_adam": False}


def impl_of_params(params: dict, offload_optimizer: str) -> str:
    """The ADAM_IMPLS name of what DeepSpeed builds from `optimizer.params` with this optimizer offload device."""
    if params.get("torch_adam") is True:
        return "torch"
    return "cpu" if offload_optimizer != "none" else "fused"


def optimizer_impl(impl: str) -> str:
    """The memory model's OPTIMIZER_IMPLS name of an ADAM_IMPLS one, as gen-config writes it (torch fused)."""
    return _MEMORY_NAME.get(impl, "fused")


def optimizer_impl_of_params(params: dict) -> str:
    """The memory model's OPTIMIZER_IMPLS name of any `optimizer.params` (a hand-written one may omit fused)."""
    if params.get("torch_adam") is not True:
        return "fused"
    return "torch-fused" if params.get("fused") is True else "torch"


def impl_for_offload(impl: str, offload_optimizer: str) -> str:
    """`impl` made buildable with this optimizer offload: DeepSpeed builds its CPU Adam only with offload and
    FusedAdam only without it, so fused becomes cpu under offload and cpu becomes torch without it."""
    if offload_optimizer != "none" and impl == "fused":
        return "cpu"
    if offload_optimizer == "none" and impl == "cpu":
        return "torch"
    return impl
