"""The DeepSpeed engine around the FLUX.1 model: with ds_patches (its changes to DeepSpeed's own objects), the one
module that imports deepspeed at top level (check-config's DeepSpeed parse in config/deepspeed/validate.py and
commands/config.py, and `fluxzero doctor`, import it inside a call).

Like torchtitan's parallelize, it applies what the DeepSpeed config asks for from outside the model: the model is
born partitioned under ZeRO-3 (zero.Init), pretrained weights are copied into the partitions, the blocks' linears get
FP8 matmuls (fp8.py), blocks are compiled (model/compile.py) and checkpointed (recompute.py) by wrapping their
forwards, then deepspeed.initialize builds the engine.
"""

from __future__ import annotations

import importlib
import os

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from fluxzero.config import ModelConfig
from fluxzero.config.deepspeed.check import streaming_problems
from fluxzero.config.deepspeed.view import DSView
from fluxzero.config.lora import LoraConfig
from fluxzero.model.compile import apply_compile
from fluxzero.train import ds_patches
from fluxzero.train.distributed import TrainingError, broadcast_objects
from fluxzero.train.fp8 import apply_fp8
from fluxzero.train.recompute import apply_activation_checkpointing, checkpoint_function, checkpointed_indices

# set (to anything): leave DeepSpeed's per-tensor update loops in place, for benchmarks' before/after figures
DEEPSPEED_LOOPS_ENV = "FLUXZERO_DEEPSPEED_LOOPS"


def join_deepspeed_comm() -> None:
    """Let deepspeed.comm wrap the process group fluxzero.train.distributed created (its config parser reads
    the world size from there). On CPU skip the shared-memory allreduce op DeepSpeed compiles at every start
    (~60 s): training uses gloo."""
    if get_accelerator().device_name() == "cpu":
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(verbose=False)


def check_supported(v: DSView, path: str) -> None:
    """Refuse, in one sentence, what this machine's DeepSpeed accelerator cannot train."""
    accel = get_accelerator()
    if v.precision == "fp16" and not accel.is_fp16_supported():
        raise TrainingError(
            f"DeepSpeed config {path} trains in fp16, which DeepSpeed's {accel.device_name()} "
            f"accelerator does not support; use bf16 or fp32 here (`fluxzero gen-config "
            f"--precision`)"
        )


# ---------------------------------------------------------------------------------------------------------
# Model under ZeRO
# ---------------------------------------------------------------------------------------------------------
def build_engine(
    model_cfg: ModelConfig,
    ds: dict,
    v: DSView,
    device: torch.device,
    *,
    seed: int,
    weights: str | None = None,
    attention: str = "auto",
    lora=None,
    latent_sizes=(),
):
    """Model (partitioned at construction under ZeRO-3), weights, LoRA, compile, checkpointing -> DeepSpeed engine.

    ds: the DeepSpeed dict (no "fluxzero" section); v: its view, which says what to apply from outside.
    lora: a LoraConfig (adapters on the loaded weights, only they trained) or None (full fine-tune).
    latent_sizes: the data's latent (h, w) buckets; their areas (image token counts) decide how the blocks compile
    (DSView.dynamic_tokens).
    """
    join_deepspeed_comm()
    torch.manual_seed(seed)  # identical random init on every rank (ZeRO-3 then keeps each rank's slice)
    quant = lora.base_quant if lora is not None else "none"
    if v.fp8 and quant != "none":
        raise TrainingError(
            f"fluxzero.fp8 and lora.base_quant {quant} both change the base's linear layers; keep "
            f"one (FP8 for speed, the quantized base for memory)"
        )
    streamer = plan_streaming(model_cfg, v, device, lora)
    model = born_model(
        model_cfg,
        ds,
        v,
        device,
        weights=weights,
        attention=attention,
        quant=quant,
        place=streamer.place if streamer is not None else None,
    )
    if v.fp8:  # before the adapters: PEFT then wraps the FP8 layers, its own small ones stay bf16
        apply_fp8(model, v.fp8)  # not at ZeRO-3: ds_check.combination_problems refuses that config
    if lora is not None:  # after the weights: the base's names gain `.base_layer` once adapters wrap it
        apply_adapters(model, lora, v)
    skip_last = len(streamer.blocks) if streamer is not None else 0
    compiled = v.compiles_blocks(device.type, lora is not None)
    inside = None  # selective checkpointing goes inside the compiled graph, where its policy steers the partitioner
    if compiled and v.checkpoint_policy == "selective":
        inside = (
            checkpoint_function(v.checkpoint_impl, v.checkpoint_policy, v, compiled=True),
            checkpointed_indices(model, v.checkpoint_every, skip_last),
        )
    if compiled:  # first: full checkpointing then wraps the compiled block
        counts = len({h * w for h, w in latent_sizes})
        apply_compile(model, v.compile_mode, v.compile_backend, v.dynamic_tokens(counts), counts, checkpoint=inside)
        if v.stage == 3:
            zero3_leaf_blocks(model)
    if inside is None:
        apply_activation_checkpointing(
            model, v.checkpoint_every, v.checkpoint_impl, v, skip_last=skip_last, policy=v.checkpoint_policy
        )
    if streamer is not None:  # after compile: the streamed blocks' checkpointing wraps the compiled forward
        streamer.attach(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, ds = client_optimizer(params, ds, v, seed=seed)
    if v.fused_step:
        from fluxzero.train.optim.fused_step import grad_buckets

        optimizer.attach(device, streamer, buckets=grad_buckets(model))
    with ds_patches.accept_host_optimizer(optimizer), ds_patches.keep_on_host(streamer):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer, config=ds)
    if v.fused_step:  # the fused step all-reduces each gradient itself; the engine's would re-create them all
        engine.enable_backward_allreduce = False
    if not os.environ.get(DEEPSPEED_LOOPS_ENV):  # benchmarks set it to measure DeepSpeed's own loops (the before)
        ds_patches.batch_grad_checks(engine.optimizer)
    ds_patches.keep_block_states_whole(engine.optimizer)
    return engine


# ---------------------------------------------------------------------------------------------------------
# Blocks streamed from host memory (fluxzero.train.block_stream): a fused mode's weights or a LoRA's frozen base
# ---------------------------------------------------------------------------------------------------------
def plan_streaming(model_cfg: ModelConfig, v: DSView, device: torch.device, lora: LoraConfig | None):
    """The BlockStreamer of fluxzero.offload_blocks (None when it is 0), its host buffers allocated (and pinned on
    CUDA) before the model is built, so the pretrained weights are copied straight into them. `lora`: the run's
    LoraConfig (its frozen base blocks streamed, its adapters resident) or None."""
    if v.fused_step and lora is not None:
        raise TrainingError(
            f"fluxzero.optimizer_mode {v.optimizer_mode} is for full fine-tunes; a LoRA trains few "
            f"tensors and needs no fused step: choose another optimizer mode or remove the lora: "
            f"section"
        )
    problems = streaming_problems(v, lora)
    if problems:
        raise TrainingError(problems[0])
    k = int(v.offload_blocks or 0)
    if k == 0:
        return None
    from fluxzero.model import build_model
    from fluxzero.train.block_stream import BlockStreamer

    n = model_cfg.depth + model_cfg.depth_single_blocks
    if k > n:
        raise TrainingError(
            f"fluxzero.offload_blocks {k} exceeds the {n} transformer blocks of {model_cfg.name}: set it to at most {n}"
        )
    try:
        return BlockStreamer.plan(build_model(model_cfg, device="meta", dtype=model_dtype(v)), k, device)
    except (MemoryError, ValueError) as e:  # the host cannot hold the streamed weights (block_stream.host_shortfall)
        raise TrainingError(str(e)) from None


def born_model(
    model_cfg: ModelConfig,
    ds: dict,
    v: DSView,
    device: torch.device,
    *,
    weights: str | None = None,
    attention: str = "auto",
    quant: str = "none",
    place=None,
) -> torch.nn.Module:
    """The model in its training dtype (model_dtype), on its device, with the pretrained weights when given and
    the blocks' linears quantized when `quant` (lora.base_quant) asks: no configuration ever holds a float32 copy
    of the weights it does not train.

    Under ZeRO-3, zero.Init partitions every parameter as its module is constructed (no rank ever holds the whole
    model) and makes each tensor in DeepSpeed's dtype as it is created. Below stage 3 each rank holds a full copy:
    build_model materialises it module by module in the training dtype, and each module gets its pretrained
    weights (streamed from the file one tensor at a time) and its quantization right there, so the peak is the
    model as it trains plus one module. The random init runs even when weights replace it: the generator is
    then drawn as at ZeRO-3 and as with random weights, so LoRA adapters drawn after it are the same at every stage.
    """
    from fluxzero.model import build_model

    if v.stage == 3:
        if quant != "none":
            raise TrainingError(
                f"lora.base_quant {quant} cannot be combined with ZeRO-3, which partitions the base "
                f"weights it would quantize; use ZeRO-2 (`fluxzero gen-config --zero-stage 2`) or "
                f"set lora.base_quant: none"
            )
        _meta_outlives_zero_init()
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = build_model(model_cfg, attention=attention)
        if weights:
            load_pretrained(model, weights, model_cfg)
        return model
    finish = _finisher(weights, model_cfg, quant, place)
    return build_model(model_cfg, device=device, dtype=model_dtype(v), attention=attention, finish=finish)


def _meta_outlives_zero_init() -> None:
    """Keep `with torch.device("meta")` working after zero.Init. torch's device context places the factory
    functions (torch.empty, ...) it remembers from its first use in the process; used first inside zero.Init, it
    remembers DeepSpeed's wrappers of them, which zero.Init removes on exit, and from then on every meta build in
    the process lands on the CPU: the weights file's shape check (weights.iter_weights) builds and randomly
    initialises the whole model in float32 on rank 0, drawing rank 0's generator, from which the adapters are drawn
    next and broadcast (a ZeRO-3 run on several ranks then started other adapters than the same run at ZeRO-0 to 2
    or on one rank), and a later build below stage 3 in the same process skips its pretrained weights. One use
    before zero.Init is enough."""
    with torch.device("meta"):
        torch.empty(0)


def _finisher(weights: str | None, model_cfg: ModelConfig, quant: str, place=None):
    """build_model's per-module step: copy the module's pretrained tensors in, then quantize it if it is a block
    linear and `quant` asks for it, then `place` it (None when there is nothing to do)."""
    if not weights and quant == "none" and place is None:
        return None
    if quant != "none":
        from fluxzero.model.quant import QuantError, check_quant, quantize_linear, quantizes

        try:
            check_quant(quant)
        except QuantError as e:
            raise TrainingError(str(e)) from None
    take = _weights_taker(weights, model_cfg) if weights else None

    @torch.no_grad()
    def finish(name: str, module: torch.nn.Module) -> None:
        if take is not None:
            for pname, p in module.named_parameters(recurse=False):
                p.copy_(take(f"{name}.{pname}" if name else pname))
        if quant != "none" and quantizes(name, module):
            quantize_linear(module, quant)
        if place is not None:
            place(name, module)

    return finish


def _weights_taker(path: str, model_cfg: ModelConfig):
    """take(name) -> that tensor of the weights file, read one at a time in file order (iter_weights checks the
    whole file against the model first: a WeightsError names what does not fit before anything is read)."""
    from fluxzero.model.weights import iter_weights

    tensors = iter_weights(path, cfg=model_cfg)
    pending = dict([next(tensors)])

    def take(key):
        while key not in pending:
            k, t = next(tensors)
            pending[k] = t
        return pending.pop(key)

    return take


def model_dtype(v: DSView) -> torch.dtype:
    """The dtype of the module's parameters in training: DeepSpeed's precision, or bf16 for a bf16 optimizer mode
    at ZeRO 0 (where DeepSpeed's bf16 is off)."""
    return torch.bfloat16 if v.trainer_casts_to_bf16 else getattr(torch, v.dtype_name)


def client_optimizer(params: list, ds: dict, v: DSView, seed: int = 0):
    """(optimizer, ds): the optimizer of the config's fluxzero.optimizer_mode (fluxzero.train.optim.optimizers), handed to
    DeepSpeed in place of the optimizer section it would build itself (dropped from ds), with the section's
    lr, betas, eps and weight decay; (None, ds) without a mode, or for fp32 (DeepSpeed's own AdamW). `seed` keys
    the rounding noise of the modes that key it (the fused ones)."""
    if v.optimizer_mode in (None, "fp32"):
        return None, ds
    from fluxzero.train.optim.optimizers import OptimModeError, build_optimizer

    try:
        optimizer = build_optimizer(
            params,
            v.optimizer_mode,
            lr=v.lr if v.lr is not None else 1e-3,
            betas=tuple(v.betas),
            eps=v.eps,
            weight_decay=v.weight_decay,
            noise_seed=seed,
        )
    except OptimModeError as e:
        raise TrainingError(str(e)) from None
    return optimizer, {k: val for k, val in ds.items() if k != "optimizer"}


def apply_adapters(model: torch.nn.Module, lora, v: DSView) -> list[str]:
    """LoRA adapters on `model` (base frozen, adapters trainable), before deepspeed.initialize; returns the
    adapted module names.

    Under ZeRO-3 the base parameters are already partitioned placeholders; the adapters are created as
    ordinary tensors after zero.Init, and deepspeed.initialize converts every parameter that is not a ZeRO
    parameter yet (DeepSpeedZeRoOffload._convert_to_zero_parameters), so they are partitioned like the rest
    (or kept whole below stage3_param_persistence_threshold, 1e5 elements by default). In bf16, below stage 3
    the engine casts the whole module, adapters included, to bf16 (module.bfloat16()) and the ZeRO optimizer
    keeps their fp32 masters, as for full fine-tuning; at stage 3 the base is bf16 from zero.Init and the
    adapters stay fp32 through the conversion (measured, deepspeed 0.19.8), with fp32 partitions in the
    optimizer too. Both train and resume exactly. (data_types.keep_in_fp32_modules acts on buffers only in
    0.19.8, so it cannot choose fp32 adapters below stage 3.)
    DeepSpeed's checkpointing is reentrant: a checkpointed block whose inputs need no gradient (the frozen
    embedders' outputs) would hand none to its adapters, so the embedders' outputs are marked as needing one.
    """
    from fluxzero.model.lora import apply_lora
    from fluxzero.model.lora_keys import LoraError

    if v.compile is True and v.stage == 3:  # measured on CPU with Dynamo's eager and aot_eager backends
        raise TrainingError(
            "compiled blocks (fluxzero.compile.blocks) with LoRA under ZeRO-3 fail in DeepSpeed "
            "0.19.8's backward pass (an adapter-shaped tensor is an empty ZeRO-3 placeholder there); "
            "turn fluxzero.compile.blocks off, or train the LoRA under ZeRO-2, where compile works"
        )
    # a DoRA's magnitude starts from its base weight's row norms, which ZeRO-3 holds partitioned (apply_lora)
    gather = deepspeed.zero.GatheredParameters if v.stage == 3 else None
    try:
        names = apply_lora(model, lora, gather=gather)
    except LoraError as e:
        raise TrainingError(str(e)) from None
    if v.checkpoint_every > 0 and v.checkpoint_impl == "deepspeed":
        for embedder in (model.img_in, model.txt_in):
            embedder.register_forward_hook(_require_grad)
    return names


def _require_grad(module, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output


@torch.no_grad()
def load_pretrained(model: torch.nn.Module, path: str, model_cfg: ModelConfig) -> None:
    """Copy pretrained weights into a ZeRO-3 `model`, module by module into the partitioned params (below stage 3
    born_model copies them in as it builds the model).

    Only rank 0 reads the file, one tensor at a time; each module's own parameters are
    gathered to full shape for the copy (GatheredParameters, modifier_rank=0) and re-partitioned on exit,
    so no rank ever holds more than one module whole.
    """
    rank = dist.get_rank()
    take, error = None, [None]
    if rank == 0:
        try:
            take = _weights_taker(path, model_cfg)
        except (ValueError, OSError) as e:
            error = [str(e)]
    broadcast_objects(error, src=0)
    if error[0]:
        raise TrainingError(error[0])

    for name, module in model.named_modules():
        local = list(module.named_parameters(recurse=False))
        if not local:
            continue
        with deepspeed.zero.GatheredParameters([p for _, p in local], modifier_rank=0):
            if rank == 0:
                for pname, p in local:
                    p.data.copy_(take(f"{name}.{pname}" if name else pname))


def zero3_leaf_blocks(model) -> int:
    """Make every transformer block a ZeRO-3 leaf module (DeepSpeed's `set_z3_leaf_modules`); returns how many.

    DeepSpeed then hooks the block itself, gathering all its parameters before its forward (and before its
    backward, hence before a checkpointed block's recompute), and none of its submodules. Those hooks run in
    the block's `__call__`, outside the compiled forward, so each block class compiles into one graph as at
    stages 0-2. Without it, deepspeed 0.19.8's per-submodule hooks (`torch.compiler.disable`d) break the graph
    at every submodule, and Dynamo's recompile limit (8) sends most of nn.Linear.forward's frames back to
    eager; compile(checkpoint(block)) would compile nothing at all. Costs one whole block gathered at a time
    (FLUX.1-dev: 0.68 GB bf16 for a double block), which ZeRO-3's defaults here (max live parameters 1e9,
    reuse distance 1e9) keep gathered through a block's forward anyway. Call before deepspeed.initialize.
    """
    from deepspeed.utils import set_z3_leaf_modules

    classes = list(dict.fromkeys(type(b) for b in list(model.double_blocks) + list(model.single_blocks)))
    return len(set_z3_leaf_modules(model, classes))


def set_lr(engine, lr: float) -> float | None:
    """Set every param group's lr (a tensor lr, as torchao keeps it, in place); returns the lr it had before."""
    before = None
    for group in engine.optimizer.param_groups:
        old = group["lr"]
        before = float(old) if before is None else before
        if isinstance(old, torch.Tensor):
            old.fill_(lr)
        else:
            group["lr"] = lr
    return before
