"""Sweep results (JSON lines from benchmarks/sweep.py) -> markdown table, baseline comparison and a plot.

    python3 benchmarks/report.py OUT/lite1.jsonl OUT/dev2.jsonl --md OUT/sweep.md --plot OUT/sweep.png

Markdown goes to stdout (and --md). The plot (matplotlib, `pip install matplotlib`; skipped with a note
when it is missing) has one bar per configuration: samples/s on the left, peak memory per GPU (max over
ranks; allocated solid, reserved light) on the right. Invalid rows (skipped steps, non-finite loss) are
hatched; rows that did not run to the end (OOM, timeout) show their status instead of a bar.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MATCH_KEYS = ("model", "gpus", "zero", "precision", "ckpt", "mb", "res", "txt", "attn", "optim", "zero_opts", "env")


def load(paths) -> list[dict]:
    """Rows of each file in case order (a --parallel sweep writes them in the order they finished)."""
    rows = []
    for p in paths:
        mine = []
        for n, line in enumerate(Path(p).read_text().splitlines(), 1):
            if line.strip():
                try:
                    mine.append(json.loads(line))
                except ValueError:
                    print(f"warning: {p}:{n} is not JSON, skipped", file=sys.stderr)
        rows += sorted(mine, key=lambda r: r.get("index", 0))
    return rows


def measured(r: dict) -> bool:
    return "samples_per_s" in r


def _max(xs):
    xs = [x for x in (xs or []) if x is not None]
    return max(xs) if xs else None


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def table(rows: list[dict]) -> str:
    head = ("| set | # | configuration | status | samples/s | img tokens/s | TFLOP/s/GPU | MFU | step s | "
            "data / fwd / bwd / opt s | peak alloc GiB | peak reserved GiB | init s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if measured(r):
            split = " / ".join(_f(r.get(k), "{:.3f}") for k in ("data_s", "fwd_s", "bwd_s", "opt_s"))
            status = r["status"] if r.get("valid") else f"**INVALID: {r['status']}** ({r.get('skipped_steps')} skipped)"
            cells = [_f(r["samples_per_s"]), _f(r["img_tokens_per_s"], "{:,.0f}"), _f(r["tflops_per_gpu"], "{:.1f}"),
                     _f(r.get("mfu") and 100 * r["mfu"], "{:.1f}%"), _f(r["step_s"], "{:.3f}"), split,
                     _f(_max(r.get("peak_alloc_gib")), "{:.1f}"), _f(_max(r.get("peak_reserved_gib")), "{:.1f}"),
                     _f(r.get("init_s"), "{:.0f}")]
        else:
            status, cells = f"**{r.get('status')}**", ["-"] * 9
        lines.append(f"| {r.get('set', '')} | {r.get('index', '')} | {r['name']} | {status} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _compiled(r: dict) -> bool:
    return bool(r.get("compile"))  # rows written before the compile lever have no such key: eager


def _variant(r: dict) -> tuple:
    """Settings past MATCH_KEYS, normalised (rows written before them lack the keys)."""
    return _compiled(r), bool(r.get("z3_leaf"))


def comparison(rows: list[dict]) -> str:
    """Each diffusers row against the fluxzero row with the same settings (the issue's matched targets)."""
    def key(r):
        return tuple(json.dumps(r.get(k), sort_keys=True) for k in MATCH_KEYS) + _variant(r)

    ours = {key(r): r for r in rows if r.get("impl") == "fluxzero"}
    lines = []
    for b in rows:
        if b.get("impl") != "diffusers" or key(b) not in ours:
            continue
        f = ours[key(b)]
        name = b["name"].replace("diffusers ", "", 1)
        if measured(f) and measured(b):
            speed = f["samples_per_s"] / b["samples_per_s"]
            fm, bm = _max(f.get("peak_alloc_gib")), _max(b.get("peak_alloc_gib"))
            mem = f"{fm:.1f} vs {bm:.1f} GiB ({fm / bm:.2f}x)" if fm and bm else "-"
            valid = "" if f.get("valid") and b.get("valid") else " (a row is INVALID)"
            lines.append(f"| {name} | {f['samples_per_s']:.2f} | {b['samples_per_s']:.2f} | {speed:.2f}x{valid} | {mem} |")
        else:
            lines.append(f"| {name} | {f.get('samples_per_s', f.get('status'))} | "
                         f"{b.get('samples_per_s', b.get('status'))} | - | - |")
    if not lines:
        return ""
    return ("| matched configuration | fluxzero samples/s | diffusers samples/s | speed-up | peak alloc fluxzero vs "
            "diffusers |\n|---|---|---|---|---|\n" + "\n".join(lines))


def scaling(rows: list[dict]) -> str:
    """Each multi-GPU row against the 1-GPU row with the same settings (same per-GPU micro batch)."""
    def key(r):
        return tuple(json.dumps(r.get(k), sort_keys=True) for k in ("impl",) + MATCH_KEYS if k != "gpus") + \
            _variant(r)

    single = {key(r): r for r in rows if r.get("gpus") == 1 and measured(r)}
    lines = []
    for r in rows:
        one = single.get(key(r))
        if r.get("gpus", 1) > 1 and measured(r) and one:
            ratio = r["samples_per_s"] / one["samples_per_s"]
            valid = "" if r.get("valid") and one.get("valid") else " (a row is INVALID)"
            lines.append(f"| {r['name']} | {one['samples_per_s']:.2f} | {r['samples_per_s']:.2f} | "
                         f"{ratio:.2f}x ({100 * ratio / r['gpus']:.0f}% efficiency){valid} |")
    if not lines:
        return ""
    return ("| scaling | 1 GPU samples/s | N GPUs samples/s | speed-up |\n|---|---|---|---|\n" + "\n".join(lines))


PROFILE_CATS = ("attention", "gemm", "nccl all-gather", "nccl reduce-scatter", "nccl all-reduce",
                 "optimizer / foreach", "memcpy / memset", "other")


def profiles(rows: list[dict]) -> str:
    """Rows run with --profile: where one step's GPU time goes (kernel sums per category overlap across
    streams; busy = union of all kernels, idle = step - busy, exposed comm = busy - union of compute)."""
    lines = []
    for r in rows:
        p = r.get("profile") or {}
        if "gpu_busy_s" not in p:
            continue
        cats = p.get("kernel_s", {})
        cells = [f"{p['wall_s']:.3f}", f"{p['gpu_busy_s']:.3f}", f"{p['gpu_idle_s']:.3f}", f"{p['exposed_comm_s']:.3f}"]
        cells += [f"{cats.get(c, 0.0):.3f}" for c in PROFILE_CATS]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    if not lines:
        return ""
    head = ["configuration (profiled step, rank 0, seconds)", "step", "GPU busy", "GPU idle", "exposed comm",
            *PROFILE_CATS]
    return "| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|\n" + "\n".join(lines)


def header(rows: list[dict]) -> str:
    ok = [r for r in rows if measured(r)]
    if not ok:
        return "No configuration ran to the end."
    r = ok[0]
    v = r.get("versions", {})
    apis = sorted({x.get("engine_api", "") for x in ok if x.get("impl") == "fluxzero"})
    srcs = sorted({x.get("ds_config_source", "") for x in ok})
    return "\n".join([
        f"Date {r.get('date')}; device {v.get('device')} ({r.get('device_kind')}); torch {v.get('torch')}, "
        f"CUDA {v.get('cuda')}, deepspeed {v.get('deepspeed')}"
        + (f", diffusers {next((x['versions'].get('diffusers') for x in ok if 'diffusers' in x.get('versions', {})), '')}"
           if any("diffusers" in x.get("versions", {}) for x in ok) else "") + ".",
        f"MFU over a measured bf16 matmul peak of {_f(r.get('peak_tflops'), '{:.1f}')} TFLOP/s per GPU "
        f"({(r.get('peak') or {}).get('n', '?')}^3, median of {(r.get('peak') or {}).get('reps', '?')}, same sweep); "
        "model FLOPs = 3 x ModelConfig.flops_per_sample, recompute excluded.",
        f"fluxzero engine: {'; '.join(apis) or '-'}. DeepSpeed config: {'; '.join(srcs)}.",
        "Step time = median of the timed steps (synchronised); memory = max over ranks.",
    ])


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot written (pip install matplotlib)", file=sys.stderr)
        return False
    n = len(rows)
    fig, (ax_s, ax_m) = plt.subplots(1, 2, figsize=(16, 1.2 + 0.34 * n), sharey=True)
    ys = list(range(n))[::-1]
    colors = {"fluxzero": "tab:blue", "diffusers": "tab:orange"}
    labels = [f"{r.get('set', '')}#{r.get('index', '')} {r['name']}" for r in rows]
    xmax_s = max([r["samples_per_s"] for r in rows if measured(r)] or [1])
    xmax_m = max([_max(r.get("peak_reserved_gib")) or _max(r.get("peak_alloc_gib")) or 0 for r in rows if measured(r)]
                 or [1]) or 1
    for y, r in zip(ys, rows):
        c = colors.get(r.get("impl"), "gray")
        if not measured(r):
            ax_s.text(0.01 * xmax_s, y, str(r.get("status"))[:60], va="center", fontsize=8, color="crimson")
            continue
        hatch = None if r.get("valid") else "xx"
        ax_s.barh(y, r["samples_per_s"], color=c, hatch=hatch, edgecolor="black" if hatch else None)
        mfu = f"  {r['samples_per_s']:.2f}" + (f"  MFU {100 * r['mfu']:.0f}%" if r.get("mfu") else "")
        ax_s.text(r["samples_per_s"], y, mfu + ("" if r.get("valid") else "  INVALID"), va="center", fontsize=8)
        alloc, reserved = _max(r.get("peak_alloc_gib")), _max(r.get("peak_reserved_gib"))
        if reserved is not None:
            ax_m.barh(y, reserved, color=c, alpha=0.3)
        if alloc is not None:
            ax_m.barh(y, alloc, color=c, hatch=hatch)
            ax_m.text(reserved or alloc, y, f"  {alloc:.0f}/{reserved or 0:.0f}", va="center", fontsize=8)
    ax_s.set_yticks(ys, labels, fontsize=8)
    ax_s.set_xlabel("samples/s (all GPUs)")
    ax_s.set_xlim(0, xmax_s * 1.35)
    ax_m.set_xlabel("peak memory per GPU, GiB (solid allocated, light reserved)")
    ax_m.set_xlim(0, xmax_m * 1.25)
    for ax in (ax_s, ax_m):
        ax.grid(axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=v) for v in colors.values()]
    ax_s.legend(handles, list(colors), loc="lower right", fontsize=8)
    fig.suptitle("FLUX.1 training throughput and memory per configuration (hatched: invalid)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def compile_effect(rows: list[dict]) -> str:
    """Each row with torch.compile'd blocks against its eager twin (same settings; same sweep when both come
    from one file): speed, memory, the largest relative loss difference over the steps (same batches), what
    Dynamo made, and the longest warm-up step (the compilation). At ZeRO-3 the twin is the plain eager row,
    not the one with leaf blocks: the trainer makes compiled blocks leaves itself."""
    def key(r):
        return tuple(json.dumps(r.get(k), sort_keys=True) for k in ("impl",) + MATCH_KEYS) + (bool(r.get("z3_leaf")),)

    eager = {key(r): r for r in rows if not _compiled(r)}
    lines = []
    for c in rows:
        if not _compiled(c) or key(c) not in eager:
            continue
        e = eager[key(c)]
        name = c["name"].replace(" compiled", "")
        graphs = f"{c.get('compile_graphs', '-')} / {c.get('compile_graph_breaks', '-')}"
        warm = _max(c.get("warmup_s_all") or [])
        warm = f"{warm:.0f}" if warm else "-"
        if measured(c) and measured(e):
            speed = c["samples_per_s"] / e["samples_per_s"]
            cm, em = _max(c.get("peak_alloc_gib")), _max(e.get("peak_alloc_gib"))
            mem = f"{cm:.1f} vs {em:.1f} GiB" if cm and em else "-"
            lc, le = c.get("losses_rank0") or [], e.get("losses_rank0") or []
            diff = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(lc, le)), default=None)
            diff = f"{diff:.1e}" if diff is not None else "-"
            valid = "" if c.get("valid") and e.get("valid") else " (a row is INVALID)"
            lines.append(f"| {name} | {e['samples_per_s']:.2f} | {c['samples_per_s']:.2f} | {speed:.2f}x{valid} | "
                         f"{mem} | {diff} | {graphs} | {warm} |")
        else:
            lines.append(f"| {name} | {e.get('samples_per_s', e.get('status'))} | "
                         f"{c.get('samples_per_s', c.get('status'))} | - | - | - | {graphs} | {warm} |")
    if not lines:
        return ""
    return ("| configuration | eager samples/s | compiled samples/s | speed-up | peak alloc compiled vs eager | "
            "max rel. loss diff | graphs / breaks | longest warm-up step s |\n|---|---|---|---|---|---|---|---|\n"
            + "\n".join(lines))


def render(rows: list[dict]) -> str:
    parts = [header(rows), "", table(rows)]
    for extra in (comparison(rows), compile_effect(rows), scaling(rows), profiles(rows)):
        if extra:
            parts += ["", extra]
    return "\n".join(parts) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("jsonl", nargs="+", help="results of benchmarks/sweep.py")
    p.add_argument("--md", help="also write the markdown here")
    p.add_argument("--plot", help="write the plot here (.png / .svg)")
    args = p.parse_args(argv)
    missing = [x for x in args.jsonl if not Path(x).is_file()]
    if missing:
        p.error(f"no such results file: {', '.join(missing)}")
    rows = load(args.jsonl)
    if not rows:
        p.error("the results files hold no rows")
    text = render(rows)
    print(text, end="")
    if args.md:
        Path(args.md).write_text(text)
    if args.plot and plot(rows, args.plot):
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
