"""Model states and communication buffers of one rank: parameters, gradients, master copies and optimizer
states per ZeRO stage and offload choice, the optimizer step's transient copies, EMA, engine start and model
loading; reduction buckets and ZeRO-3's gathered parameters. Each formula names the DeepSpeed 0.19.8 code it
follows.

Pure Python (no torch, no deepspeed).
"""

from __future__ import annotations

import fnmatch
import math

from fluxzero.config import architecture, optim_modes
from fluxzero.config.architecture import linear_shapes
from fluxzero.config.lora import adapter_param_count
from fluxzero.plan.activations import activation_bytes
from fluxzero.plan.spec import (
    BASE_QUANT_MATMUL,
    OPTIMIZER_STATE_BYTES,
    PRECISION_BYTES,
    GiB,
    Item,
    ParamInventory,
    RunSpec,
    base_bytes,
    lora_config,
    optim_mode,
    streamed_blocks,
    trained_params,
)

PROCESS_ITEM = "process (CUDA runtime, libraries)"  # the host allowance of a running rank itself


# Transient bytes per stepped element of one optimizer step beyond its states, by optimizer mode (each mode's
# step_temp, fluxzero.config.optim_modes)
MODE_STEP_TEMP = {n: m.step_temp for n, m in optim_modes.MODES.items() if m.step_temp is not None}
# The host modes (cpu-*) step HOST_STEP_CHUNK elements at a time: bytes per element of one chunk, counted from
# their ops (g, m, v and the weight in fp32, stochastic rounding's int32 noise and bit arithmetic; the 8-bit
# states' int64 bucket indices instead); benchmarks/optim_step_memory.py measured 130 MB (cpu-bf16-sr, 2e7
# elements: 31 B per chunk element), a bound the allocator's reuse of freed chunks can hide.
HOST_STEP_TEMP = 32.0


def pinned_block(nbytes: int) -> int:
    """Bytes torch's pinned-memory allocator takes for a request of `nbytes`: the next power of two
    (at::CachingHostAllocator; a pinned_max_round_threshold_mb in PYTORCH_ALLOC_CONF, where a torch release has
    it, turns the rounding off above that size, which this does not model)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def stepped_at_once(mode, elements: int) -> int:
    """Elements of a flat tensor of `elements` that `mode` (an OptimMode, or None for DeepSpeed's optimizer)
    holds step temporaries for at once: its step_chunk, or the whole tensor."""
    chunk = getattr(mode, "step_chunk", None)
    return elements if chunk is None else min(elements, chunk)


def model_state_items(s: RunSpec, inv: ParamInventory, acts: dict[str, int] | None = None) -> list[Item]:  # noqa: C901
    """The parameters', gradients', masters' and optimizer states' items of `s`; `acts`: its activation_bytes when
    the caller has them (a fused mode's step is counted beyond its block's recompute and working set)."""
    N, b = s.world_size, PRECISION_BYTES[s.precision]
    total = inv.total
    lora = lora_config(s) is not None
    # P: the parameters that train (gradients, master copy, optimizer states); the LoRA base is frozen
    P = trained_params(s, inv)
    frozen = total - P
    part = math.ceil(P / N)  # elements of one rank's partition
    mode = optim_mode(s)
    opt = OPTIMIZER_STATE_BYTES[s.optimizer]
    master_b = 4  # DeepSpeed's fp32 masters
    if mode is not None:  # the mode's own bytes (fluxzero.config.optim_modes), partitioned below as DeepSpeed does
        opt = mode.states if s.stage == 0 or mode.states_flat is None else mode.states_flat
        master_b = int(mode.master) if mode.master_dtype == "bf16" else 4
    bf16_master = mode is not None and mode.master_dtype == "bf16"
    off_opt, off_par = s.offload_optimizer != "none", s.offload_param != "none"
    opt_dev = {"none": "gpu", "cpu": "host", "nvme": "nvme"}[s.offload_optimizer]
    largest_trained = max(inv.tensor_sizes) if not lora else max(1, P // max(1, _adapted_linears(s)))
    items: list[Item] = []

    def add(name, nbytes, where="gpu", phase="resident", note="", ds=False):
        items.append(Item(name, int(nbytes), where, phase, note, ds))

    # --- parameters and gradients in the model's dtype
    what = "LoRA adapters" if lora else "parameters"
    base = base_bytes(s, inv)
    base_dtype = s.base_quant or s.precision
    # fluxzero.train.block_stream: the last K blocks' weights (a fused mode's trained ones, a LoRA's frozen base) in
    # one host buffer per block, pinned in place (no rounding)
    streamed = sum(streamed_blocks(s, inv)) if s.stage < 3 else 0
    if lora:
        base -= b * streamed  # what stays on the GPU; a LoRA's adapters all stay there
    if s.stage < 3:
        if lora:
            add(
                f"frozen base parameters ({base_dtype})",
                base,
                note="LoRA: no gradients, no optimizer states"
                + (
                    f"; linear weights {s.base_quant} ({BASE_QUANT_MATMUL[s.base_quant]}) + per-channel scales"
                    if s.base_quant
                    else ""
                )
                + (f"; all but the last {s.offload_blocks} blocks" if streamed else ""),
                ds=True,
            )
        if streamed and not lora:
            add(
                f"{what} (resident, {s.precision})",
                b * (P - streamed),
                note=f"all but the last {s.offload_blocks} blocks",
                ds=True,
            )
        if streamed:
            add(
                f"streamed block weights ({s.precision}, pinned)",
                b * streamed,
                "host",
                note=f"the last {s.offload_blocks} blocks, cudaHostRegister'd: exactly their bytes",
            )
        if lora or not streamed:
            add(f"{what} (full, {s.precision})", b * P, note="every rank holds all of them below stage 3", ds=True)
    else:
        where = {"none": "gpu", "cpu": "host", "nvme": "nvme"}[s.offload_param]
        if lora:
            add(
                f"frozen base partition ({s.precision})",
                b * math.ceil(frozen / N),
                where,
                note="ZeRO-3 partitions the frozen base too",
                ds=True,
            )
        add(f"{what} partition ({s.precision})", b * part, where, note="1/N of the parameters", ds=True)
    overlap = s.zero.overlap_comm if s.zero.overlap_comm is not None else s.stage == 3
    fused = mode is not None and mode.fused
    if fused and N > 1:  # fluxzero.train.optim.fused_step: a block's gradients averaged in one all_reduce, then stepped
        block = max(inv.double_block if s.model.depth else 0, inv.single_block if s.model.depth_single_blocks else 0)
        add(
            f"gradients of one block, and their flat copy ({s.precision})",
            2 * b * block,
            phase="train",
            note="no gradient buffer: a block's gradients wait for its last, one all_reduce averages them, each "
            "is stepped",
        )
    elif fused:  # each gradient stepped and dropped as backward makes it
        add(
            f"gradient being stepped (one tensor, {s.precision})",
            b * largest_trained,
            phase="train",
            note="no gradient buffer: each tensor is stepped in backward",
        )
    elif s.stage == 0:
        # made tensor by tensor in backward (the train phase counts what exists at its peak: "gradients made
        # in backward ..."), all present at the step, freed by zero_grad(set_to_none=True) after it
        add(f"gradients (full, {s.precision})", b * P, phase="step", note="param.grad from backward to the step")
    elif not off_opt:
        add(
            f"gradient partition ({s.precision})",
            b * part,
            ds=True,
            note="stage 1/2: grads_in_partition, then averaged_gradients; stage 3: grad_partitions_flat_buffer",
        )
    if s.stage == 1:
        # Measured (benchmarks/archive/zero1_grad_probe.py, real deepspeed 0.19.8 engines, 2 ranks): stage 1 holds a whole
        # gradient's worth until backward ends. Without overlap_comm every param.grad stays whole until the
        # epilogue reduces them (stage_1_and_2.reduce_gradients); with it, this rank's own gradients are copied
        # into its partition as they come, but the other ranks' parameters keep their param.grad until then.
        if overlap:
            add(
                f"gradients of the other ranks' partitions ({s.precision})",
                b * (P - part),
                phase="train",
                note="stage 1 with overlap_comm: kept until backward ends (measured)",
            )
        else:
            add(
                f"gradients (full, {s.precision}) until backward ends",
                b * P,
                phase="train",
                note="stage 1 without overlap_comm (measured)",
            )

    # --- master copy and optimizer states
    mname = "bf16 master" if bf16_master else "fp32 master"
    sname = f"optimizer states ({mode.name})" if mode is not None else "optimizer states (fp32)"
    if s.stage == 0:
        if bf16_master:
            pass  # bf16 off in DeepSpeed, the model cast by the trainer: the optimizer steps the weights themselves
        elif b < 4:
            add("fp32 master parameters", 4 * P, note="DeepSpeed FP16_Optimizer (bf16/fp16 at stage 0)")
        add(sname, opt * P)
    else:
        add(f"{mname} partition", master_b * part, opt_dev, note="single_partition_of_fp32_groups", ds=True)
        add(sname.replace("states", "state partition"), opt * part, opt_dev, ds=True)

    # --- transient copies at the optimizer step
    host_mode = mode is not None and mode.needs_offload
    if host_mode:
        impl_temp = HOST_STEP_TEMP
        tnote = f"fluxzero.train.optim.host: {optim_modes.HOST_STEP_CHUNK} elements at a time"
    elif mode is not None:
        impl_temp = MODE_STEP_TEMP[mode.name]
        tnote = "benchmarks/optim_step_memory.py (CPU, flat partition)"
    else:
        impl_temp = 4 if s.optimizer_impl == "torch" else 0
        tnote = "_foreach_sqrt(exp_avg_sq)"
    if s.stage == 0:
        if fused:
            # a tensor is stepped inside its block's backward, once its gradient is complete: in memory the block's
            # recompute and backward working set have mostly freed by then, so only what the step needs beyond them
            # adds to the peak (measured on FLUX.1-dev, benchmarks/RESULTS.md "--fit's full fine-tunes": counting
            # both over-predicted every streamed row by 2.0 GiB)
            a = acts if acts is not None else activation_bytes(s)
            add(
                "optimizer working set beyond the block's",
                max(0, impl_temp * largest_trained - a["recompute"] - a["workspace"]),
                phase="train",
                note=f"{impl_temp * largest_trained / GiB:.2f} GiB; {tnote}",
            )
        elif bf16_master:
            # torch's optimizers loop over tensors: one tensor's working set at a time
            add("optimizer working set at step (one tensor)", impl_temp * largest_trained, phase="step", note=tnote)
        elif b < 4 and s.optimizer_impl == "fused" and mode is None:
            add(
                "fp32 gradient copies at step",
                8 * P,
                phase="step",
                note="FP16_Optimizer.step: list of p.grad.float() (4 B) flattened into one fp32 buffer (4 B)",
            )
        elif b < 4:
            add(
                "fp32 gradient copies at step",
                4 * P,
                phase="step",
                note="FP16_UnfusedOptimizer.step: fp32_param.grad = p.grad.to(fp32) for every tensor, then one "
                "optimizer step over all",
            )
        if impl_temp and not bf16_master:
            add(
                "optimizer temporary at step" if mode else "optimizer temporary (torch foreach)",
                impl_temp * (largest_trained if mode else P),
                phase="step",
                note=tnote,
            )
    elif not off_opt:
        sg = (
            part
            if s.stage < 3
            else min(part, inv.largest_sub_group(N, s.zero.sub_group_size))
            if not lora
            else min(part, s.zero.sub_group_size)
        )
        note = (
            "stage_1_and_2.step: flatten(averaged_gradients) then .float()"
            if s.stage < 3
            else "stage3._prepare_fp32_grad_for_sub_group, one sub_group_size at a time"
        )
        if not bf16_master:  # with bf16 masters .to(master dtype) returns the flattened copy itself
            add("fp32 gradient partition at step", 4 * sg, phase="step", note=note, ds=True)
        add(f"flattened {s.precision} gradient copy at step", b * sg, phase="step", note=note)
        if impl_temp:
            add(
                "optimizer temporary at step" if mode else "optimizer temporary (torch foreach)",
                impl_temp * stepped_at_once(mode, sg),
                phase="step",
                note=tnote + (f", {mode.step_chunk} elements at a time" if mode and mode.step_chunk else ""),
            )
    else:
        # The optimizer runs on the host; gradients travel there in the master's dtype during backward.
        add(
            "%s gradient partition (offloaded)" % ("bf16 master" if bf16_master else "fp32"),
            master_b * part,
            opt_dev,
            ds=True,
            note="pinned buffers that receive the reduced gradients",
        )
        if impl_temp:
            stepped = part if s.stage < 3 else min(part, s.zero.sub_group_size)
            add(
                "optimizer temporary at step (host)",
                impl_temp * (min(stepped, optim_modes.HOST_STEP_CHUNK) if host_mode else stepped),
                opt_dev,
                phase="step",
                note=tnote,
            )
        if s.stage < 3:
            add(
                f"{s.precision} partition staging buffer",
                b * part,
                "host",
                note="param_buffer_of_bit16_for_cpu_offload_groups",
            )
            add(
                "gradient offload staging (largest tensor)",
                b * largest_trained,
                note="temp_grad_buffer_for_gpu_offload",
            )
            add(
                "gradient offload staging (largest tensor, pinned)",
                b * largest_trained,
                "host",
                note="temp_grad_buffer_for_cpu_offload",
            )
    if off_opt and s.stage == 3 and b < 4:
        add(
            f"{s.precision} gradient partition (offloaded)",
            b * part,
            "host",
            note="grad_partitions_flat_buffer lives on the host with optimizer offload",
        )
    if s.offload_optimizer == "nvme" or s.offload_param == "nvme":
        swap = min(part, s.zero.sub_group_size)
        add(
            "NVMe swap buffers (pinned)",
            (4 + opt) * swap + (5 * 100_000_000 * b if off_par else 0),
            "host",
            note="one sub-group's fp32 master + states swapped in; parameters: buffer_count 5 x buffer_size 1e8",
        )

    # --- page-locked offload buffers. torch's pinned-memory allocator (at::CachingHostAllocator, which DeepSpeed's
    # pin_memory goes through) rounds every block up to a power of two and keeps freed blocks cached; without
    # this the host need of GPU runs with offload was predicted well short (benchmarks/RESULTS.md, "Host memory
    # of loading pretrained weights").
    pinned: list[int] = []  # bytes of each pinned buffer as DeepSpeed 0.19.8 asks for it
    if s.offload_optimizer == "cpu" and s.pin_offload_optimizer and s.stage in (1, 2):
        # stage_1_and_2.__init__: the master partition, its bit16 staging copy and its gradient per group,
        # and one largest-tensor gradient staging buffer
        pinned += [master_b * part, b * part, master_b * part, b * largest_trained]
    elif s.offload_optimizer == "cpu" and s.pin_offload_optimizer and s.stage == 3:
        # stage3: grad_partitions_flat_buffer, and one gradient buffer per optimizer sub-group
        groups = [part] if lora else inv.sub_group_sizes(N, s.zero.sub_group_size)
        pinned += ([b * part] if b < 4 else []) + [master_b * n for n in groups]
    if s.offload_param == "cpu" and s.pin_offload_param and s.stage == 3:
        # zero.Init pins each parameter's partition as it is made (persistent ones stay on the GPU); the trained
        # ones then move into one flat pinned buffer (param_groups_fp16_flat_cpu_memory) and their first blocks
        # stay in the allocator's cache
        pinned += [b * -(-n // N) for n in inv.tensor_sizes if n >= s.zero.stage3_param_persistence_threshold]
        add(
            "trained parameters' flat buffer (pinned)",
            b * part,
            "host",
            note="param_groups_fp16_flat_cpu_memory; the partitions first pinned one by one stay cached",
        )
        pinned.append(b * part)
    rounding = sum(pinned_block(n) - n for n in pinned)
    if rounding:
        add(
            "pinned-memory rounding",
            rounding,
            "host",
            note=f"{len(pinned)} page-locked buffers, each rounded up to a power of two by torch's allocator",
        )

    # --- EMA of the trained weights (fluxzero.train.ema.ShardedEMA): beside this rank's master partition
    if s.ema is not None:
        from fluxzero.config.ema import EmaConfig

        # ZeRO 1-3 partition the masters; at stage 0 gen-config's bf16 config gets FP16_UnfusedOptimizer, whole
        # masters on every rank (only DeepSpeed's BF16_Optimizer, with an fp32 grad_accum_dtype, would partition)
        partitioned = s.stage >= 1
        per = EmaConfig(dtype=s.ema).bytes_per_param(N, partitioned)
        where = "host" if s.ema_device == "cpu" else "gpu"
        add(
            f"EMA ({s.ema})",
            per * P,
            where,
            note=("1/N, like the master partition" if partitioned and N > 1 else "whole on every rank")
            + f", ema.device {s.ema_device}",
        )

    # --- building the model and the engine (fluxzero.train.engine.build_engine). The model is born in its
    # training dtype: under a bf16 config directly in bf16 on the GPU (or on the meta device, then loaded), so no
    # fp32 copy of a weight it does not train ever exists; a quantized base is quantized layer by layer as its
    # weights load (one layer in bf16 at a time). What deepspeed.initialize adds on top: below stage 3 the
    # ZeRO-1/2 optimizer copies the trained parameters into one flat buffer (both alive while it copies; 0.19.8
    # goes through the host only when the device's free memory is short, which a per-process memory cap such as
    # torch.cuda.set_per_process_memory_fraction does not change, so a capped run sees this peak); the
    # FP16_Optimizer of stage 0 makes that flat copy and its fp32 master clone of it. Stage 3 builds the model
    # partitioned (zero.Init): nothing whole, no init peak.
    model_bytes = base + b * P
    # a quantized layer is made in bf16 first; a LoRA's streamed layer is made on the GPU, then moved to the host
    one_layer = b * inv.largest_layer if s.base_quant or (lora and streamed) else 0
    if fused and s.offload_blocks:
        add(
            "building the engine",
            model_bytes - b * streamed + b * inv.largest_layer,
            phase="init",
            note="resident bf16 weights; each streamed module is made here, then moved to the host",
        )
    elif optim_modes.trainer_casts_to_bf16(s.optimizer_mode, s.stage):
        add(
            "building the engine",
            model_bytes + one_layer,
            phase="init",
            note="bf16 model, stepped by the client optimizer itself (no master copy)",
        )
    elif s.stage == 0 and b < 4 and s.optimizer_impl != "fused" or (s.stage == 0 and mode is not None):
        # torch AdamW is not a DeepSpeed FusedAdam: the engine wraps it in FP16_UnfusedOptimizer, whose
        # initialize_optimizer_states gives every tensor a zero bf16 and fp32 grad and runs one step (which
        # creates the states) before it frees the grads: the same 20 B/param as the steady-state step
        temp = 4 * P if s.optimizer_impl == "torch" and mode is None else 0
        add(
            "building the engine",
            (b + 4 + b + 4 + opt) * P + base + temp + one_layer,
            phase="init",
            note="params, fp32 master clones, zero bf16 + fp32 grads, optimizer states (FP16_UnfusedOptimizer)",
        )
    elif s.stage == 0:
        add(
            "building the engine",
            model_bytes + (b + 4 if b < 4 else 0) * P + one_layer,
            phase="init",
            note=f"{s.precision} model" + (", flat copy and fp32 master (FP16_Optimizer)" if b < 4 else ""),
        )
    elif s.stage < 3:
        add(
            "building the engine",
            model_bytes + b * P + one_layer,
            phase="init",
            note=f"{s.precision} model, trained parameters flattened (stage_1_and_2 __init__)",
        )

    # --- host memory while the weights load (each local rank, before deepspeed.initialize). The trainer never holds
    # the model on the host: below stage 3 engine.born_model materialises it on its device module by module and
    # copies each module's tensors in as the memory-mapped file yields them, one at a time; zero.Init does the
    # same per partition. Measured on CPU (benchmarks/build_peak.py --weights, tests/train/test_build_peak.py):
    # the anonymous peak of a LoRA build that loads a bf16 file equals random init's (2.38 B/param both). The
    # file's pages count in the resident set while mapped, but as page cache the kernel drops under pressure.
    # zero_init False at stage 3 (a model built whole, then partitioned: DeepSpeed's estimator's other case).
    streamed = s.stage < 3 or s.zero_init
    loaded = inv.largest_layer if streamed else total
    add(
        f"model load ({s.load_bytes} B/param)",
        s.load_bytes * loaded,
        "host",
        "load",
        note="one layer at a time (the file memory-mapped)" if streamed else "whole model on every local rank",
        ds=True,
    )
    # measured beyond the pinned buffers in single-rank FLUX.1-dev runs (benchmarks/RESULTS.md, 2026-12-05): 2.2-2.7
    # GiB resident or streaming on an H200, 2.7-4.2 GiB streaming on an H100; 2 GiB under-predicted the resident rows
    # by 23%
    add(PROCESS_ITEM, int(2.5 * GiB), "host", note="per rank; measured typical RSS")
    return items


def _largest_trained_layer(s: RunSpec, inv: ParamInventory) -> int:
    """Elements of the largest gradient one layer makes at once (one adapter's tensors under LoRA, DoRA or LoKr)."""
    lc = lora_config(s)
    if lc is None:
        return inv.largest_layer
    shapes = linear_shapes(s.model)
    chosen = [adapter_param_count(shapes[n], lc) for n in shapes if any(fnmatch.fnmatchcase(n, p) for p in lc.patterns)]
    return max(chosen, default=0)


def _adapted_linears(s: RunSpec) -> int:
    """How many linears the LoRA targets adapt (0 without LoRA)."""
    lc = lora_config(s)
    if lc is None:
        return 0
    shapes = linear_shapes(s.model)
    return len({n for p in lc.patterns for n in shapes if fnmatch.fnmatchcase(n, p)})


def communication_items(s: RunSpec, inv: ParamInventory) -> list[Item]:
    b = PRECISION_BYTES[s.precision]
    z = s.zero
    items: list[Item] = []
    overlap = z.overlap_comm if z.overlap_comm is not None else s.stage == 3
    fused = s.optimizer_mode is not None and optim_modes.get_mode(s.optimizer_mode).fused
    if s.stage == 0:
        if not fused:  # the fused step all-reduces each gradient in place
            items.append(
                Item(
                    "allreduce bucket",
                    b * min(z.reduce_bucket_size, trained_params(s, inv)),
                    "gpu",
                    "train",
                    "engine.buffered_allreduce_fallback flattens one bucket",
                )
            )
    elif s.stage in (1, 2):
        n = 2 if overlap else 1
        items.append(
            Item(
                "gradient reduction buckets",
                n * b * z.reduce_bucket_size,
                "gpu",
                "train",
                f"ipg buffers: reduce_bucket_size x {n} (overlap_comm={overlap}), freed when backward ends",
            )
        )
        items.append(
            Item(
                "gradient being produced",
                b * _largest_trained_layer(s, inv),
                "gpu",
                "train",
                "one layer's full gradient before it is copied into a bucket",
            )
        )
        # allgather_bucket_size costs nothing with NCCL: all_gather_into_tensor writes into the flat buffer.
    else:
        items.append(
            Item(
                "gradient reduction bucket",
                b * z.reduce_bucket_size,
                "gpu",
                "resident",
                "ipg bucket (reduce_bucket_size)",
            )
        )
        items.append(
            Item(
                "reduce-scatter staging",
                b * z.reduce_bucket_size // 2,
                "gpu",
                "train",
                "half a bucket on average in flight",
            )
        )
        unit = inv.largest_layer
        block = max(inv.double_block, inv.single_block)
        if s.checkpoint_every and z.stage3_max_reuse_distance >= block:
            unit = block  # recompute then backward reuses the whole block's params: not released in between
        prefetch = min(z.stage3_prefetch_bucket_size, max(0, z.stage3_max_live_parameters - unit))
        items.append(
            Item(
                "live (gathered) parameters",
                b * (unit + prefetch),
                "gpu",
                "train",
                "largest gather unit + prefetch bucket (capped by max_live_parameters)",
                ds=True,
            )
        )
        items.append(
            Item(
                "parameters left gathered for backward",
                b * max(0, gathered_at_turn(s, inv) - unit - prefetch),
                "gpu",
                "train",
                "beyond the above, when forward ends: the last blocks within "
                "max_reuse_distance, the prefetcher's lead up to max_live_parameters",
            )
        )
        items.append(
            Item(
                "gradient being produced",
                b * _largest_trained_layer(s, inv),
                "gpu",
                "train",
                "one layer's full gradient before it enters the bucket",
                ds=True,
            )
        )
        persistent = inv.persistent(z.stage3_param_persistence_threshold)
        items.append(
            Item(
                "persistent parameters",
                b * persistent,
                "gpu",
                "resident",
                f"tensors under param_persistence_threshold={z.stage3_param_persistence_threshold}",
            )
        )
    return items


def gathered_at_turn(s: RunSpec, inv: ParamInventory) -> int:
    """Parameters (elements) ZeRO-3 still holds gathered when forward ends and backward begins, once DeepSpeed has
    recorded the step's module trace (from the second step on). deepspeed 0.19.8, partitioned_param_coordinator.py:

    - Reuse window (__params_to_release): a module's parameters are not released after its forward when they are
      used again within stage3_max_reuse_distance elements of the trace. Block j's next use is its recompute (with
      checkpointing; else its backward), after the rest of forward and the recompute and backward of every later
      block: about 3x (2x) the later blocks' parameters away. The last blocks within that distance stay gathered.
    - The prefetcher's lead (_fetch_sub_module_impl): each fetch prefetches the next stage3_prefetch_bucket_size
      elements of the trace that are not gathered, however small the module being fetched; a module smaller than
      the bucket (LoRA's A, B, wrapper and dropout, the q/k norms, parameter-less containers) lets the prefetcher
      run further ahead of the forward. Once it is ahead by more than the rest of forward it gathers the first
      backward blocks' parameters, marked for their backward use (not released), until the gathered elements
      reach stage3_max_live_parameters; the last block's own, fetched meanwhile, come on top.
    The two overlap (both are the last blocks): the larger counts, at most every parameter not kept persistent.
    Measured on CPU with a reduced-width FLUX and LoRA (tests/plan/test_memory_deepspeed.py): a full fine-tune of
    FLUX.1-dev has no lead (its modules outweigh the buckets), an all-linear LoRA's four small modules per adapted
    layer give it one.
    """
    z, cfg = s.zero, s.model
    total = inv.total - inv.persistent(z.stage3_param_persistence_threshold)
    blocks = [inv.double_block] * cfg.depth + [inv.single_block] * cfg.depth_single_blocks
    away = 3 if s.checkpoint_every else 2
    kept, later = 0, 0
    for n in reversed(blocks):  # the last blocks first
        if away * later >= z.stage3_max_reuse_distance:
            break
        kept, later = kept + n, later + n
    lead = sum(z.stage3_prefetch_bucket_size - n for n in _forward_modules(s))
    last = inv.single_block if cfg.depth_single_blocks else inv.double_block
    ahead = min(lead, z.stage3_max_live_parameters) + last if lead > 0 else 0
    return min(total, max(kept, ahead))


def _forward_modules(s: RunSpec) -> list[int]:
    """Parameter elements of each module DeepSpeed fetches in one forward (a step of its trace each): every layer of
    config/architecture's table; per LoRA-adapted layer PEFT's wrapper and dropout (none) and its A and B; the
    parameter-less containers fluxzero.model calls (per double block the block, two Modulations, two QKNorms, two
    MLP Sequentials and their GELUs; per single block the block, its Modulation and QKNorm; around the blocks the
    model, RoPE, three MLPEmbedders and the final layer's containers)."""
    cfg = s.model
    lc = lora_config(s)
    out = []
    for name, lay in architecture.layers(cfg):
        out.append(lay.params)
        if lc is not None and lay.kind == "linear" and any(fnmatch.fnmatchcase(name, p) for p in lc.patterns):
            out += [0, 0, lc.rank * lay.n_in, lc.rank * lay.n_out]
    return out + [0] * (9 * cfg.depth + 3 * cfg.depth_single_blocks + 8)


def stream_traffic(s: RunSpec) -> list[tuple[str, int]]:
    """What streamed blocks (fluxzero.offload_blocks) move between host and GPU per micro batch, in bytes: each
    streamed block's weights in for its forward and again for its recompute in backward, and back out updated (not
    a LoRA's frozen base)."""
    moved = PRECISION_BYTES[s.precision] * sum(streamed_blocks(s))
    if not moved:
        return []
    back = [] if s.lora_rank else [("GPU -> host, updated weights", moved)]  # a LoRA's streamed base is frozen
    return [("host -> GPU, forward", moved), ("host -> GPU, recompute in backward", moved), *back]
