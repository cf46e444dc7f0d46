"""Kill trials: kill -9 (or SIGTERM) a rank of a real 2-rank run at a chosen moment, resume, and compare bit for bit
with an uninterrupted run (every loss in metrics.jsonl, the final export's sha256).

    python benchmarks/kill_trials.py --stage 2 --trials 12 --out benchmarks/results/kill_trials_zero2.json
    python benchmarks/kill_trials.py --stage 3 --lora-ema --trials 8 --out benchmarks/results/kill_trials_lora_ema.json
    python benchmarks/kill_trials.py --stage 2 --optimizer-mode adamw8bit-sr --trials 7
    python benchmarks/kill_trials.py --stage 2 --precision fp16 --trials 7   # where DeepSpeed trains fp16
    python benchmarks/kill_trials.py --stage 0 --optimizer-mode fused-adafactor-sr --trials 12

--lora-ema trains a LoRA (rank 4, all linear layers) with an EMA of its adapters and exports the EMA
(lora_ema.safetensors), so a kill can land in an EMA shard write or in the LoRA export too. --optimizer-mode trains
with one of fluxzero's optimizer modes (fluxzero.config.optim_modes; fused-adafactor-sr at --stage 0 streams two of
flux-tiny's four blocks from host memory, so a kill can land while a block's update is written back), --precision
fp16 in fp16 (its checkpoints hold a loss scaler and fp16 optimizer states).

"Bit for bit" is by sha256 of the final files: the export and every file of the final checkpoint folder
(DeepSpeed's model and optimizer states, the trainer states, the EMA shards, run.yaml, ds_config.json). A file
whose hash differs is recorded with whether its tensors are nevertheless equal (safetensors files).

Each run is launch/train.py started twice by hand (RANK/WORLD_SIZE set, no launcher) so that one rank alone can
be signalled; flux-tiny on synthetic latents, CPU/gloo. After a kill -9 the surviving rank gets up to 60 s to
stop on its own (what it printed and its exit status are recorded), then it is killed too, as a launcher would.
The trial kinds, cycled in this order:

- step:    kill -9 of a random rank right after a random step was logged
- save:    kill -9 of a random rank 0.1-35 ms after a checkpoint folder appeared (inside the save or just after)
- startup: kill -9 of a random rank at a random moment before the first step (aimed again, earlier, when the
           first step comes first)
- double:  kill -9 at a random step, then a second kill -9 at a random moment of the resumed run
- export:  kill -9 of rank 0 (the only exporter) 0-1 ms after the final export's temp file appeared
- sigterm: SIGTERM to a random rank after a random step (both ranks must save that step and exit 143)
- lost-latest: kill -9 of a random rank after a random step, then checkpoints/latest deleted before the resume
           (the resume must take the newest complete step folder, never start over)
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runner, also when this file is loaded by path
import runner  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("step", "save", "startup", "double", "export", "sigterm", "lost-latest")
STEPS, EVERY = 12, 3
DATA = "synthetic:n=64,hw=8x8,txt=4,ctx=64,vec=32"


def write_run(
    folder: Path, stage: int, lora_ema: bool = False, mode: str | None = None, precision: str = "fp32"
) -> Path:
    """The run file (and its DeepSpeed config) every run of a stage uses; output_dir is folder/out. mode: a
    fluxzero optimizer mode (with the bf16 keys it needs); precision: fp32 or fp16 (DeepSpeed's fp16 section)."""
    folder.mkdir(parents=True, exist_ok=True)
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    if mode:
        from fluxzero.config.optim_modes import get_mode

        ds.update(fluxzero={"optimizer_mode": mode}, zero_allow_untested_optimizer=True)
        if get_mode(mode).ds_bf16_section(stage):
            ds["bf16"] = get_mode(mode).ds_bf16_section(stage)
        if get_mode(mode).fused:  # each update in backward (no global-norm clipping), two of four blocks streamed
            ds.update(gradient_clipping=0.0)
            ds["fluxzero"]["offload_blocks"] = 2
    if precision == "fp16":
        ds["fp16"] = {"enabled": True}
    (folder / "ds.json").write_text(json.dumps(ds))
    run = {
        "deepspeed": str(folder / "ds.json"),
        "data": DATA,
        "output_dir": str(folder / "out"),
        "model": "flux-tiny",
        "steps": STEPS,
        "checkpoint": {"every": EVERY},
        "log_every": 1,
        "seed": 0,
        "export": {"format": "bfl", "dtype": "bf16"},
    }
    if lora_ema:
        run.update(
            lora={"rank": 4, "alpha": 4, "targets": "all-linear"},
            ema={"decay": 0.9},
            export={"format": "bfl", "dtype": "bf16", "weights": "ema"},
        )
    (folder / "run.yaml").write_text(yaml.safe_dump(run))
    return folder / "run.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """Two ranks of launch/train.py; their output goes to files (a full pipe would stall a rank)."""

    def __init__(self, run_file: Path, log_prefix: Path):
        port = _free_port()
        self.logs = [Path(f"{log_prefix}.rank{r}.log") for r in range(2)]
        self.started = time.monotonic()
        self.procs = []
        for r in range(2):
            env = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "OMP_NUM_THREADS": "1",
                "FLUXZERO_NO_PROGRESS": "1",
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            with open(self.logs[r], "w") as log:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(run_file)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                )

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def kill(self, rank: int, sig=signal.SIGKILL) -> None:
        if self.procs[rank].poll() is None:
            os.kill(self.procs[rank].pid, sig)

    def kill_all(self) -> None:
        for r in range(2):
            self.kill(r)
        self.wait(30)

    def text(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")


def logged_steps(out: Path) -> list[int]:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass  # a line being written
    return steps


def losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows]


def sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


EXPORTS = ("export.safetensors", "lora.safetensors", "lora_ema.safetensors")


def final_files(out: Path) -> dict[str, str]:
    """sha256 of the run's final files: its export and every file of the checkpoint `latest` names (run.yaml
    and ds_config.json with the run's own folder written as <run>: each trial runs in another folder)."""

    def digest(f: Path) -> str:
        data = f.read_bytes()
        if f.name in ("run.yaml", "ds_config.json"):
            data = data.replace(str(out.parent).encode(), b"<run>")
        return hashlib.sha256(data).hexdigest()

    files = {name: digest(out / name) for name in EXPORTS if (out / name).is_file()}
    latest = out / "checkpoints" / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        for f in sorted((out / "checkpoints" / tag).iterdir()):
            if f.is_file():
                files[f"checkpoints/{tag}/{f.name}"] = digest(f)
    return files


def _safetensors_parts(path: Path) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), f.read()


def _same_but_header_order(a: Path, b: Path) -> bool | None:
    """For two safetensors files of other sha256: whether their headers are equal as JSON (the same tensors at the
    same offsets, the same metadata) and their data bytes identical, i.e. only the header's key order differs;
    None for other files."""
    if a.suffix != ".safetensors" or not (a.is_file() and b.is_file()):
        return None
    return _safetensors_parts(a) == _safetensors_parts(b)


def compare_files(out: Path, ref_out: Path, ref_files: dict[str, str]) -> dict:
    got = final_files(out)
    differ = sorted(k for k in set(got) | set(ref_files) if got.get(k) != ref_files.get(k))
    order = {k: _same_but_header_order(out / k, ref_out / k) for k in differ}
    return {
        "files_equal": not differ,
        "files_compared": len(ref_files),
        "files_differ": order,
        # a LoRA file whose header keys came in a random order (issue 26 item 7, fixed) had the same content
        "files_equal_but_header_order": bool(differ) and all(order.values()),
    }


def _poll(cond, ranks: Ranks, timeout: float = 300, interval: float = 0.0005) -> bool:
    """Busy-poll cond() (a checkpoint save of flux-tiny lasts tens of ms); False when the ranks ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if not ranks.alive():
            return cond()
        time.sleep(interval)
    return False


def _after_kill(ranks: Ranks, victim: int) -> dict:
    """What the surviving rank did on its own within 60 s, then both are gone."""
    other = 1 - victim
    t = time.monotonic()
    try:
        ranks.procs[other].wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    code = ranks.procs[other].poll()
    ranks.kill_all()
    text = ranks.text(other)
    return {
        "survivor_exit": code,
        "survivor_s": round(time.monotonic() - t, 2),
        "survivor_traceback": text[text.index("Traceback") :][-1500:] if "Traceback" in text else False,
        "survivor_error": next((l for l in text.splitlines() if "error:" in l), None),
    }


def _finish(run_file: Path, folder: Path, name: str) -> dict:
    ranks = Ranks(run_file, folder / name)
    codes = ranks.wait(600)
    if ranks.alive():
        ranks.kill_all()
    return {"resume_exit": codes, "resume_traceback": any("Traceback" in ranks.text(r) for r in range(2))}


def reference(
    folder: Path, stage: int, lora_ema: bool = False, mode: str | None = None, precision: str = "fp32"
) -> dict:
    """An uninterrupted run; also measures the moments the trials aim at (first step, save length)."""
    run = write_run(folder, stage, lora_ema, mode, precision)
    out = folder / "out"
    ranks = Ranks(run, folder / "ref")
    ck = out / "checkpoints" / f"step_{EVERY:08d}"
    _poll(lambda: logged_steps(out), ranks)
    first_step = time.monotonic() - ranks.started
    _poll(ck.is_dir, ranks)
    t = time.monotonic()
    _poll(lambda: (out / "checkpoints" / "latest").is_file(), ranks)
    save_ms = (time.monotonic() - t) * 1e3
    codes = ranks.wait(600)
    assert codes == [0, 0], ranks.text(0)[-3000:]
    export = "lora_ema.safetensors" if lora_ema else "export.safetensors"
    return {
        "losses": losses(out),
        "export": export,
        "export_sha256": sha256(out / export),
        "out": str(out),
        "files": final_files(out),
        "lora_ema": lora_ema,
        "mode": mode,
        "precision": precision,
        "first_step_s": round(first_step, 2),
        "save_ms": round(save_ms, 1),
        "wall_s": round(time.monotonic() - ranks.started, 1),
    }


def trial(kind: str, stage: int, folder: Path, rng: random.Random, ref: dict) -> dict:
    """One trial of `kind`; returns what happened and whether the resumed run equals the reference bit for bit."""
    run = write_run(folder, stage, ref["lora_ema"], ref.get("mode"), ref.get("precision", "fp32"))
    out = folder / "out"
    rec: dict = {
        "kind": kind,
        "stage": stage,
        "lora_ema": ref["lora_ema"],
        "mode": ref.get("mode"),
        "precision": ref.get("precision", "fp32"),
    }
    ranks = Ranks(run, folder / "cut")
    victim = 0 if kind == "export" else rng.randrange(2)
    rec["victim"] = victim
    if kind in ("step", "double", "sigterm", "lost-latest"):
        k = rng.randrange(1, STEPS)
        _poll(lambda: max(logged_steps(out), default=0) >= k, ranks, interval=0.005)
        rec["at"] = f"after step {max(logged_steps(out), default=0)} logged (aimed at {k})"
    elif kind == "save":
        c = rng.choice(range(EVERY, STEPS, EVERY))
        delay = rng.uniform(0.1, 35) / 1e3
        _poll((out / "checkpoints" / f"step_{c:08d}").is_dir, ranks)
        time.sleep(delay)
        latest = out / "checkpoints" / "latest"
        rec["at"] = (
            f"{delay * 1e3:.1f} ms after step_{c:08d}/ appeared; latest was "
            f"{latest.read_text() if latest.is_file() else None}"
        )
    elif kind == "startup":
        delay = rng.uniform(0.3, ref["first_step_s"])
        _poll(lambda: time.monotonic() - ranks.started >= delay or bool(logged_steps(out)), ranks, interval=0.005)
        if logged_steps(out):  # the first step came before the aim (a loaded machine varies): aim again, earlier
            ranks.kill_all()
            shutil.rmtree(folder)
            ref = {**ref, "first_step_s": delay}
            rec = trial(kind, stage, folder, rng, ref)
            rec["aims"] = rec.get("aims", 1) + 1
            return rec
        rec["at"] = f"{delay:.2f} s after start, before the first step"
    elif kind == "export":
        delay = rng.uniform(0, 1) / 1e3  # a flux-tiny export lasts 1-3 ms: later kills found it done
        # the LoRA writer's temp files are .NAME.tmp-PID or NAME.tmpXXXX (safetensors' own)
        _poll(
            lambda: (
                any(out.glob(f".{ref['export']}.tmp*"))
                or any(out.glob(f"{ref['export']}.tmp*"))
                or any(out.glob("*.tmp*"))
            ),
            ranks,
        )
        time.sleep(delay)
        rec["at"] = (
            f"{delay * 1e3:.1f} ms after the export's temp file appeared; export done: "
            f"{(out / ref['export']).is_file()}"
        )
    if kind == "sigterm":
        ranks.kill(victim, signal.SIGTERM)
        codes = ranks.wait(120)
        ranks.kill_all()
        text = ranks.text(0)
        rec.update(
            stop_exit=codes,
            stop_line=next((l for l in text.splitlines() if l.startswith("stopped:")), None),
            stop_traceback=any("Traceback" in ranks.text(r) for r in range(2)),
        )
    else:
        ranks.kill(victim)
        rec.update(_after_kill(ranks, victim))
    if kind == "lost-latest":
        latest = out / "checkpoints" / "latest"
        rec["lost_latest"] = latest.read_text() if latest.is_file() else None
        latest.unlink(missing_ok=True)
    if kind == "double":  # the resume is killed too, at a random moment of it
        ranks = Ranks(run, folder / "resume1")
        delay = rng.uniform(0.3, ref["first_step_s"] + 3)
        time.sleep(delay)
        second = rng.randrange(2)
        ranks.kill(second)
        rec["second_kill"] = (
            f"rank {second} {delay:.2f} s into the resume, {max(logged_steps(out), default=0)} steps logged"
        )
        rec["second"] = _after_kill(ranks, second)
    rec.update(_finish(run, folder, "resume"))
    got = losses(out) if (out / "metrics.jsonl").is_file() else []
    rec["losses_equal"] = got == ref["losses"]
    rec["export_equal"] = sha256(out / ref["export"]) == ref["export_sha256"]
    rec.update(compare_files(out, Path(ref["out"]), ref["files"]))
    same = rec["files_equal"] or rec["files_equal_but_header_order"]
    rec["ok"] = (
        rec["losses_equal"]
        and same
        and rec["resume_exit"] == [0, 0]
        and (kind != "sigterm" or (rec["stop_exit"] == [143, 143] and not rec["stop_traceback"]))
    )
    return rec


def main(argv=None) -> int:
    p = runner.parser(__doc__)
    p.add_argument("--stage", type=int, choices=(0, 2, 3), default=2, help="0: with --optimizer-mode of a ZeRO-0 mode")
    p.add_argument("--lora-ema", action="store_true", help="a LoRA with an EMA, exporting the EMA")
    p.add_argument("--optimizer-mode", default=None, help="a fluxzero optimizer mode (default: DeepSpeed's AdamW)")
    p.add_argument(
        "--precision",
        choices=("fp32", "fp16"),
        default="fp32",
        help="fp16: DeepSpeed's fp16 (a GPU, or a CPU whose DeepSpeed accelerator supports it)",
    )
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, cycled")
    p.add_argument("--seed", type=int, default=0)
    runner.add_out(p, None, "JSON file for the records")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder, removed at the end")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    kinds = args.kinds.split(",")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kill_trials_"))
    t0 = time.monotonic()
    ref = reference(work / "reference", args.stage, args.lora_ema, args.optimizer_mode, args.precision)
    print(f"reference: {ref['wall_s']} s, first step at {ref['first_step_s']} s, save {ref['save_ms']} ms", flush=True)
    records = []
    for i in range(args.trials):
        kind = kinds[i % len(kinds)]
        folder = work / f"trial{i:02d}_{kind}"
        rec = trial(kind, args.stage, folder, rng, ref)
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if rec["ok"] and "Traceback" not in json.dumps(rec):  # keep the logs of anything to look at
            shutil.rmtree(folder, ignore_errors=True)
    ok = sum(r["ok"] for r in records)
    byte_exact = sum(r["ok"] and r["files_equal"] for r in records)
    summary = {
        "stage": args.stage,
        "lora_ema": args.lora_ema,
        "optimizer_mode": args.optimizer_mode,
        "precision": args.precision,
        "trials": len(records),
        "bit_exact": ok,
        "every_file_byte_identical": byte_exact,
        "seed": args.seed,
        "reference": {k: v for k, v in ref.items() if k not in ("losses", "files")},
        "files_compared": len(ref["files"]),
        "wall_s": round(time.monotonic() - t0),
        "records": records,
    }
    what = "".join(f", {x}" for x in (args.optimizer_mode, args.precision if args.precision != "fp32" else None) if x)
    print(
        f"ZeRO-{args.stage}{' LoRA + EMA' if args.lora_ema else ''}{what}: {ok} of {len(records)} trials resumed "
        f"bit-exact, {byte_exact} with all {len(ref['files'])} final files of the same sha256 "
        f"({summary['wall_s']} s)",
        flush=True,
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))
    if not args.workdir and ok == len(records):
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
