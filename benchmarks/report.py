"""Sweep results (JSON lines from benchmarks/sweep.py) -> markdown table, baseline comparison and a plot.

    python3 benchmarks/report.py OUT/lite1.jsonl OUT/dev2.jsonl --md OUT/sweep.md --plot OUT/sweep.png

Markdown goes to stdout (and --md). The plot (matplotlib, `pip install matplotlib`; skipped with a note
when it is missing) has one bar per configuration: samples/s on the left, peak memory per GPU (max over
ranks; allocated solid, reserved light) on the right. Invalid rows (skipped steps, non-finite loss) are
hatched; rows that did not run to the end (OOM, timeout) show their status instead of a bar.

Pairs (fluxzero vs baseline, N GPUs vs 1, compiled vs eager) use every measured row of a configuration, those
of the same sweep (set and start time) first, and say when the two rows come from different sweeps; a row that
never ran is shown only when no row of its configuration was measured. Configurations with several rows are
listed together at the end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runner, also when this file is loaded by path
import runner  # noqa: E402

MATCH_KEYS = ("model", "gpus", "zero", "precision", "ckpt", "mb", "res", "txt", "attn", "optim", "zero_opts", "env")


def load(paths) -> list[dict]:
    """Rows of each file in case order (a --parallel sweep writes them in the order they finished), sweep by
    sweep where one file holds several (a rerun under the same --name appends to it)."""
    rows = []
    for p in paths:
        mine = []
        for n, line in enumerate(Path(p).read_text().splitlines(), 1):
            if line.strip():
                try:
                    mine.append(json.loads(line))
                except ValueError:
                    print(f"warning: {p}:{n} is not JSON, skipped", file=sys.stderr)
        rows += sorted(mine, key=lambda r: (str(r.get("date") or ""), r.get("index", 0)))
    return rows


def measured(r: dict) -> bool:
    return "samples_per_s" in r


def _max(xs):
    xs = [x for x in (xs or []) if x is not None]
    return max(xs) if xs else None


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def table(rows: list[dict]) -> str:
    head = (
        "| set | # | configuration | status | samples/s | img tokens/s | TFLOP/s/GPU | MFU | step s | "
        "data / fwd / bwd / opt s | peak alloc GiB | peak reserved GiB | init s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if measured(r):
            split = " / ".join(_f(r.get(k), "{:.3f}") for k in ("data_s", "fwd_s", "bwd_s", "opt_s"))
            status = r["status"] if r.get("valid") else f"**INVALID: {r['status']}** ({r.get('skipped_steps')} skipped)"
            steps = [x for x in r.get("step_s_all") or [] if x is not None]
            step = _f(r["step_s"], "{:.3f}") + (f" ({min(steps):.2f}-{max(steps):.2f})" if len(steps) > 1 else "")
            cells = [
                _f(r["samples_per_s"]),
                _f(r["img_tokens_per_s"], "{:,.0f}"),
                _f(r["tflops_per_gpu"], "{:.1f}"),
                _f(r.get("mfu") and 100 * r["mfu"], "{:.1f}%"),
                step,
                split,
                _f(_max(r.get("peak_alloc_gib")), "{:.1f}"),
                _f(_max(r.get("peak_reserved_gib")), "{:.1f}"),
                _f(r.get("init_s"), "{:.0f}"),
            ]
        else:
            status, cells = f"**{r.get('status')}**", ["-"] * 9
        lines.append(
            f"| {r.get('set', '')} | {r.get('index', '')} | {r['name']} | {status} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def _compiled(r: dict) -> bool:
    return bool(r.get("compile"))  # rows written before the compile lever have no such key: eager


def _variant(r: dict) -> tuple:
    """Settings past MATCH_KEYS, normalised (rows written before them lack the keys)."""
    return _compiled(r), bool(r.get("z3_leaf")), r.get("data") or ""  # data: a shard folder, "" synthetic


def _key(r: dict, keys=MATCH_KEYS, variant=True) -> tuple:
    return tuple(json.dumps(r.get(k), sort_keys=True) for k in keys) + (_variant(r) if variant else ())


def _sweep(r: dict) -> tuple:
    """One sweep.py invocation: its set (file stem) and start time."""
    return r.get("set"), r.get("date")


def _ref(r: dict) -> str:
    """Where a row comes from: set#index, and whether it shared the machine with a parallel case."""
    par = r.get("parallel") or 1
    return f"{r.get('set', '?')}#{r.get('index', '?')}" + (f" (parallel {par})" if par > 1 else "")


def _partners(row: dict, candidates: list[dict]) -> list[dict]:
    """The rows of `candidates` to set against `row`: every measured one, those of row's own sweep first (a
    pair from one call shares the machine, its peak and the code); when none ran to the end, the one that
    says why (own sweep first). A later row that never ran does not hide an earlier measured one."""
    same = [c for c in candidates if _sweep(c) == _sweep(row)]
    other = [c for c in candidates if _sweep(c) != _sweep(row)]
    return [c for c in same + other if measured(c)] or (same + other)[:1]


def _apart(a: dict, b: dict) -> str:
    return "" if _sweep(a) == _sweep(b) else "; rows from different sweeps"


def _status(r: dict) -> str:
    return f"{r['samples_per_s']:.2f}" if measured(r) else str(r.get("status"))


def _gib_pair(a, b) -> str:
    return f"{a:.2f} / {b:.2f} ({a - b:+.2f})" if a is not None and b is not None else "-"


TARGET_SPEEDUP = 1.3  # issue 7: samples/s >= 1.3x the baseline at every matched configuration, peak memory no higher


def _target(speed: float, f: dict, b: dict) -> str:
    misses = [f"{speed:.2f}x < {TARGET_SPEEDUP}x"] if speed < TARGET_SPEEDUP else []
    for what, k in (("allocated", "peak_alloc_gib"), ("reserved", "peak_reserved_gib")):
        fm, bm = _max(f.get(k)), _max(b.get(k))
        if fm is not None and bm is not None and fm > bm:
            misses.append(f"{what} {fm - bm:+.2f} GiB")
    return "missed: " + ", ".join(misses) if misses else "met"


def comparison(rows: list[dict]) -> str:
    """Each diffusers row against the fluxzero rows with the same settings (the issue's matched targets): every
    measured one, the same sweep's first."""
    ours = [r for r in rows if r.get("impl") == "fluxzero"]
    lines = []
    for b in rows:
        if b.get("impl") != "diffusers":
            continue
        name = b["name"].replace("diffusers ", "", 1)
        for f in _partners(b, [r for r in ours if _key(r) == _key(b)]):
            refs = f"{_ref(f)} / {_ref(b)}"
            if measured(f) and measured(b):
                speed = f["samples_per_s"] / b["samples_per_s"]
                invalid = "" if f.get("valid") and b.get("valid") else " (a row is INVALID)"
                lines.append(
                    f"| {name} | {refs} | {f['samples_per_s']:.2f} | {b['samples_per_s']:.2f} | "
                    f"{speed:.2f}x{invalid}{_apart(f, b)} | "
                    f"{_gib_pair(_max(f.get('peak_alloc_gib')), _max(b.get('peak_alloc_gib')))} | "
                    f"{_gib_pair(_max(f.get('peak_reserved_gib')), _max(b.get('peak_reserved_gib')))} | "
                    f"{'-' if invalid else _target(speed, f, b)} |"
                )
            else:
                lines.append(f"| {name} | {refs} | {_status(f)} | {_status(b)} | - | - | - | - |")
    if not lines:
        return ""
    return (
        "| matched configuration | rows (fluxzero / diffusers) | fluxzero samples/s | diffusers samples/s | "
        "speed-up | peak alloc GiB fluxzero / diffusers | peak reserved GiB fluxzero / diffusers | "
        f"target (>= {TARGET_SPEEDUP}x, memory no higher) |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(lines)
    )


def scaling(rows: list[dict]) -> str:
    """Each multi-GPU row against the 1-GPU rows with the same settings (same per-GPU micro batch): every
    measured one, the same sweep's first."""
    keys = ("impl",) + tuple(k for k in MATCH_KEYS if k != "gpus")
    single = [r for r in rows if r.get("gpus") == 1 and measured(r)]
    lines = []
    for r in rows:
        if r.get("gpus", 1) <= 1 or not measured(r):
            continue
        for one in _partners(r, [s for s in single if _key(s, keys) == _key(r, keys)]):
            ratio = r["samples_per_s"] / one["samples_per_s"]
            invalid = "" if r.get("valid") and one.get("valid") else " (a row is INVALID)"
            lines.append(
                f"| {r['name']} | {_ref(one)} / {_ref(r)} | {one['samples_per_s']:.2f} | "
                f"{r['samples_per_s']:.2f} | {ratio:.2f}x ({100 * ratio / r['gpus']:.0f}% efficiency)"
                f"{invalid}{_apart(one, r)} |"
            )
    if not lines:
        return ""
    return (
        "| scaling | rows (1 GPU / N GPUs) | 1 GPU samples/s | N GPUs samples/s | speed-up |\n"
        "|---|---|---|---|---|\n" + "\n".join(lines)
    )


def repeats(rows: list[dict]) -> str:
    """Configurations with more than one row (a rerun, a case not run in one sweep and run in another, before
    and after a change): all of them, so a table that pairs one of them hides nothing."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(_key(r, ("impl",) + MATCH_KEYS), []).append(r)
    lines = []
    for group in groups.values():
        if len(group) < 2:
            continue
        cells = []
        for r in group:
            steps = [x for x in r.get("step_s_all") or [] if x is not None]
            spread = f", timed steps {min(steps):.2f}-{max(steps):.2f} s (n={len(steps)})" if steps else ""
            cells.append(
                f"{_ref(r)} {r.get('date', '')}: {_status(r)}" + (" samples/s" if measured(r) else "") + spread
            )
        lines.append(f"| {group[0]['name']} | " + "; ".join(cells) + " |")
    if not lines:
        return ""
    return (
        "| configuration with more than one row | rows (set#index, sweep start: samples/s or status) |\n"
        "|---|---|\n" + "\n".join(lines)
    )


PROFILE_CATS = (
    "attention",
    "gemm",
    "nccl all-gather",
    "nccl reduce-scatter",
    "nccl all-reduce",
    "optimizer / foreach",
    "memcpy / memset",
    "other",
)


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
    head = [
        "configuration (profiled step, rank 0, seconds)",
        "step",
        "GPU busy",
        "GPU idle",
        "exposed comm",
        *PROFILE_CATS,
    ]
    return "| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|\n" + "\n".join(lines)


def _joined(values) -> str:
    vals = sorted({str(v) for v in values if v not in (None, "")})
    return ", ".join(vals) or "-"


def _code(v: dict) -> str:
    commit = v.get("git_commit")
    if not commit:
        return "not recorded"
    if commit == "unknown":
        return "unknown"
    return commit[:10] + {True: " +changes", False: "", "unknown": " (changes unknown)"}.get(v.get("git_dirty"), "")


def header(rows: list[dict]) -> str:
    """What each sweep (one sweep.py call: set and start time) ran on, with its own measured matmul peak."""
    ok = [r for r in rows if measured(r)]
    if not ok:
        return "No configuration ran to the end."
    sweeps: dict[tuple, list[dict]] = {}
    for r in rows:
        sweeps.setdefault(_sweep(r), []).append(r)
    lines = [
        "| set | sweep start | rows (measured) | parallel | device | bf16 matmul peak TFLOP/s | torch | CUDA | "
        "deepspeed | diffusers | code (git) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (name, date), group in sweeps.items():
        got = [r for r in group if measured(r)]
        vs = [r.get("versions") or {} for r in got]
        peaks = [r.get("peak_tflops") or (r.get("peak") or {}).get("peak_tflops") for r in got or group]
        lines.append(
            " | ".join(
                [
                    f"| {name}",
                    str(date),
                    f"{len(group)} ({len(got)})",
                    _joined(r.get("parallel") or 1 for r in group),
                    _joined(v.get("device") for v in vs),
                    _joined(f"{p:.1f}" for p in peaks if p),
                    _joined(v.get("torch") for v in vs),
                    _joined(v.get("cuda") for v in vs),
                    _joined(v.get("deepspeed") for v in vs),
                    _joined(v.get("diffusers") for v in vs),
                    _joined(_code(v) for v in vs),
                ]
            )
            + " |"
        )
    sizes = _joined(
        f"{(r.get('peak') or {}).get('n', '?')}^3, median of {(r.get('peak') or {}).get('reps', '?')}"
        for r in ok
        if r.get("peak")
    )
    apis = sorted({x.get("engine_api", "") for x in ok if x.get("impl") == "fluxzero"})
    srcs = sorted({x.get("ds_config_source", "") for x in ok})
    return "\n".join(
        lines
        + [
            "",
            f"MFU over the bf16 matmul peak ({sizes}) measured at the start of each row's own sweep (column above); "
            "model FLOPs = ModelConfig.train_flops_per_sample (3x the forward; a LoRA's frozen linears 2x), "
            "recompute excluded.",
            f"fluxzero engine: {'; '.join(apis) or '-'}. DeepSpeed config: {'; '.join(srcs)}.",
            "Step time = median of the timed steps (synchronised), their range in brackets; memory = max over ranks. "
            "Rows of a sweep with parallel > 1 may have run beside another case (one GPU each, shared host).",
        ]
    )


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
    xmax_m = (
        max(
            [_max(r.get("peak_reserved_gib")) or _max(r.get("peak_alloc_gib")) or 0 for r in rows if measured(r)] or [1]
        )
        or 1
    )
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
    keys = ("impl",) + MATCH_KEYS
    eager = [r for r in rows if not _compiled(r)]
    pairs = [
        (c, e)
        for c in rows
        if _compiled(c)
        for e in _partners(
            c,
            [
                r
                for r in eager
                if _key(r, keys, False) == _key(c, keys, False) and bool(r.get("z3_leaf")) == bool(c.get("z3_leaf"))
            ],
        )
    ]
    lines = []
    for c, e in pairs:
        name = c["name"].replace(" compiled", "") + ("" if _sweep(c) == _sweep(e) else f" ({_ref(e)} / {_ref(c)})")
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
            lines.append(
                f"| {name} | {e['samples_per_s']:.2f} | {c['samples_per_s']:.2f} | {speed:.2f}x{valid} | "
                f"{mem} | {diff} | {graphs} | {warm} |"
            )
        else:
            lines.append(
                f"| {name} | {e.get('samples_per_s', e.get('status'))} | "
                f"{c.get('samples_per_s', c.get('status'))} | - | - | - | {graphs} | {warm} |"
            )
    if not lines:
        return ""
    return (
        "| configuration | eager samples/s | compiled samples/s | speed-up | peak alloc compiled vs eager | "
        "max rel. loss diff | graphs / breaks | longest warm-up step s |\n|---|---|---|---|---|---|---|---|\n"
        + "\n".join(lines)
    )


def render(rows: list[dict]) -> str:
    parts = [header(rows), "", table(rows)]
    for extra in (comparison(rows), compile_effect(rows), scaling(rows), repeats(rows), profiles(rows)):
        if extra:
            parts += ["", extra]
    return "\n".join(parts) + "\n"


def main(argv=None) -> int:
    p = runner.parser(__doc__)
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
