"""FLUX.1's architecture as one table (pure Python): every layer with parameters, block by block, in the order
fluxzero.model.Flux registers them, and the named presets.

Parameter counts, FLOPs, the memory model's parameter inventory and the LoRA target shapes all derive from
`layers`; tests/model/test_architecture.py holds the table to the built model for every preset. A new FLUX
variant is a line in PRESETS (and, if its shape differs, a field of ModelConfig read here) plus that test.
The functions take any object with ModelConfig's fields (fluxzero.config.models.ModelConfig).
"""

from __future__ import annotations

from dataclasses import dataclass

# Sinusoidal embedding width of the timestep and guidance embedders (MLPEmbedder's input)
TIME_EMBED_DIM = 256

# The named presets: name -> (the preset it starts from, None for ModelConfig's defaults (FLUX.1 [dev]), the
# fields it changes). `kontext`: FLUX.1 Kontext, FLUX.1 [dev]'s tensors fed a reference image's tokens after the
# target's (reference_tokens).
PRESETS: dict[str, tuple[str | None, dict]] = {
    "flux-dev": (None, {}),
    "flux-schnell": ("flux-dev", {"guidance_embed": False}),
    # Full width (so per-block kernels and MFU are representative), a quarter of the depth: fits one GPU
    # with plain data parallelism and AdamW, for benchmarks.
    "flux-dev-lite": ("flux-dev", {"depth": 5, "depth_single_blocks": 10}),
    # Tiny presets for tests and the CPU quick start: every code path of the real model, in milliseconds.
    "flux-tiny": (
        "flux-dev",
        {
            "hidden_size": 64,
            "num_heads": 4,
            "axes_dim": (4, 6, 6),
            "depth": 2,
            "depth_single_blocks": 2,
            "context_in_dim": 64,
            "vec_in_dim": 32,
        },
    ),
    "flux-tiny-schnell": ("flux-tiny", {"guidance_embed": False}),
    "flux-kontext-dev": ("flux-dev", {"kontext": True}),
    "flux-tiny-kontext": ("flux-tiny", {"kontext": True}),
}

# What passes through a layer, per sample: the image tokens, the text tokens, both (the single blocks and joint
# attention), or one vector per sample (embedders of the timestep, guidance and pooled text; modulation)
TOKENS = ("img", "txt", "all", "sample")


@dataclass(frozen=True)
class Layer:
    """One module with parameters. `kind` "linear": an nn.Linear (in_features, out_features, bias); "norm": an
    RMSNorm's scale of `n_out` elements (n_in unused)."""

    name: str  # module name inside its block (or the model, outside the blocks)
    kind: str
    n_in: int
    n_out: int
    tokens: str = "sample"
    bias: bool = True

    @property
    def tensors(self) -> tuple[int, ...]:
        """Elements of each parameter tensor, in registration order (weight, bias; or scale)."""
        if self.kind == "norm":
            return (self.n_out,)
        return (self.n_in * self.n_out,) + ((self.n_out,) if self.bias else ())

    @property
    def params(self) -> int:
        return sum(self.tensors)

    def flops(self, img_tokens: int, txt_tokens: int) -> int:
        """Forward FLOPs of the layer's matmul for one sample (multiply-add = 2); norms count none."""
        if self.kind != "linear":
            return 0
        n = {"img": img_tokens, "txt": txt_tokens, "all": img_tokens + txt_tokens, "sample": 1}[self.tokens]
        return 2 * n * self.n_in * self.n_out


def _linear(name: str, n_in: int, n_out: int, tokens: str = "sample", bias: bool = True) -> Layer:
    return Layer(name, "linear", n_in, n_out, tokens, bias)


def _qk_norm(prefix: str, head_dim: int) -> list[Layer]:
    return [
        Layer(f"{prefix}.query_norm", "norm", head_dim, head_dim, "all"),
        Layer(f"{prefix}.key_norm", "norm", head_dim, head_dim, "all"),
    ]


def embedders(cfg) -> list[Layer]:
    """The input embedders, in registration order: img_in, time_in, vector_in, guidance_in (guidance-distilled
    models), txt_in."""
    C, E = cfg.hidden_size, TIME_EMBED_DIM
    out = [
        _linear("img_in", cfg.in_channels, C, "img"),
        _linear("time_in.in_layer", E, C),
        _linear("time_in.out_layer", C, C),
        _linear("vector_in.in_layer", cfg.vec_in_dim, C),
        _linear("vector_in.out_layer", C, C),
    ]
    if cfg.guidance_embed:
        out += [_linear("guidance_in.in_layer", E, C), _linear("guidance_in.out_layer", C, C)]
    return out + [_linear("txt_in", cfg.context_in_dim, C, "txt")]


def double_block(cfg) -> list[Layer]:
    """One double-stream block: per stream (img, then txt) its modulation (shift, scale, gate for attention and
    MLP), qkv, q/k RMSNorm, attention out-projection and MLP."""
    C, M, D = cfg.hidden_size, cfg.mlp_hidden_dim, cfg.head_dim
    out = []
    for s in ("img", "txt"):
        out += [
            _linear(f"{s}_mod.lin", C, 6 * C),
            _linear(f"{s}_attn.qkv", C, 3 * C, s, cfg.qkv_bias),
            *_qk_norm(f"{s}_attn.norm", D),
            _linear(f"{s}_attn.proj", C, C, s),
            _linear(f"{s}_mlp.0", C, M, s),
            _linear(f"{s}_mlp.2", M, C, s),
        ]
    return out


def single_block(cfg) -> list[Layer]:
    """One single-stream block: linear1 (q, k, v and MLP-in fused), linear2 (attention-out and MLP-out fused),
    q/k RMSNorm, modulation (shift, scale, gate)."""
    C, M, D = cfg.hidden_size, cfg.mlp_hidden_dim, cfg.head_dim
    return [
        _linear("linear1", C, 3 * C + M, "all"),
        _linear("linear2", C + M, C, "all"),
        *_qk_norm("norm", D),
        _linear("modulation.lin", C, 3 * C),
    ]


def final_layer(cfg) -> list[Layer]:
    C = cfg.hidden_size
    return [
        _linear("final_layer.linear", C, cfg.out_channels, "img"),
        _linear("final_layer.adaLN_modulation.1", C, 2 * C),
    ]


def layers(cfg) -> list[tuple[str, Layer]]:
    """(module name, Layer) for every module with parameters, in the model's parameters() order."""
    out = [(lay.name, lay) for lay in embedders(cfg)]
    out += [(f"double_blocks.{i}.{lay.name}", lay) for i in range(cfg.depth) for lay in double_block(cfg)]
    out += [(f"single_blocks.{i}.{lay.name}", lay) for i in range(cfg.depth_single_blocks) for lay in single_block(cfg)]
    return out + [(lay.name, lay) for lay in final_layer(cfg)]


def outside_blocks(cfg) -> list[Layer]:
    """The layers outside the blocks: embedders and final layer."""
    return embedders(cfg) + final_layer(cfg)


def block_params(block: list[Layer]) -> int:
    return sum(lay.params for lay in block)


def num_params(cfg) -> int:
    """Parameter count of the transformer (flux-dev: 11,901,408,320)."""
    return (
        block_params(outside_blocks(cfg))
        + cfg.depth * block_params(double_block(cfg))
        + cfg.depth_single_blocks * block_params(single_block(cfg))
    )


def linear_shapes(cfg) -> dict[str, tuple[int, int]]:
    """Every nn.Linear: module name -> (in_features, out_features), in module order."""
    return {name: (lay.n_in, lay.n_out) for name, lay in layers(cfg) if lay.kind == "linear"}


def attention_flops(cfg, tokens: int) -> int:
    """QK^T and AV of one block over `tokens` joint tokens: 2 L^2 D each per head, H heads."""
    return 4 * tokens * tokens * cfg.hidden_size


def flops_per_sample(cfg, img_tokens: int, txt_tokens: int) -> float:
    """Forward FLOPs of one sample (multiply-add = 2 FLOPs); a training step is about 3x this.

    Counted: every linear layer on the tokens that pass through it (Layer.tokens), attention's QK^T and AV, and
    the per-sample work (modulation, embedders, final adaLN) once per sample. Not counted (memory-bound, < 1%
    at FLUX sizes): norms, RoPE, softmax, activations, biases, residual adds.
    """
    I, T = img_tokens, txt_tokens
    attn = attention_flops(cfg, I + T)

    def block(b: list[Layer]) -> int:
        return sum(lay.flops(I, T) for lay in b) + attn

    outside = sum(lay.flops(I, T) for lay in outside_blocks(cfg))
    return float(cfg.depth * block(double_block(cfg)) + cfg.depth_single_blocks * block(single_block(cfg)) + outside)


def train_flops_per_sample(cfg, img_tokens: int, txt_tokens: int, frozen_linears: bool = False) -> float:
    """Model FLOPs of one sample's training step, forward and backward; what MFU divides by the peak.

    Attention costs 3x its forward (the backward's four matmuls against the forward's two). A trained linear costs
    3x (forward, input gradient, weight gradient); with `frozen_linears` (a LoRA's frozen base) 2x, having no weight
    gradient: the adapters' own rank-r matmuls (under 1% at rank 16) and the embedders' unneeded input gradients
    are left out. Recompute by activation checkpointing is not counted: this is the useful work.
    """
    forward = flops_per_sample(cfg, img_tokens, txt_tokens)
    if not frozen_linears:
        return 3 * forward
    attention = (cfg.depth + cfg.depth_single_blocks) * attention_flops(cfg, img_tokens + txt_tokens)
    return 2 * forward + attention  # 2 x (forward - attention) + 3 x attention


def reference_tokens(cfg, target_tokens: int) -> int:
    """Reference image tokens a model takes beside a target of `target_tokens` (FLUX.1 Kontext: the reference,
    cached at the target's size; 0 for the others)."""
    return target_tokens if cfg.kontext else 0
