"""Does the sweep time what users run? launch/train.py and sweep.py on one configuration, in one call.

    PYTHONPATH=. python3 benchmarks/archive/trainer_vs_sweep.py                                  # flux-dev-lite ZeRO-2 mb 16
    PYTHONPATH=. python3 benchmarks/archive/trainer_vs_sweep.py --ckpt 0 --compile 1 --name compiled
    PYTHONPATH=. python3 benchmarks/archive/trainer_vs_sweep.py --device cpu --model flux-tiny --res 64 --txt 16 \\
        --attn auto --mb 2 --warmup 1 --steps 3                                           # CPU smoke test

1. The trainer: `launch/train.py --config <run file>` under `torch.distributed.run`, with the run file
   (sweep.run_file) and DeepSpeed JSON (sweep.deepspeed_config, i.e. fluxzero.config.deepspeed.build.build) of the case,
   for warmup + steps optimizer steps, log_every 1. Its samples/s per step come from its own metrics.jsonl
   (fluxzero.train.metrics: global batch / the slowest rank's step time). Once the last step's row is there
   the trainer's process group (which this script started) is killed (SIGKILL: SIGTERM would make it save):
   train() ends with a checkpoint (flux-dev-lite ZeRO-2: ~44 GB of weights and optimizer state) that is not
   part of the speed and that nothing here reads.
2. The sweep: sweep.sweep() on the same Case, i.e. the same run file and JSON through loop.setup + TrainStep.

Compared: the median samples/s over the timed steps (those after the warm-up) of each; agreement means
|sweep / trainer - 1| <= --tolerance (3%). The two differ by design in one respect: the sweep synchronises
the device before and after each step, the trainer does not (its per-step times pipeline; their median is the
same in a steady state). Writes $OUT/<name>.json (and the sweep's <name>.jsonl / .log); exit 0 when they agree,
1 when they do not, 2 when either side failed to measure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import provenance  # noqa: E402 - needs the line above
import runner  # noqa: E402
import sweep  # noqa: E402


def _env(device: str, case: sweep.Case) -> dict:
    """The environment sweep.sweep gives its cases, so both sides start alike."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(tempfile.gettempdir()) / "fluxzero-torch-extensions"))
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    env["FLUXZERO_NO_PROGRESS"] = "1"
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("DS_ACCELERATOR", "cpu")
    return {**env, **case.env}


def _rows(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def run_trainer(case: sweep.Case, device: str, work: Path, timeout: float) -> dict:
    """launch/train.py on the case; its metrics.jsonl rows, the timed steps' median samples/s."""
    work.mkdir(parents=True, exist_ok=True)
    ds_path, run_path, out = work / "ds.json", work / "run.yaml", work / "run"
    ds_path.write_text(json.dumps(sweep.deepspeed_config(case, case.gpus), indent=1))
    run_path.write_text(json.dumps(sweep.run_file(case, case.gpus, ds_path, out), indent=1))  # JSON is YAML
    metrics = out / "metrics.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={case.gpus}",
        str(ROOT / "launch" / "train.py"),
        "--config",
        str(run_path),
    ]
    total = case.warmup + case.steps
    t0 = time.time()
    outcome = "exit"
    with open(work / "trainer.log", "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(device, case), cwd=str(ROOT), start_new_session=True
        )
        while proc.poll() is None:
            time.sleep(0.25)
            if len(_rows(metrics)) >= total:
                outcome = "killed after its last step (the final checkpoint is not waited for)"
                break
            if time.time() - t0 > timeout:
                outcome = "timeout"
                break
        if proc.poll() is None:
            runner.kill_group(proc)  # torchrun and its ranks, found by id
    rows = _rows(metrics)
    rec = {
        "command": " ".join(cmd),
        "run_file": json.loads(run_path.read_text()),
        "ds_config": json.loads(ds_path.read_text()),
        "outcome": outcome,
        "returncode": proc.returncode,
        "wall_s": time.time() - t0,
        "metrics_rows": rows,
    }
    timed = [r["samples_per_s"] for r in rows if r["step"] > case.warmup]
    if len(rows) >= total and timed:
        rec.update(
            status="ok",
            samples_per_s=statistics.median(timed),
            samples_per_s_all=timed,
            step_s_all=[r["step_time_s"] for r in rows if r["step"] > case.warmup],
        )
    else:
        tail = (work / "trainer.log").read_text(errors="replace").strip().splitlines()[-5:]
        rec.update(status=f"{outcome}: {len(rows)} of {total} steps logged", log_tail=tail)
    return rec


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out", help="folder for <name>.json")
    p.add_argument("--name", default="trainer_vs_sweep", help="file stem of the results")
    p.add_argument("--tolerance", type=float, default=0.03, help="largest |sweep / trainer - 1| that agrees")
    p.add_argument("--timeout", type=int, default=280, help="seconds for each side, start-up included")
    g = p.add_argument_group("the configuration (one sweep Case; defaults: the issue's flux-dev-lite run)")
    g.add_argument("--model", default="flux-dev-lite")
    g.add_argument("--gpus", type=int, default=1)
    g.add_argument("--zero", type=int, default=2)
    g.add_argument("--precision", default="bf16")
    g.add_argument("--ckpt", type=int, default=1, help="checkpoint every k-th block; 0 = off")
    g.add_argument("--mb", type=int, default=16)
    g.add_argument("--res", type=int, default=512)
    g.add_argument("--txt", type=int, default=512)
    g.add_argument("--attn", default="flash")
    g.add_argument("--optim", default="torch-fused")
    g.add_argument("--compile", type=int, choices=(0, 1), default=0)
    g.add_argument("--data", default="", help="shard folder (default: synthetic latents of --res and --txt)")
    g.add_argument("--workers", type=int, default=0, help="loader worker processes (run-file num_workers)")
    g.add_argument("--warmup", type=int, default=3, help="untimed steps (a compiled case compiles in the first)")
    g.add_argument("--steps", type=int, default=10, help="timed steps")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        case = sweep.Case(
            model=a.model,
            gpus=a.gpus,
            zero=a.zero,
            precision=a.precision,
            ckpt=a.ckpt,
            mb=a.mb,
            res=a.res,
            txt=a.txt,
            attn=a.attn,
            optim=a.optim,
            compile=bool(a.compile),
            data=str(Path(a.data).resolve()) if a.data and not a.data.startswith("synthetic:") else a.data,
            workers=a.workers,
            warmup=a.warmup,
            steps=a.steps,
            timeout=a.timeout,
            min_s=0,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = provenance.stamp()
    with tempfile.TemporaryDirectory(prefix="fz-trainer-vs-sweep-") as tmp:
        print(f"trainer: launch/train.py, {case.name}, {case.warmup} + {case.steps} steps", flush=True)
        trainer = run_trainer(case, a.device, Path(tmp), a.timeout)
    print(f"trainer: {trainer['status']} [{trainer['wall_s']:.0f} s]", flush=True)
    print(f"sweep: {case.name}", flush=True)
    (row,) = sweep.sweep(a.name, [case], out_dir, a.device, budget=a.timeout + 60, grace=15.0, peak_tflops=0.0)
    result = {
        "case": dataclasses.asdict(case),
        "name": case.name,
        "date": started,
        "versions": {**provenance.versions("torch", "deepspeed"), **provenance.code_version(ROOT)},
        "tolerance": a.tolerance,
        "trainer": trainer,
        "sweep": {
            k: row.get(k)
            for k in (
                "status",
                "valid",
                "samples_per_s",
                "step_s",
                "step_s_all",
                "data_s",
                "fwd_s",
                "bwd_s",
                "opt_s",
                "engine_api",
                "run_file",
                "ds_config",
                "wall_s",
            )
        },
    }
    code = 2
    if trainer["status"] == "ok" and row.get("status") == "ok":
        ratio = row["samples_per_s"] / trainer["samples_per_s"]
        agree = abs(ratio - 1) <= a.tolerance
        result.update(ratio=ratio, agree=agree)
        code = 0 if agree else 1
        print(
            f"{case.name}: trainer {trainer['samples_per_s']:.3f} samples/s (launch/train.py metrics.jsonl, median "
            f"of steps {case.warmup + 1}-{case.warmup + case.steps}), sweep {row['samples_per_s']:.3f} samples/s "
            f"(median of {case.steps}): sweep / trainer = {ratio:.3f}, "
            + (f"agree within {a.tolerance:.0%}" if agree else f"DISAGREE by more than {a.tolerance:.0%}")
        )
    else:
        print(f"{case.name}: not compared: trainer {trainer['status']}; sweep {row.get('status')}")
    path = out_dir / f"{a.name}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
