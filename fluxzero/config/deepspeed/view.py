"""The one parsed view of a DeepSpeed config: what the trainer, the memory model, `check-config`, `estimate`
and gen-config's own checks read. No other module reads raw DeepSpeed keys. Pure Python.

Who owns what (the rule docs/training.md states): the DeepSpeed JSON owns everything DeepSpeed's engine does
(ZeRO stage, offload, precision, batch arithmetic, optimizer and lr, lr scheduler, gradient clipping) plus the
memory policy gen-config --fit chooses together with the stage (the "fluxzero" section: activation
checkpointing, compiled blocks, the optimizer mode, blocks streamed from host memory). The run file owns what the trainer does around the engine (model, weights,
data, steps, seed, flow, logging, checkpoints, export). No setting is in both.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from fluxzero.config.deepspeed import adam_impl
from fluxzero.dtypes import TORCH_NAMES

FLUXZERO_SECTION = "fluxzero"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class DSConfigError(ValueError):
    """A DeepSpeed config that cannot be used; `problems` holds one sentence per finding."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class DSView:
    """A DeepSpeed config as fluxzero reads it. Absent keys mean what DeepSpeed 0.19.8 does with them."""

    stage: int = 0
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16"
    offload_optimizer: str = "none"  # "none" | "cpu" | "nvme"
    offload_param: str = "none"
    # offload_optimizer.pin_memory, offload_param.pin_memory (deepspeed 0.19.8's default false); None: no section
    pin_offload_optimizer: bool | None = None
    pin_offload_param: bool | None = None
    # zero_optimization's other keys (bucket sizes, overlap_comm, ...) as sorted (key, value) pairs, as written
    zero_settings: tuple = dataclasses.field(default=(), hash=False)  # values may be JSON objects (unhashable)
    micro_batch: int | None = None  # train_micro_batch_size_per_gpu; None: not set (or "auto")
    grad_accum: int | None = None  # gradient_accumulation_steps; None: not set (DeepSpeed derives it, or 1)
    global_batch: int | None = None  # train_batch_size (gen-config's --global-batch)
    gradient_clipping: float | None = None  # None: not set (deepspeed 0.19.8 then clips at 1.0)
    checkpoint_every: int = 0  # fluxzero.activation_checkpointing.every_k_blocks; 0 = none
    checkpoint_impl: str = "torch"  # "torch" | "deepspeed"
    checkpoint_policy: str = "full"  # fluxzero.activation_checkpointing.policy: "full" | "selective" (check.py)
    partition_activations: bool = False  # DeepSpeed's activation_checkpointing (implementation deepspeed)
    cpu_checkpointing: bool = False
    compile: bool | None = None  # fluxzero.compile.blocks; None: not set, the trainer decides (compiles_blocks)
    compile_mode: str = "default"
    fp8: str | None = None  # fluxzero.fp8.recipe: FP8 matmuls in the blocks (torchao float8 training); None = bf16
    compile_backend: str = "inductor"
    compile_dynamic: bool | None = None  # fluxzero.compile.dynamic; None: not set, the data decides (dynamic_tokens)
    optimizer: str | None = None  # optimizer.type, lower case; None: no optimizer section
    allow_untested_optimizer: bool = False  # zero_allow_untested_optimizer
    optimizer_impl: str = "fused"  # Adam(W): "torch" (torch_adam), "torch-fused" (and fused), "fused" (DeepSpeed's)
    lr: float | None = None  # optimizer.params.lr
    betas: tuple = (0.9, 0.999)  # optimizer.params.betas, eps, weight_decay (torch AdamW's defaults when absent;
    eps: float = 1e-8  # what the trainer hands a client optimizer of an optimizer_mode)
    weight_decay: float = 0.01
    scheduler: str | None = None  # scheduler.type; None: constant lr
    scheduler_total_steps: int | None = None  # scheduler.params.total_num_steps (WarmupDecayLR, WarmupCosineLR)
    load_universal: bool = False  # checkpoint.load_universal: resume from DeepSpeed's universal checkpoint
    # fluxzero.optimizer_mode: a name in fluxzero.config.optim_modes.MODES; None = DeepSpeed builds the
    # "optimizer" section's optimizer on its fp32 masters (the trainer then builds no client optimizer)
    optimizer_mode: str | None = None
    bf16_master_weights_and_grads: bool = False  # bf16.bf16_master_weights_and_grads
    bf16_optimizer_states: bool = False  # bf16.bf16_optimizer_states
    force_ds_cpu_optimizer: bool = True  # zero_force_ds_cpu_optimizer (0.19.8 default true)
    # fluxzero.offload_blocks: the LAST K transformer blocks (double then single, one index, as for
    # checkpointing) keep their bf16 weights in pinned host memory and are streamed to the accelerator one block
    # ahead (fluxzero.train.block_stream): a fused optimizer mode's weights, or a LoRA's frozen base below ZeRO-3.
    # 0: every block resident
    offload_blocks: int = 0

    @property
    def dtype_name(self) -> str:
        """The dtype DeepSpeed gives the module's parameters ("float32", "bfloat16", "float16")."""
        return TORCH_NAMES[self.precision]

    @property
    def trainer_casts_to_bf16(self) -> bool:
        """The model is born in bf16 (a bf16-master optimizer mode at ZeRO 0; optim_modes.trainer_casts_to_bf16)."""
        from fluxzero.config.optim_modes import trainer_casts_to_bf16  # pure

        return trainer_casts_to_bf16(self.optimizer_mode, self.stage)

    @property
    def fused_step(self) -> bool:
        """The optimizer mode steps each parameter during backward (optim_modes.OptimMode.fused)."""
        from fluxzero.config.optim_modes import MODES  # pure

        mode = MODES.get(self.optimizer_mode) if isinstance(self.optimizer_mode, str) else None
        return mode is not None and mode.fused

    def checkpointed_blocks(self, n_blocks: int) -> int:
        """How many of n_blocks the trainer checkpoints: block i iff i % every_k_blocks == 0, and every streamed
        block (the last offload_blocks, which are always recomputed in backward)."""
        streamed = min(max(self.offload_blocks, 0), n_blocks) if isinstance(self.offload_blocks, int) else 0
        return checkpointed_blocks(n_blocks - streamed, self.checkpoint_every) + streamed

    def compiles_blocks(self, device_type: str, lora: bool) -> bool:
        """Whether the trainer compiles the blocks: fluxzero.compile.blocks when the config sets it; when it does
        not, on a GPU below ZeRO-3, where it was measured to win for a LoRA and a full fine-tune (benchmarks/
        RESULTS.md), and never on the CPU, where
        the compile takes longer than the short runs it would speed up. ZeRO-3 is left eager unless asked (not
        measured there; with LoRA it fails, engine.apply_adapters says why)."""
        if self.compile is not None:
            return self.compile
        return device_type == "cuda" and self.stage < 3

    def dynamic_tokens(self, token_counts: int) -> bool | None:
        """How compiled blocks treat the image token count (fluxzero.model.compile.apply_compile's dynamic_tokens):
        fluxzero.compile.dynamic when the config sets it (true: a symbolic token axis, false: a graph per token
        count); when it does not, symbolic where the data holds `token_counts` > 1 (several aspect buckets, which
        then share one graph per block class), else None (Dynamo's default: one token count, one graph)."""
        if self.compile_dynamic is not None:
            return self.compile_dynamic
        return True if token_counts > 1 else None

    def batch_for(self, world_size: int) -> tuple[int, int, int]:
        """(micro batch, accumulation, global batch) for `world_size` ranks, derived as DeepSpeed does.

        Raises DSConfigError with one sentence when the config does not divide for that world size.
        """
        micro, accum, train = self.micro_batch, self.grad_accum, self.global_batch
        if micro is None and train is None:
            raise DSConfigError("train_micro_batch_size_per_gpu is not set: set it (and gradient_accumulation_steps)")
        if micro is not None and accum is None:
            accum = train // (micro * world_size) if train is not None else 1
        elif micro is None:
            accum = accum or 1
            micro = train // (accum * world_size)
        if micro < 1 or accum < 1 or (train is not None and train != micro * accum * world_size):
            fits = train // (micro * accum) if micro >= 1 and accum >= 1 and train else None
            hint = f" (it fits {fits} ranks)" if fits and train % (micro * accum) == 0 else ""
            raise DSConfigError(
                f"train_batch_size {train} is not train_micro_batch_size_per_gpu {self.micro_batch} x "
                f"gradient_accumulation_steps {self.grad_accum} x world size {world_size}{hint}: fix the batch "
                f"sizes (`fluxzero gen-config --world-size {world_size}`) or launch the ranks they imply"
            )
        return micro, accum, micro * accum * world_size


def checkpointed_blocks(n_blocks: int, every_k: int) -> int:
    """How many of n_blocks are checkpointed when block i is checkpointed iff i % every_k == 0 (0 = none)."""
    return 0 if every_k <= 0 else -(-n_blocks // every_k)


def _int_or_none(ds: dict, key: str):
    v = ds.get(key)
    return None if v is None or v == "auto" else v


def view(ds: dict) -> DSView:
    """The view of a DeepSpeed config dict; values are taken as they are (`ds_check.check` reports bad ones).

    Raises DSConfigError when a section has a type the view cannot read (say "zero_optimization": 2).
    """

    def section(d: dict, key: str, where: str | None = None) -> dict:
        value = d.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise DSConfigError(f"{where or key} must be a JSON object, got {json.dumps(value)}")
        return value

    if not isinstance(ds, dict):
        raise DSConfigError(f"the config must be a JSON object ({{...}}), got {type(ds).__name__}")
    z = section(ds, "zero_optimization")
    oo = section(z, "offload_optimizer", "zero_optimization.offload_optimizer")
    op = section(z, "offload_param", "zero_optimization.offload_param")
    bf16 = section(ds, "bf16") or section(ds, "bfloat16")
    fp16 = section(ds, "fp16")
    precision = "bf16" if bf16.get("enabled") is True else "fp16" if fp16.get("enabled") is True else "fp32"
    opt = section(ds, "optimizer")
    params = section(opt, "params", "optimizer.params")
    typ = opt.get("type")
    impl = adam_impl.optimizer_impl_of_params(params)
    sch = section(ds, "scheduler")
    sch_params = section(sch, "params", "scheduler.params")
    fz = section(ds, FLUXZERO_SECTION)
    fac = section(fz, "activation_checkpointing", "fluxzero.activation_checkpointing")
    comp = section(fz, "compile", "fluxzero.compile")
    ac = section(ds, "activation_checkpointing")
    clip = ds.get("gradient_clipping")
    return DSView(
        stage=z.get("stage", 0),
        precision=precision,
        offload_optimizer=oo.get("device", "none"),
        offload_param=op.get("device", "none"),
        pin_offload_optimizer=oo.get("pin_memory") is True if z.get("offload_optimizer") is not None else None,
        pin_offload_param=op.get("pin_memory") is True if z.get("offload_param") is not None else None,
        zero_settings=tuple(
            sorted((k, val) for k, val in z.items() if k not in ("stage", "offload_optimizer", "offload_param"))
        ),
        micro_batch=_int_or_none(ds, "train_micro_batch_size_per_gpu"),
        grad_accum=_int_or_none(ds, "gradient_accumulation_steps"),
        global_batch=_int_or_none(ds, "train_batch_size"),
        gradient_clipping=None if clip is None else clip,
        checkpoint_every=fac.get("every_k_blocks", 0),
        checkpoint_impl=fac.get("implementation", "torch"),
        checkpoint_policy=fac.get("policy", "full"),
        partition_activations=ac.get("partition_activations") is True,
        cpu_checkpointing=ac.get("cpu_checkpointing") is True,
        compile=comp["blocks"] if isinstance(comp.get("blocks"), bool) else None,
        compile_mode=comp.get("mode", "default"),
        fp8=section(fz, "fp8", "fluxzero.fp8").get("recipe"),
        compile_backend=comp.get("backend", "inductor"),
        compile_dynamic=comp["dynamic"] if isinstance(comp.get("dynamic"), bool) else None,
        optimizer=typ.lower() if isinstance(typ, str) else None,
        allow_untested_optimizer=ds.get("zero_allow_untested_optimizer") is True,
        optimizer_impl=impl,
        lr=params.get("lr"),
        betas=tuple(params.get("betas", (0.9, 0.999))),
        eps=params.get("eps", 1e-8),
        weight_decay=params.get("weight_decay", 0.01),
        scheduler=sch.get("type") if sch else None,
        scheduler_total_steps=sch_params.get("total_num_steps"),
        load_universal=section(ds, "checkpoint").get("load_universal") is True,
        optimizer_mode=fz.get("optimizer_mode"),
        bf16_master_weights_and_grads=bf16.get("bf16_master_weights_and_grads") is True,
        bf16_optimizer_states=bf16.get("bf16_optimizer_states") is True,
        force_ds_cpu_optimizer=ds.get("zero_force_ds_cpu_optimizer", True) is not False,
        offload_blocks=fz.get("offload_blocks", 0),
    )
