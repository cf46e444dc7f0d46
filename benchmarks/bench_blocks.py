"""Forward+backward time of one FLUX.1 double block and one single block: ours vs diffusers, same weights.

    PYTHONPATH=. python3 benchmarks/bench_blocks.py                 # GPU, bf16, full width, 512 px
    PYTHONPATH=. python3 benchmarks/bench_blocks.py --device cpu --tiny   # smoke test

512 px = 64x64 latent = 32x32 packed tokens = 1024 image tokens, plus 512 T5 tokens. Both implementations get
identical bf16 weights (through our diffusers converter) and identical inputs; both run SDPA under the same
allowed backends (--attention, default our "auto": flash, efficient, math; our blocks get it as their `attention`
setting, and the process-wide SDPA flags are set to it once with fluxzero.model.math.set_process_sdpa_flags, so
diffusers' SDPA calls see the same kernels and ours take the fast path), so the attention kernel is the same and
the comparison measures everything around it. Timing: CUDA events around each iteration after warm-up, median.
Writes $OUT/bench_blocks.json (OUT defaults to the current folder; with the start time in UTC and the versions of
Python, torch, deepspeed, diffusers, CUDA and the code) and prints a markdown table.

FLOPs (forward, per block, C hidden, M = 4C, L = tokens; derivation as in ModelConfig.flops_per_sample):
  double: 2 L (4 C^2 + 2 C M) + 4 L^2 C      single: 2 L (C (3C + M) + (C + M) C) + 4 L^2 C
Training step = forward + backward ~ 3x forward; TFLOP/s below use that.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from fluxzero.config import get_model_config
from fluxzero.model import math as fmath
from fluxzero.model.layers import DoubleStreamBlock, SingleStreamBlock
from fluxzero.model.layouts import bfl_to_diffusers

sys.path.insert(0, str(Path(__file__).resolve().parent))  # provenance, runner; also when loaded by path
import provenance  # noqa: E402 - needs the line above
import runner  # noqa: E402


def block_flops(cfg, img_tokens, txt_tokens, kind):
    C, M, L = cfg.hidden_size, cfg.mlp_hidden_dim, img_tokens + txt_tokens
    if kind == "double":
        return 2 * L * (4 * C * C + 2 * C * M) + 4 * L * L * C + 2 * 2 * 6 * C * C
    return 2 * L * (C * (3 * C + M) + (C + M) * C) + 4 * L * L * C + 2 * 3 * C * C


def make_pair(cfg, kind, device, dtype, attention="auto"):
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

    C, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    torch.manual_seed(0)
    with torch.device(device):
        if kind == "double":
            ours = DoubleStreamBlock(C, H, cfg.mlp_ratio, cfg.qkv_bias, attention=attention)
            theirs = FluxTransformerBlock(dim=C, num_attention_heads=H, attention_head_dim=D)
            prefix, dprefix = "double_blocks.0.", "transformer_blocks.0."
        else:
            ours = SingleStreamBlock(C, H, cfg.mlp_ratio, attention=attention)
            theirs = FluxSingleTransformerBlock(dim=C, num_attention_heads=H, attention_head_dim=D)
            prefix, dprefix = "single_blocks.0.", "single_transformer_blocks.0."
    with torch.no_grad():  # RMSNorm scales start at 1: perturb so the weights mapping is really exercised
        for p in ours.parameters():
            p.add_(0.02 * torch.randn_like(p))
    mapped = bfl_to_diffusers({prefix + k: v for k, v in ours.state_dict().items()}, hidden_size=C)
    theirs.load_state_dict({k[len(dprefix) :]: v for k, v in mapped.items()}, strict=True)
    return ours.to(dtype), theirs.to(dtype)


def make_inputs(cfg, batch, img_tokens, txt_tokens, device, dtype):
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    g = torch.Generator(device="cpu").manual_seed(1)
    side = int(img_tokens**0.5)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(img_tokens // side), indexing="ij")
    img_ids = torch.stack((torch.zeros_like(rows), rows, cols), -1).reshape(-1, 3).float()
    ids = torch.cat((torch.zeros(txt_tokens, 3), img_ids)).to(device)  # text first
    C = cfg.hidden_size
    rand = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    return dict(
        img=rand(batch, img_tokens, C),
        txt=rand(batch, txt_tokens, C),
        vec=rand(batch, C),
        pe=fmath.rope(ids[None], cfg.axes_dim, cfg.theta),  # (2, 1, 1, L, D), ours
        rotary=FluxPosEmbed(theta=cfg.theta, axes_dim=list(cfg.axes_dim))(ids),  # (cos, sin) (L, D), diffusers'
    )


def runners(kind, ours, theirs, x):
    """Two closures: forward of ours / theirs from fresh leaf inputs, returning (txt_out, img_out)."""

    def leaf(t):
        return t.detach().requires_grad_(True)

    if kind == "double":

        def run_ours():
            img, txt = ours(leaf(x["img"]), leaf(x["txt"]), x["vec"], x["pe"])
            return txt, img

        def run_theirs():
            return theirs(leaf(x["img"]), leaf(x["txt"]), x["vec"], image_rotary_emb=x["rotary"])
    else:
        joined = torch.cat((x["txt"], x["img"]), dim=1)  # our single blocks take the joined sequence
        T = x["txt"].shape[1]

        def run_ours():
            out = ours(leaf(joined), x["vec"], x["pe"])
            return out[:, :T], out[:, T:]

        def run_theirs():
            return theirs(leaf(x["img"]), leaf(x["txt"]), x["vec"], image_rotary_emb=x["rotary"])

    return run_ours, run_theirs


def time_it(fn, grads, iters, warmup, device):
    def step():
        outs = fn()
        torch.autograd.backward(outs, grads)

    for _ in range(warmup):
        step()
    times = []
    if device.type == "cuda":
        # Events around each iteration, no sync in between: the host queues ahead as in training, so the
        # times measure the GPU work, not Python launch latency at an idle GPU.
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None):
    ap = runner.parser(__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="flux-tiny widths and few tokens (CPU smoke test)")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--img-tokens", type=int, default=1024)
    ap.add_argument("--txt-tokens", type=int, default=512)
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (default 20; 2 with --tiny)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default 5; 1 with --tiny)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument(
        "--attention",
        default="auto",
        choices=sorted(fmath.ATTENTION_BACKENDS),
        help="SDPA backends both implementations may use (our blocks' attention setting)",
    )
    args = ap.parse_args(argv)
    started = provenance.stamp()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = get_model_config("flux-tiny" if args.tiny else "flux-dev")
    img_tokens, txt_tokens = (16, 8) if args.tiny else (args.img_tokens, args.txt_tokens)
    iters = args.iters or (2 if args.tiny else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    # Process-wide SDPA flags = the blocks' backend: our attention then calls SDPA directly (its fast path, as
    # a program that sets them once gets), and diffusers' SDPA calls are restricted to the same kernels.
    fmath.set_process_sdpa_flags(args.attention)
    rows = []
    for kind in ("double", "single"):
        ours, theirs = make_pair(cfg, kind, device, dtype, args.attention)
        for batch in [int(b) for b in args.batches.split(",")]:
            x = make_inputs(cfg, batch, img_tokens, txt_tokens, device, dtype)
            run_ours, run_theirs = runners(kind, ours, theirs, x)
            g = torch.Generator(device="cpu").manual_seed(2)
            grads = (
                torch.randn(x["txt"].shape, generator=g).to(device, dtype),
                torch.randn(x["img"].shape, generator=g).to(device, dtype),
            )
            with torch.no_grad():
                a, b = run_ours(), run_theirs()
            diff = max((p.float() - q.float()).abs().max().item() for p, q in zip(a, b))
            scale = max(q.float().abs().max().item() for q in b)
            ms_ours = time_it(run_ours, grads, iters, warmup, device)
            ms_theirs = time_it(run_theirs, grads, iters, warmup, device)
            flops = 3 * batch * block_flops(cfg, img_tokens, txt_tokens, kind)
            rows.append(
                dict(
                    block=kind,
                    batch=batch,
                    img_tokens=img_tokens,
                    txt_tokens=txt_tokens,
                    ours_ms=round(ms_ours, 3),
                    diffusers_ms=round(ms_theirs, 3),
                    speedup=round(ms_theirs / ms_ours, 3),
                    ours_tflops=round(flops / ms_ours / 1e9, 1),
                    diffusers_tflops=round(flops / ms_theirs / 1e9, 1),
                    max_abs_diff=diff,
                    max_abs_output=scale,
                )
            )
        del ours, theirs
    result = dict(
        benchmark="bench_blocks",
        model=cfg.name,
        dtype=args.dtype,
        device=str(device),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__,
        diffusers=__import__("diffusers").__version__,
        iters=iters,
        warmup=warmup,
        attention=f"sdpa {'>'.join(b.name.lower() for b in fmath.ATTENTION_BACKENDS[args.attention])} for both "
        f"(process flags set once: {args.attention})",
        date=started,
        versions={**provenance.versions("torch", "deepspeed", "diffusers"), "cuda": torch.version.cuda},
        rows=rows,
    )
    out_dir = runner.out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "bench_blocks.json", "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"{result['gpu']} torch {result['torch']} diffusers {result['diffusers']} {cfg.name} {args.dtype}, "
        f"fwd+bwd median of {iters}"
    )
    print(
        "| block | batch | tokens (img+txt) | ours ms | diffusers ms | speedup | ours TFLOP/s "
        "| diffusers TFLOP/s | max abs diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['block']} | {r['batch']} | {r['img_tokens']}+{r['txt_tokens']} | {r['ours_ms']:.2f} | "
            f"{r['diffusers_ms']:.2f} | {r['speedup']:.2f}x | {r['ours_tflops']} | {r['diffusers_tflops']} | "
            f"{r['max_abs_diff']:.3g} (of {r['max_abs_output']:.3g}) |"
        )
    return result


if __name__ == "__main__":
    main()
