"""The memory planner: the memory model of a fluxzero run, what every GPU and every host holds at the peak of a training step.

Pure Python (no torch, no deepspeed): `fluxzero estimate` and `gen-config --fit` answer instantly.

The model is an itemised sum, each item derived from FLUX.1's architecture or from what DeepSpeed 0.19.8
allocates (file and function named next to each formula):

  model states    bf16/fp16 parameters, gradients, fp32 master copy and optimizer states, per ZeRO stage
                  and offload choice; DeepSpeed's transient copies at the optimizer step      (model_states)
  communication   gradient reduction buckets, ZeRO-3 gathered ("live") and prefetched parameters,
                  parameters under the persistence threshold                                  (model_states)
  activations     tensors autograd saves for backward, counted tensor by tensor from fluxzero.model's
                  blocks (tests check the count against saved_tensors_hooks on the real model), block
                  inputs only for checkpointed blocks (and their matmul and attention outputs under the
                  selective policy), plus one block's recompute and backward working set
                                                                                              (activations)
  allocator       the caching allocator's fragmentation (reserved - allocated) and the CUDA context (breakdown)

The run itself (RunSpec, parameter inventory, what a DeepSpeed config decides) is `spec`; the hardware, the
verdict and the `--fit` search are `fit`. A step has two memory peaks and the larger one decides: the end of
forward / start of backward (activations) and the optimizer step (fp32 gradient copies). Sizes are bytes;
GiB = 2**30 bytes. This package re-exports what callers use: `from fluxzero import plan as memory; memory.X`.
"""

from fluxzero.config.deepspeed.check import CHECKPOINT_POLICIES  # noqa: F401
from fluxzero.config.deepspeed.view import checkpointed_blocks  # noqa: F401  (one definition; memory.checkpointed_blocks)
from fluxzero.plan.activations import (  # noqa: F401
    activation_bytes,
    activation_items,
    adapter_block_fixed,
    adapter_workspace,
    block_backward_workspace,
    checkpointed_split,
    double_block_kept,
    double_block_saved,
    lora_block_saved,
    outside_blocks_saved,
    selective_split,
    single_block_kept,
    single_block_saved,
)
from fluxzero.plan.breakdown import Estimate, estimate  # noqa: F401
from fluxzero.plan.fit import (  # noqa: F401
    BASE_QUANT_CHOICES,
    CHECKPOINT_CHOICES,
    COMMON_HOST_GIB_PER_GPU,
    FIT_MODES,
    FIT_PINS,
    GEN_CONFIG_PINS,
    GPU_FP8_MATMUL,
    GPU_MEMORY_GIB,
    STAGE_OFFLOAD_GRID,
    FitRequest,
    FitResult,
    GenConfigFit,
    Hardware,
    checkpointing_text,
    fit,
    fit_gen_config,
    fit_grid,
    gen_config_zero,
    gpu_quant_problem,
    lora_grid,
    table,
    throughput_proxy,
    verdict,
    zero_label,
)
from fluxzero.plan.model_states import (  # noqa: F401
    MODE_STEP_TEMP,
    communication_items,
    model_state_items,
    stream_traffic,
)
from fluxzero.plan.spec import (  # noqa: F401
    ATTENTION_KERNELS,
    BASE_QUANT_BYTES,
    FRAGMENTATION,
    OPTIMIZER_STATE_BYTES,
    OPTION_FIELDS,
    PHASES,
    PRECISION_BYTES,
    GiB,
    Item,
    ParamInventory,
    RunSpec,
    ZeroSettings,
    base_bytes,
    image_tokens,
    lora_config,
    optim_mode,
    param_inventory,
    run_options_from_ds_config,
    section_fields,
    streamed_blocks,
    trained_params,
)
