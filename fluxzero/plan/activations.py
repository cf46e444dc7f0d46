"""Activations of a step: what autograd saves per block (counted tensor by tensor from fluxzero.model.layers),
block inputs of checkpointed blocks, one block's recompute and backward working set, and LoRA's additions.

Pure Python (no torch). Sizes are bytes per sample unless a function says otherwise.
"""

from __future__ import annotations

import fnmatch
from typing import NamedTuple

from fluxzero.config import architecture, optim_modes
from fluxzero.config.architecture import linear_shapes
from fluxzero.config.lora import lokr_factors
from fluxzero.config.models import ModelConfig
from fluxzero.plan.spec import (
    PRECISION_BYTES,
    WEIGHT_ONLY_QUANTS,
    Item,
    RunSpec,
    lora_config,
    param_inventory,
    trained_params,
)


# ---------------------------------------------------------------------------------------------------------
# Activations, from fluxzero.model.layers (per sample; L = L_txt + L_img, C hidden, M mlp hidden, H heads;
# L_img = RunSpec.img_tokens: a FLUX.1 Kontext model's reference tokens are image tokens too)
# ---------------------------------------------------------------------------------------------------------
def _rms_saved(L: int, cfg: ModelConfig, b: int, device: str, frozen: bool = False) -> dict[str, int]:
    """What F.rms_norm saves for ONE of q/k, beyond its input (which is a view of the qkv projection).

    CUDA (torch >= 2.8): the fused kernel saves its input and the fp32 rstd per row, frozen scale or not.
    CPU: the composite saves the fp32 upcast input (the input itself if already fp32), rstd and, for the learned
    scale's gradient, the fp32 normalised tensor it multiplies; under adapters (`frozen`) the scale takes no
    gradient and that tensor is not kept.
    """
    H = cfg.num_heads
    rstd = L * H * 4
    if device == "cuda":
        return {"rstd": rstd}
    upcast = 0 if b == 4 else L * cfg.hidden_size * 4
    return {"rstd": rstd, "fp32 upcast": upcast, "fp32 normalised": 0 if frozen else L * cfg.hidden_size * 4}


def _attention_saved(L: int, cfg: ModelConfig, b: int, attention: str, device: str, v_separate: bool) -> dict[str, int]:
    """SDPA's saved tensors (v only when it is its own storage, as the double block's concatenation).

    flash / efficient: rotated q and k (new tensors), v, the output and logsumexp -- fp32 (H, L), O(L).
    math: q and k after scaling (new tensors), v and the softmax probabilities (H, L, L) -- O(L^2). On CPU
    (measured) it keeps fp32 copies of q, k and v (upcast from bf16/fp16) and fp32 probabilities instead.
    """
    C, H = cfg.hidden_size, cfg.num_heads
    v = {"v (concatenated)": L * C * b} if v_separate else {}
    if attention != "math":
        return {"q, k after RoPE": 2 * L * C * b, **v, "attention output": L * C * b, "logsumexp": L * H * 4}
    if device == "cpu":
        return {"q, k, v fp32 copies (math)": 3 * L * C * 4, "softmax probabilities (L^2, fp32)": H * L * L * 4}
    return {"q, k scaled (math)": 2 * L * C * b, **v, "softmax probabilities (L^2)": H * L * L * b}


def _ln_stats(L: int, b: int, device: str) -> int:
    return 2 * L * (4 if device == "cuda" else b)  # mean, rstd (fp32 on CUDA, input dtype on CPU)


def double_block_saved(
    cfg: ModelConfig,
    img_tokens: int,
    txt_tokens: int,
    b: int = 2,
    *,
    device: str = "cuda",
    attention: str = "flash",
    frozen: bool = False,
) -> dict[str, int]:
    """Bytes autograd saves inside one DoubleStreamBlock for one sample, not counting its inputs (`frozen`: its
    parameters take no gradient, adapters train instead; their own additions are lora_block_saved's)."""
    C, M = cfg.hidden_size, cfg.mlp_hidden_dim
    L = img_tokens + txt_tokens
    out: dict[str, int] = {}

    def add(k, v):
        out[k] = out.get(k, 0) + v

    for Ls in (img_tokens, txt_tokens):
        add("modulation (silu out, 6C chunk storage, 1+scale x2)", C * b + 6 * C * b + 2 * C * b)
        add("layer norms (stats)", 2 * _ln_stats(Ls, b, device))
        # norm1 out, modulated (qkv input), proj out, residual, norm2 out, modulated (mlp input), mlp out
        add("7 hidden-size tensors per stream", 7 * Ls * C * b)
        add("mlp hidden before/after GELU", 2 * Ls * M * b)
        if device == "cuda" or b == 4:
            add("qkv projection (kept by q/k norm input views)", 3 * Ls * C * b)
        for key, v in _rms_saved(Ls, cfg, b, device, frozen).items():
            add(f"q/k rms norm {key}", 2 * v)
    for key, v in _attention_saved(L, cfg, b, attention, device, v_separate=True).items():
        add(key, v)
    add("merged heads (proj inputs)", L * C * b)
    return out


def single_block_saved(
    cfg: ModelConfig,
    img_tokens: int,
    txt_tokens: int,
    b: int = 2,
    *,
    device: str = "cuda",
    attention: str = "flash",
    frozen: bool = False,
) -> dict[str, int]:
    """Bytes autograd saves inside one SingleStreamBlock for one sample, not counting its input (`frozen`: as
    double_block_saved's)."""
    C, M = cfg.hidden_size, cfg.mlp_hidden_dim
    L = img_tokens + txt_tokens
    out = {
        "modulation (silu out, 3C chunk storage, 1+scale)": C * b + 3 * C * b + C * b,
        "layer norm (stats)": _ln_stats(L, b, device),
        "norm out, modulated (linear1 input)": 2 * L * C * b,
        "linear1 output (kept by v and GELU input views)": L * (3 * C + M) * b,  # GELU output: only cat reads it
        "concat(attn, mlp) (linear2 input)": L * (C + M) * b,
        "linear2 output (gate)": L * C * b,
    }
    for key, v in _rms_saved(L, cfg, b, device, frozen).items():
        out[f"q/k rms norm {key}"] = 2 * v
    out.update(_attention_saved(L, cfg, b, attention, device, v_separate=False))
    return out


# ---------------------------------------------------------------------------------------------------------
# Selective checkpointing (fluxzero.activation_checkpointing.policy selective): a checkpointed block keeps the
# output of every matmul and of attention (fluxzero.train.recompute.selective_policy), and recomputes the pointwise
# ops (norms, modulation, RoPE, GELU, gates) in backward. Each item: (bytes per sample, also in the block's
# saved set of double_block_saved / single_block_saved, so that recompute does not make it again).
# ---------------------------------------------------------------------------------------------------------
def _attention_kept(L: int, cfg: ModelConfig, b: int, attention: str, device: str) -> dict[str, tuple[int, bool]]:
    """SDPA's outputs under the policy: flash / efficient return the output and the fp32 logsumexp, both of
    which its backward saves; math is composite, so its two bmm outputs (scores (H, L, L) and the weighted values)
    are kept, in fp32 on CPU (it upcasts first), neither of them a tensor its backward saves."""
    C, H = cfg.hidden_size, cfg.num_heads
    if attention != "math":
        return {"attention output": (L * C * b, True), "logsumexp": (L * H * 4, True)}
    mb = 4 if device == "cpu" else b
    return {"attention scores (math bmm)": (H * L * L * mb, False), "attention output (math bmm)": (L * C * mb, False)}


def double_block_kept(
    cfg: ModelConfig, img_tokens: int, txt_tokens: int, b: int = 2, *, device: str = "cuda", attention: str = "flash"
) -> dict[str, tuple[int, bool]]:
    """What the selective policy keeps inside one DoubleStreamBlock for one sample, beyond its inputs: the outputs
    of its linears (architecture.double_block: modulation, qkv, proj, mlp.0, mlp.2 per stream) and of attention."""
    out: dict[str, tuple[int, bool]] = {}
    for lay in architecture.double_block(cfg):
        if lay.kind != "linear":
            continue
        tokens = {"img": img_tokens, "txt": txt_tokens, "sample": 1}[lay.tokens]
        # the qkv output is also saved without the policy where q/k's RMSNorm keeps a view of it (_rms_saved)
        saved = not lay.name.endswith("qkv") or device == "cuda" or b == 4
        out[lay.name] = (tokens * lay.n_out * b, saved)
    out.update(_attention_kept(img_tokens + txt_tokens, cfg, b, attention, device))
    return out


def single_block_kept(
    cfg: ModelConfig, img_tokens: int, txt_tokens: int, b: int = 2, *, device: str = "cuda", attention: str = "flash"
) -> dict[str, tuple[int, bool]]:
    """What the selective policy keeps inside one SingleStreamBlock for one sample, beyond its input: the outputs of
    linear1, linear2 and the modulation (architecture.single_block) and of attention; all saved without it too."""
    L = img_tokens + txt_tokens
    out = {
        lay.name: ((L if lay.tokens == "all" else 1) * lay.n_out * b, True)
        for lay in architecture.single_block(cfg)
        if lay.kind == "linear"
    }
    out.update(_attention_kept(L, cfg, b, attention, device))
    return out


def lora_block_kept(s: RunSpec) -> tuple[tuple[int, int], tuple[int, int]]:
    """((double, single) bytes, (double, single) of them saved without the policy) per sample that the adapters
    add to what the selective policy keeps: a LoRA's or DoRA's A x (rank values per token, which B's gradient
    saves) and B A x (the adapted layer's output width per token, which a DoRA's magnitude gradient saves too); a
    LoKr's x times its update (output width). Their per-block additions are adapter_block_fixed's."""
    lc = lora_config(s)
    if lc is None:
        return (0, 0), (0, 0)
    ab = adapter_bytes(s)
    kept, saved = [0, 0], [0, 0]
    for single, _name, tokens, n_out in _adapted_block_linears(s, lc):
        if lc.type == "lokr":
            kept[single] += tokens * n_out * ab
            continue
        kept[single] += tokens * (lc.rank + n_out) * ab
        saved[single] += tokens * (lc.rank + (n_out if lc.type == "dora" else 0)) * ab
    return (kept[0], kept[1]), (saved[0], saved[1])


def block_backward_workspace(
    cfg: ModelConfig, img_tokens: int, txt_tokens: int, b: int = 2, attention: str = "flash"
) -> int:
    """Activation gradients alive at once inside one block's backward, beyond its saved tensors (one sample).

    Backward starts at the last single block, where the stored activations are largest; its peak is
    linear2's backward: the gradient of the concat(attn, mlp) input (C + M), with the incoming and the
    accumulating hidden-size gradients (2C) -- plus linear2's weight gradient in flight, counted by the
    "gradient being produced" item. Measured on CPU with a live-storage tracker (tests): this is the
    single block's peak to a few percent. Math attention adds the (H, L, L) score gradient in fp32.
    """
    C, M, H = cfg.hidden_size, cfg.mlp_hidden_dim, cfg.num_heads
    L = img_tokens + txt_tokens
    ws = L * b * (C + M + 2 * C)
    if attention == "math":
        ws = max(ws, 2 * H * L * L * 4 + 4 * L * C * b)
    return ws


def outside_blocks_saved(cfg: ModelConfig, img_tokens: int, txt_tokens: int, b: int = 2) -> tuple[int, int]:
    """(embedders, head) bytes saved outside the blocks for one sample, small next to the blocks.

    Embedders (img_in, txt_in inputs, the fp32 RoPE table) live until backward reaches them; the head (final
    layer's norm input and output, linear input; prediction, target, noise, latents in fp32) is freed before
    backward reaches the blocks.
    """
    C, L = cfg.hidden_size, img_tokens + txt_tokens
    embed = img_tokens * cfg.in_channels * b + txt_tokens * cfg.context_in_dim * b + L * cfg.head_dim * 4
    head = L * C * b + 2 * img_tokens * C * b + 4 * img_tokens * cfg.in_channels * 4
    return embed, head


def checkpointed_split(cfg: ModelConfig, every: int, streamed: int = 0) -> tuple[int, int]:
    """(double, single) blocks checkpointed. As fluxzero.train.recompute.apply_activation_checkpointing: one index
    over double then single blocks, block i checkpointed iff i % k == 0, and the last `streamed` blocks always."""
    n = cfg.depth + cfg.depth_single_blocks
    flags = [every > 0 and i % every == 0 or i >= n - streamed for i in range(n)]
    return sum(flags[: cfg.depth]), sum(flags[cfg.depth :])


def activation_bytes(s: RunSpec) -> dict[str, int]:
    """Per-rank activation bytes at the backward peak: what is stored for backward when it starts, the
    recompute of a checkpointed block net of what backward has freed before it, the backward working set.

    Backward walks the blocks in reverse (single blocks first). At block j, the inputs and (for blocks not
    checkpointed) saved tensors of blocks 0..j are still alive, block j's saved tensors are recomputed if it
    is checkpointed, and its working set is live; the peak is the largest such moment.
    """
    cfg, b, B = s.model, PRECISION_BYTES[s.precision], s.micro_batch
    I, T = s.img_tokens, s.txt_len
    L, C = I + T, cfg.hidden_size
    att = "math" if s.attention == "math" else "flash"
    frozen = bool(s.lora_rank)
    d = sum(double_block_saved(cfg, I, T, b, device=s.device, attention=att, frozen=frozen).values())
    si = sum(single_block_saved(cfg, I, T, b, device=s.device, attention=att, frozen=frozen).values())
    lora_d, lora_s = lora_block_saved(s)
    d, si = d + lora_d, si + lora_s
    k = s.checkpoint_every
    kinds = [d] * cfg.depth + [si] * cfg.depth_single_blocks
    # streamed blocks (the last offload_blocks) are always recomputed: fluxzero.train.block_stream checkpoints them
    streamed = [j >= len(kinds) - s.offload_blocks for j in range(len(kinds))]
    ckpt = [k > 0 and j % k == 0 or streamed[j] for j in range(len(kinds))]
    # a checkpointed block's input, on the host with cpu_checkpointing (deepspeed's), except a streamed block's:
    # the streamer checkpoints those itself (torch's, non-reentrant), inputs kept on the accelerator
    on_gpu = [not s.cpu_checkpointing or st for st in streamed]
    # selective: a checkpointed block (streamed ones aside: the BlockStreamer recomputes them whole) also keeps its
    # matmul and attention outputs, and its recompute makes only the rest of its saved set
    sel_d, sel_s, redo_d, redo_s = selective_split(s)
    selective = [s.checkpoint_policy == "selective" and c and not st for c, st in zip(ckpt, streamed)]
    sel = [(sel_d if j < cfg.depth else sel_s) if on else 0 for j, on in enumerate(selective)]
    redo = [
        ((redo_d if j < cfg.depth else redo_s) if on else saved) if c else 0
        for j, (saved, c, on) in enumerate(zip(kinds, ckpt, selective))
    ]
    kept = [
        (L * C * b if g else 0) + kept_sel if c else L * C * b + saved
        for saved, c, g, kept_sel in zip(kinds, ckpt, on_gpu, sel)
    ]  # per block, one sample
    embed, head = outside_blocks_saved(cfg, I, T, b)
    # A weight-only quantized base dequantizes each weight for its matmul, and autograd saves that bf16 copy for the
    # input's gradient (mm saves the other operand); a LoKr saves its whole update kron(w1, w2) the same way
    # (adapter_block_fixed): per block, whatever the micro batch; a checkpointed block's only while it is
    # recomputed, less what the selective policy keeps of it from forward. Counted in sample units of B so the walk
    # below stays one sum. (fp8-matmul saves only the e4m3 weight it holds anyway: dequantized_weight_bytes.)
    weight_only = s.base_quant in WEIGHT_ONLY_QUANTS
    wq = [n * b / B for n in _block_linear_weights(cfg)] if weight_only else [0.0] * len(kinds)
    fixed = adapter_block_fixed(s)
    for j, c in enumerate(ckpt):
        i = int(j >= cfg.depth)
        w = wq[j] + fixed.saved[i] / B
        if not c:
            kept[j] += w
        elif selective[j]:
            kept[j] += fixed.kept[i] / B
            redo[j] += w - fixed.both[i] / B
        else:
            redo[j] += w
    stored = embed + sum(kept)  # alive when backward reaches the blocks (the head's tensors are freed by then)
    # At stage 0 every parameter's full gradient stays from the moment backward makes it until the step:
    # they grow block by block (the head's first) while the activations shrink, and the peak may come later
    inv = param_inventory(cfg)
    params = _block_params(cfg, inv)
    if s.lora_rank:  # only the adapters get gradients: spread them over the blocks like the parameters
        params = [n * trained_params(s, inv) / inv.total for n in params]
    fused = s.optimizer_mode is not None and optim_modes.get_mode(s.optimizer_mode).fused
    g_bytes = b if s.stage == 0 and not fused else 0  # a fused mode steps and drops each gradient in backward
    grads = g_bytes * (inv.outside_blocks - _embedder_params(cfg))  # the head's, made before the blocks
    # fluxzero.train.block_stream: while a streamed block recomputes and runs its backward, three copies of blocks of
    # its size are on the device (the block computing, the next one arriving, the one before it leaving); at the
    # backward peak those are the last (single) blocks, not the largest. Whole bytes, counted in sample units of B.
    copies = [3 * b * n / B if st else 0.0 for n, st in zip(_block_params(cfg, inv), streamed)]
    peak, alive, at_peak = stored, stored, 0.0
    both = B * stored + grads  # activations and gradients together
    for j in reversed(range(len(kinds))):
        moment = alive + redo[j] + copies[j]
        if moment > peak:
            peak, at_peak = moment, copies[j]
        both = max(both, B * moment + grads)
        alive -= kept[j]
        grads += g_bytes * params[j]
    # the forward's end holds the head instead of a working set: count the larger of the two
    workspace = max(block_backward_workspace(cfg, I, T, b, att) + lora_backward_extra(s), head)
    on_host = B * sum(L * C * b for c, g in zip(ckpt, on_gpu) if c and not g)
    return {
        "stored": B * stored,
        "recompute": B * (peak - stored - at_peak),
        "stream_copies": B * at_peak,
        "workspace": max(B * workspace + dequantized_weight_bytes(s), adapter_workspace(s)),
        "on_host": on_host,
        "grads_net": both - B * peak,
        "per_block_double": d,
        "per_block_single": si,
        "checkpointed": sum(ckpt),
        "selective_double": sel_d,
        "selective_single": sel_s,
    }


def selective_split(s: RunSpec) -> tuple[int, int, int, int]:
    """(double kept, single kept, double recomputed, single recomputed): bytes per sample a checkpointed block keeps
    from forward to backward under the selective policy beyond its inputs (LoRA's adapters included), and what its
    recompute in backward makes again (its saved set less what the policy kept)."""
    cfg, b = s.model, PRECISION_BYTES[s.precision]
    I, T = s.img_tokens, s.txt_len
    att = "math" if s.attention == "math" else "flash"
    (lk_d, lk_s), (ls_d, ls_s) = lora_block_kept(s)
    lora_d, lora_s = lora_block_saved(s)
    out = []
    for kept_fn, saved_fn, lk, ls, lsaved in (
        (double_block_kept, double_block_saved, lk_d, ls_d, lora_d),
        (single_block_kept, single_block_saved, lk_s, ls_s, lora_s),
    ):
        kept = kept_fn(cfg, I, T, b, device=s.device, attention=att)
        saved = sum(saved_fn(cfg, I, T, b, device=s.device, attention=att, frozen=bool(s.lora_rank)).values())
        saved += lsaved
        both = sum(n for n, in_saved in kept.values() if in_saved) + ls
        out.append((sum(n for n, _ in kept.values()) + lk, saved - both))
    (kd, rd), (ks, rs) = out
    return kd, ks, rd, rs


def lora_block_saved(s: RunSpec) -> tuple[int, int]:
    """(double, single) block bytes per sample that the adapters (LoRA, DoRA, LoKr: lora.type) change in what
    autograd saves, per token of each block linear (PEFT's forwards); what they save per block whatever the micro
    batch is adapter_block_fixed's.

    A frozen linear no adapter covers saves no input: each block linear's input is saved for its weight's gradient
    only (the block's saved set counts it once), so such a linear takes it out (the MLP's under the attention
    preset, the modulation's under attention+mlp).

    The base linears are frozen, so backward runs no weight-gradient matmul for them, but it still needs each
    adapted linear's input x for the adapter's gradient (the same tensor the block saves already). A LoRA saves
    its own A x (rank values per token) for B's gradient; with dropout, the dropped-out copy of x too. A DoRA
    adds, for its magnitude's gradient, the base output less its bias (a new tensor: FLUX.1's linears all have
    one) in the base dtype and B A x in the adapters'. A LoKr multiplies x by its whole update, so it keeps
    nothing per token of its own.
    """
    lc = lora_config(s)
    if lc is None:
        return 0, 0
    b, ab = PRECISION_BYTES[s.precision], adapter_bytes(s)
    shapes = linear_shapes(s.model)
    out = [0, 0]
    for single, name, tokens, n_out in _adapted_block_linears(s, lc):
        # the adapter's input: the layer's input, counted in the block's saved set already, unless PEFT makes a
        # copy: with dropout, and in the adapters' dtype when that is wider (then the input itself is no longer
        # saved: the frozen base layer needs it for no weight gradient, so the copy adds the difference)
        per_token = shapes[name][0] * (ab if lc.dropout else ab - b)
        if lc.type != "lokr":
            per_token += lc.rank * ab
        if lc.type == "dora":
            per_token += n_out * (b + ab)
        out[single] += tokens * per_token
    for single, name, tokens, _ in _adapted_block_linears(s, lc, adapted=False):
        out[single] -= tokens * shapes[name][0] * b
    return out[0], out[1]


class BlockFixed(NamedTuple):
    """Adapter bytes per block whatever the micro batch, each (double, single): what autograd saves, what the
    selective policy keeps of a checkpointed block from forward to backward, and how much of that it saves too."""

    saved: tuple[int, int]
    kept: tuple[int, int]
    both: tuple[int, int]


def adapter_block_fixed(s: RunSpec) -> BlockFixed:
    """The adapters' bytes per block that do not grow with the micro batch (BlockFixed).

    Saved: a LoKr builds each adapted linear's whole (out, in) update kron(w1, w2) x scale and multiplies the input
    by it, which saves the update for the input's gradient, and kron saves its factors: those that are products of
    two low-rank matrices are new tensors (lora.lokr_factors). A DoRA keeps three vectors per output row: the
    detached weight norm, and magnitude / norm and that less 1 (the two scales of its output). A LoRA keeps none.
    Kept by the selective policy (matmul outputs): a LoKr's factor products. A DoRA's B A of its weight norm is
    built without autograd (fluxzero.model.lora._dora_layer_class), which the policy does not keep.
    """
    lc = lora_config(s)
    saved, kept, both = [0, 0], [0, 0], [0, 0]
    if lc is not None and lc.type != "lora":
        ab = adapter_bytes(s)
        shapes = linear_shapes(s.model)
        for single, name, _, n_out in _adapted_block_linears(s, lc):
            n_in = shapes[name][0]
            if lc.type == "dora":
                saved[single] += 3 * n_out * ab
                continue
            products = sum(m * n for m, n, low in lokr_factors(shapes[name], lc) if low) * ab
            saved[single] += n_in * n_out * ab + products
            kept[single] += products
            both[single] += products
    return BlockFixed(tuple(saved), tuple(kept), tuple(both))


def lora_backward_extra(s: RunSpec) -> int:
    """Bytes per sample a LoRA or DoRA adds to one block's backward working set: PEFT adds the adapter's output as
    result + B(A(x)) * s, whose backward makes the upstream gradient times s, a (tokens, out) tensor in the adapters'
    dtype, beside the block's own gradients; counted at the widest adapted linear (a single block's linear1: 21504
    features over every token). Measured (benchmarks/RESULTS.md, LoRA r16 at micro batch 8): without it the peak was
    under-predicted by 0.8-0.95 GiB."""
    lc = lora_config(s)
    if lc is None or lc.type == "lokr":
        return 0
    return max((tokens * n_out for _, _, tokens, n_out in _adapted_block_linears(s, lc)), default=0) * adapter_bytes(s)


def adapter_workspace(s: RunSpec) -> int:
    """Bytes one adapted linear's forward (or recompute) holds at once beyond what it keeps, at the largest adapted
    linear, whatever the micro batch; the memory model counts the larger of this and the block's working set.

    A DoRA's weight norm ||W + s B A|| per output row: PEFT builds B A as B(A(I)) from an (in, in) identity (without
    autograd: fluxzero.model.lora._dora_layer_class, so the identity goes when B A is made), then s B A and
    W + s B A beside B A (in the adapters' dtype, with W's copy in it when that differs). A LoKr
    builds kron(w1, w2) before scaling it into the update it keeps. A LoRA adds only per-token tensors.
    """
    lc = lora_config(s)
    if lc is None or lc.type == "lora":
        return 0
    b, ab = PRECISION_BYTES[s.precision], adapter_bytes(s)
    shapes = linear_shapes(s.model)
    most = 0
    for _single, name, _, n_out in _adapted_block_linears(s, lc):
        n_in = shapes[name][0]
        if lc.type == "dora":
            # B(A(I)) with I alive, then (I freed: no autograd graph holds it) s B A and W + s B A beside B A
            held = max(n_in * n_in + n_in * lc.rank + n_in * n_out, (3 + (ab != b)) * n_in * n_out)
        else:
            held = n_in * n_out
        most = max(most, held * ab)
    return most


def dequantized_weight_bytes(s: RunSpec) -> int:
    """Bytes of the one dequantized weight an fp8-matmul base's backward holds at a time beside the block's gradients
    (fluxzero.model.fp8_matmul.dequantize: a float32 product rounded to the training dtype), at the largest block
    linear; 0 for any other base. Its forward's per-token e4m3 copy of an input (1 byte a value, plus a float32 one
    while it is made) is smaller than the backward working set, and freed before it."""
    if s.base_quant != "fp8-matmul":
        return 0
    largest = max(i * o for n, (i, o) in linear_shapes(s.model).items() if n.startswith(("double_", "single_")))
    return (4 + PRECISION_BYTES[s.precision]) * largest


def adapter_bytes(s: RunSpec) -> int:
    """Bytes per value of LoRA adapters and of what they compute: the training dtype, but fp32 under ZeRO-3, where
    deepspeed.initialize converts the adapters made after zero.Init without casting them (fluxzero.train.engine.
    apply_adapters); PEFT then casts each adapted layer's input to fp32 before A (LoraLayer._cast_input_dtype)."""
    return 4 if s.stage == 3 else PRECISION_BYTES[s.precision]


def _adapted_block_linears(s: RunSpec, lc, adapted: bool = True) -> list[tuple[bool, str, int, int]]:
    """(single block?, name, tokens per sample, out features) of each linear the LoRA adapts (adapted=False: leaves
    alone) in the first double and the first single block (every block of a kind is adapted alike)."""
    I, T = s.img_tokens, s.txt_len
    out = []
    for name, (_, n_out) in linear_shapes(s.model).items():
        if not (name.startswith("double_blocks.0.") or name.startswith("single_blocks.0.")):
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in lc.patterns) != adapted:
            continue
        single = name.startswith("single_blocks.")
        tokens = I + T if single else (T if ".txt_" in name else I)
        if name.endswith("_mod.lin") or name.endswith("modulation.lin"):
            tokens = 1  # the modulation reads one vector per sample
        out.append((single, name, tokens, n_out))
    return out


def _block_linear_weights(cfg: ModelConfig) -> list[int]:
    """Weight elements of the linears of each block, double blocks then single ones (the dequantized copies a
    quantized base saves for backward)."""
    shapes = linear_shapes(cfg)
    per = {
        p: sum(i * o for n, (i, o) in shapes.items() if n.startswith(p))
        for p in ("double_blocks.0.", "single_blocks.0.")
    }
    return [per["double_blocks.0."]] * cfg.depth + [per["single_blocks.0."]] * cfg.depth_single_blocks


def _block_params(cfg: ModelConfig, inv) -> list[int]:
    """Parameters of each block, double blocks then single ones (inv: param_inventory(cfg))."""
    return [inv.double_block] * cfg.depth + [inv.single_block] * cfg.depth_single_blocks


def _embedder_params(cfg: ModelConfig) -> int:
    """Parameters of img_in, time_in, vector_in, guidance_in and txt_in: their gradients come last."""
    return architecture.block_params(architecture.embedders(cfg))


def activation_items(s: RunSpec, a: dict[str, int] | None = None) -> list[Item]:
    """The activation items of `s` from `a`, its activation_bytes (computed here when not given)."""
    a = a if a is not None else activation_bytes(s)
    ck = f"{a['checkpointed']} of {s.model.depth + s.model.depth_single_blocks} blocks checkpointed"
    return [
        Item(
            "activations saved for backward",
            a["stored"],
            "gpu",
            "train",
            f"micro batch {s.micro_batch}; {ck} (block inputs only for those)"
            + (
                "; with the dequantized bf16 weights of the blocks not checkpointed"
                if s.base_quant in WEIGHT_ONLY_QUANTS
                else ""
            ),
        ),
        Item(
            "gradients made in backward, net of activations freed",
            a["grads_net"],
            "gpu",
            "train",
            "stage 0: full gradients made before the backward peak, beyond the activations backward freed",
        ),
        Item(
            "one block's recompute",
            a["recompute"],
            "gpu",
            "train",
            "checkpointed block re-run in backward, net of what backward freed before it",
        ),
        Item(
            "backward working set",
            a["workspace"],
            "gpu",
            "train",
            "gradients alive inside one block"
            + ("; with one dequantized linear weight (fp8-matmul)" if dequantized_weight_bytes(s) else ""),
        ),
        Item(
            "streamed block copies (3 blocks)",
            a["stream_copies"],
            "gpu",
            "train",
            "at the backward peak: the block computing, the next one arriving, the one before it leaving",
        ),
        Item(
            "checkpointed block inputs (cpu_checkpointing)",
            a["on_host"],
            "host",
            "train",
            "deepspeed.checkpointing checkpoint_in_cpu",
        ),
    ]
