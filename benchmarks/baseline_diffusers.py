"""The baseline: diffusers' FluxTransformer2DModel wrapped by DeepSpeed, as users of other trainers do.

Same dimensions as a fluxzero preset (via `from_config`), random init, diffusers' own
`enable_gradient_checkpointing()` (every block or none), constructed under `deepspeed.zero.Init` for
ZeRO-3, optionally PEFT LoRA adapters (diffusers' `add_adapter`) and `block.compile()` on every transformer
block. Used by benchmarks/sweep.py with `--impl diffusers`, which keeps the baseline's own step (this is the
baseline: no fluxzero TrainStep); its inputs are the fluxzero trainer's loader and `flow.prepare_batch` output,
renamed to diffusers' argument names.
"""

from __future__ import annotations

import torch


def diffusers_config(model_cfg) -> dict:
    """FluxTransformer2DModel keyword arguments for a fluxzero ModelConfig (same architecture)."""
    if model_cfg.in_channels != model_cfg.out_channels:
        raise ValueError(f"model {model_cfg.name!r}: diffusers' Flux needs in_channels == out_channels")
    return dict(
        patch_size=1,
        in_channels=model_cfg.in_channels,
        out_channels=model_cfg.out_channels,
        num_layers=model_cfg.depth,
        num_single_layers=model_cfg.depth_single_blocks,
        attention_head_dim=model_cfg.head_dim,
        num_attention_heads=model_cfg.num_heads,
        joint_attention_dim=model_cfg.context_in_dim,
        pooled_projection_dim=model_cfg.vec_in_dim,
        guidance_embeds=model_cfg.guidance_embed,
        axes_dims_rope=tuple(model_cfg.axes_dim),
    )


def build_engine(
    model_cfg, ds: dict, ckpt_every: int, device: torch.device, seed: int = 0, compile: bool = False, lora_rank: int = 0
):
    """diffusers model (partitioned at construction under ZeRO-3) -> DeepSpeed engine, as a user would write it.

    compile: `block.compile()` on every transformer block (nn.Module.compile, inductor defaults), the way a
    diffusers user compiles the repeated blocks; diffusers' checkpointing then recomputes through them.
    lora_rank: > 0 freezes the model and adds a PEFT LoRA of that rank (alpha = rank, gaussian init) on every
    linear layer of every block, fluxzero's "all-linear" targets, as diffusers' training scripts add theirs.
    """
    import deepspeed
    from diffusers import FluxTransformer2DModel

    if torch.device(device).type == "cpu":  # CPU test runs: skip DeepSpeed's shared-memory op build (~60 s)
        import importlib

        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(verbose=False)  # joins the process group; zero.Init and the config parser read it

    if ckpt_every not in (0, 1):
        raise ValueError("diffusers' enable_gradient_checkpointing checkpoints every block: use ckpt 0 or 1")
    from fluxzero.config.deepspeed.view import view

    stage = view(ds).stage  # the one parsed view of a DeepSpeed config, as the trainer reads it
    torch.manual_seed(seed)
    # Below ZeRO-3 the model is created in fp32 on the device and DeepSpeed casts it (the fluxzero engine
    # does the same); under ZeRO-3, zero.Init creates each parameter on the device in the training dtype
    # and partitions it at once.
    with deepspeed.zero.Init(config_dict_or_path=ds, enabled=stage == 3), torch.device(device):
        model = FluxTransformer2DModel.from_config(diffusers_config(model_cfg))
    if lora_rank:
        from peft import LoraConfig

        model.requires_grad_(False)
        targets = [
            n
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.startswith(("transformer_blocks.", "single_transformer_blocks."))
        ]
        model.add_adapter(
            LoraConfig(r=lora_rank, lora_alpha=lora_rank, init_lora_weights="gaussian", target_modules=targets)
        )
    if ckpt_every:
        model.enable_gradient_checkpointing()
    if compile:
        for block in list(model.transformer_blocks) + list(model.single_transformer_blocks):
            block.compile()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds)
    return engine


def forward(engine, inputs: dict) -> torch.Tensor:
    """Call the wrapped diffusers model with fluxzero's `prepare_batch` inputs.

    Shape: inputs as Flux.forward (img (B, L_img, 64), ids (B, L, 3), ...) -> (B, L_img, 64).
    diffusers takes 2-D ids (shared by the batch) and multiplies timestep and guidance by 1000 itself.
    """
    return engine(
        hidden_states=inputs["img"],
        encoder_hidden_states=inputs["txt"],
        pooled_projections=inputs["y"],
        timestep=inputs["timesteps"],
        img_ids=inputs["img_ids"][0],
        txt_ids=inputs["txt_ids"][0],
        guidance=inputs["guidance"],
        return_dict=False,
    )[0]
