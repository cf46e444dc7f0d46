"""Every offload preset of `fluxzero gen-config` as a user runs it: train, save, resume, export.

For each preset (zero2-offload, zero3-offload, and ZeRO-3 with `--offload-param cpu` alone), on --model:
    1. `python launch/train.py` (one process) for --steps steps, saving a checkpoint at the last one;
    2. the same command again: it resumes and trains 2 more steps (final save);
    3. `fluxzero export` of the run's output_dir.
Each is a subprocess with a timeout (--timeout per run). A short prelude in the trainer's process applies
--memory-cap-gib (torch.cuda.set_per_process_memory_fraction, as a 24 GB card would cap it) and records peak
reserved memory beside the peak allocated memory the trainer itself logs (metrics.jsonl `peak_memory_gb`).

Records one JSON line per preset in --out/offload_presets.jsonl: ok or failed (with the last error line and
the phase), samples/s (median over metrics.jsonl records of both starts), peak allocated / reserved GPU memory,
host RSS peak of the trainer processes (wait4's ru_maxrss), wall time of each phase. Prints a table last.

    # GPU (what issue 27 asks for): flux-dev, rank-16 LoRA, 512 px, capped like a 24 GB card
    PYTHONPATH=. python3 benchmarks/offload_presets.py --model flux-dev --lora-rank 16 --res 512 \\
        --memory-cap-gib 23.6 --weights /path/flux1-dev.safetensors --out $OUT
    # CPU smoke test (torch AdamW, no DeepSpeedCPUAdam build)
    PYTHONPATH=. python benchmarks/offload_presets.py --adam-impl torch --precision fp32 --out /tmp/op

A base with random weights is used when --weights is not given (speed and memory do not depend on the values).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runner, also when this file is loaded by path
import runner  # noqa: E402

ROOT = runner.ROOT
PRESETS = {  # name -> gen-config arguments
    "zero2-offload": ["--preset", "zero2-offload"],
    "zero3-offload": ["--preset", "zero3-offload"],
    "zero3-param-offload": ["--preset", "zero3", "--offload-param", "cpu"],
}

# Runs in the trainer's own process before launch/train.py: the memory cap, and peak reserved memory written
# to a file when train() returns (launch/train.py leaves through os._exit, so atexit would not run).
PRELUDE = r"""
import json, os, runpy, sys
import torch
cap, report = float(os.environ["OP_CAP_GIB"]), os.environ["OP_REPORT"]
if cap and torch.cuda.is_available():
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**30 / total))
import fluxzero.train.loop as loop
_train = loop.train
def train(*args, **kwargs):
    try:
        return _train(*args, **kwargs)
    finally:
        if torch.cuda.is_available():
            with open(report, "w") as f:
                json.dump({"peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
                           "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9}, f)
loop.train = train
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(cmd: list[str], timeout: float, env: dict, log: Path) -> dict:
    """One subprocess (its own process group, killed whole on timeout): exit code, wall time, peak RSS, last error."""
    r = runner.run(cmd, timeout=timeout, log=log, env=env)
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    error = next((line for line in reversed(lines) if "error" in line.lower()), lines[-1] if lines else "")
    return {
        "rc": r.rc,
        "wall_s": round(r.wall_s, 1),
        "rss_gb": r.rss_gb,
        "error": None if r.rc == 0 else ("timed out" if r.timed_out else error[-300:]),
    }


def data_spec(model_cfg, res: int, txt: int) -> str:
    latent = res // 8  # the VAE's 8x downsampling; the model packs 2x2 latent patches into one token
    return f"synthetic:n=16,hw={latent}x{latent},txt={txt},ctx={model_cfg.context_in_dim},vec={model_cfg.vec_in_dim}"


def one_preset(name: str, args, folder: Path) -> dict:
    from fluxzero.config import get_model_config

    folder.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "FLUXZERO_NO_PROGRESS": "1",
        "OP_CAP_GIB": str(args.memory_cap_gib or 0),
    }
    record = {
        "preset": name,
        "model": args.model,
        "lora_rank": args.lora_rank,
        "res": args.res,
        "steps": args.steps,
        "memory_cap_gib": args.memory_cap_gib,
        "ok": False,
    }
    ds = folder / "ds.json"
    gen = [
        py,
        "-m",
        "fluxzero.cli",
        "gen-config",
        *PRESETS[name],
        "--model",
        args.model,
        "--micro-batch",
        "1",
        "--lr",
        str(args.lr),
        "--scheduler",
        "none",
        "--steps-per-print",
        "1000000",
        "-o",
        str(ds),
    ]
    if args.adam_impl:
        gen += ["--adam-impl", args.adam_impl]
    if args.precision:
        gen += ["--precision", args.precision]
    r = run(gen, 120, env, folder / "gen-config.log")
    if r["rc"]:
        return {**record, "phase": "gen-config", "error": r["error"]}
    run_file = {
        "deepspeed": str(ds),
        "data": data_spec(get_model_config(args.model), args.res, args.txt),
        "output_dir": str(folder / "run"),
        "model": args.model,
        "steps": args.steps + 2,
        "stop_after": args.steps,
        "checkpoint": {"every": args.steps},
        "log_every": 1,
        "export": {"format": None},
        "seed": 0,
    }
    if args.weights:
        run_file["weights"] = args.weights
    if args.lora_rank:
        run_file["lora"] = {"rank": args.lora_rank, "targets": args.lora_targets}
    (folder / "run.yaml").write_text(json.dumps(run_file, indent=1))
    train = [py, "-c", PRELUDE, str(ROOT / "launch" / "train.py"), "--config", str(folder / "run.yaml")]
    phases = [
        ("train", train),
        ("resume", train + ["stop_after=0"]),
        (
            "export",
            [
                py,
                "-m",
                "fluxzero.cli",
                "export",
                str(folder / "run"),
                str(folder / "export.safetensors"),
                "--overwrite",
            ],
        ),
    ]
    for phase, cmd in phases:
        r = run(cmd, args.timeout, {**env, "OP_REPORT": str(folder / f"{phase}_memory.json")}, folder / f"{phase}.log")
        record[f"{phase}_wall_s"] = r["wall_s"]
        if phase != "export":
            record["host_rss_peak_gb"] = max(record.get("host_rss_peak_gb", 0.0), r["rss_gb"])
            memory = folder / f"{phase}_memory.json"
            if memory.is_file():
                for k, v in json.loads(memory.read_text()).items():
                    record[k] = max(record.get(k, 0.0), v)
        if phase == "resume":  # the trainer's own line: the second start continued the checkpoint
            record["resumed"] = f"resuming from step {args.steps} " in (folder / "resume.log").read_text()
        if r["rc"]:
            record.update(phase=phase, error=r["error"])
            break
    else:
        record["ok"] = record.get("resumed", False)
        if not record["ok"]:
            record.update(phase="resume", error="the second start did not resume the checkpoint")
    metrics = folder / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    if rows:
        record["steps_logged"] = [row["step"] for row in rows]
        record["samples_per_s"] = statistics.median(row["samples_per_s"] for row in rows)
        # the trainer's own figure: max_memory_allocated on a GPU, the process's peak RSS on the CPU
        record["logged_peak_memory_gb"] = max(row["peak_memory_gb"] for row in rows)
    return record


def main(argv=None) -> int:
    p = runner.parser(__doc__)
    p.add_argument("--model", default="flux-tiny")
    p.add_argument("--weights", default=None, help="base weights (safetensors); random init when not given")
    p.add_argument("--lora-rank", type=int, default=16, help="0: full fine-tune")
    p.add_argument("--lora-targets", default="all-linear")
    p.add_argument("--res", type=int, default=256, help="image side in pixels (synthetic latents of res/8)")
    p.add_argument("--txt", type=int, default=16, help="T5 tokens per sample (512 for FLUX.1-dev)")
    p.add_argument("--steps", type=int, default=4, help="steps before the save; the resume adds 2")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument(
        "--memory-cap-gib",
        type=float,
        default=None,
        help="cap the trainer's GPU memory (torch.cuda.set_per_process_memory_fraction)",
    )
    p.add_argument(
        "--adam-impl",
        choices=["torch", "fused", "cpu"],
        default=None,
        help="override the presets' AdamW (torch: no DeepSpeedCPUAdam build, for a CPU smoke test)",
    )
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None)
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated subset of " + ", ".join(PRESETS))
    runner.add_timeout(p, 1800, "seconds per subprocess")
    runner.add_out(p, "offload_presets", "folder for offload_presets.jsonl and each preset's run")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "offload_presets.jsonl"
    records = []
    for name in args.presets.split(","):
        record = one_preset(name, args, args.out / name)
        records.append(record)
        runner.append_row(jsonl, record)
    print(f"\n{'preset':<22}{'ok':<5}{'samples/s':>10}{'alloc GB':>10}{'resv GB':>9}{'RSS GB':>8}{'wall s':>8}  error")
    for r in records:
        wall = sum(r.get(f"{ph}_wall_s", 0) for ph in ("train", "resume", "export"))
        print(
            f"{r['preset']:<22}{'yes' if r['ok'] else 'NO':<5}{r.get('samples_per_s', float('nan')):>10.3f}"
            f"{r.get('peak_allocated_gb', float('nan')):>10.2f}{r.get('peak_reserved_gb', float('nan')):>9.2f}"
            f"{r.get('host_rss_peak_gb', float('nan')):>8.2f}{wall:>8.0f}  "
            f"{'' if r['ok'] else r.get('phase', '') + ': ' + str(r.get('error'))}"
        )
    print(f"records: {jsonl}")
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
