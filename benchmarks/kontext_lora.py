"""A FLUX.1 Kontext LoRA through launch/train.py with the DeepSpeed config `gen-config --fit` writes, against
diffusers + PEFT on the same configuration, in one call.

    PYTHONPATH=. python3 benchmarks/kontext_lora.py --gpu h200                     # flux-kontext-dev, 512 px, rank 16
    PYTHONPATH=. python3 benchmarks/kontext_lora.py --device cpu --model flux-tiny-kontext --res 64 --txt 16 \\
        --gpu-memory 8 --warmup 1 --steps 2 --attn auto                              # CPU smoke test
    PYTHONPATH=. python3 benchmarks/kontext_lora.py --gpu h200 --zero-stage 2 --name kontext_lora_z2  # --fit at ZeRO-2
    FLUXZERO_DEEPSPEED_LOOPS=1 PYTHONPATH=. python3 benchmarks/kontext_lora.py --gpu h200 --no-baseline \
        --name kontext_lora_loops                   # DeepSpeed's own per-tensor update (the before), no peer

1. `fluxzero gen-config --fit` for the model, resolution and LoRA rank on one GPU of --gpu (the memory model counts
   the reference's tokens: 512 px is 1024 target + 1024 reference image tokens).
2. fluxzero: launch/train.py on that JSON (sweep.run_file's run file: synthetic Kontext pairs of the size, random
   weights, the LoRA on `attention+mlp`), the median samples/s of the timed steps and the peak memory allocated,
   from its metrics.jsonl; its process group is killed once the last timed step is logged (the final checkpoint
   is no part of the speed).
3. diffusers + PEFT, as diffusers' Kontext LoRA example trains (a fresh process): FluxTransformer2DModel in bf16,
   frozen, PEFT LoRA of the same rank and alpha on diffusers' names of the same layers (to_q/k/v, to_out.0,
   add_q/k/v_proj, to_add_out, ff and ff_context, and proj_mlp / proj_out of the single blocks), adapters in fp32
   under bf16 autocast (accelerate's mixed precision), torch AdamW (fused on CUDA), diffusers' gradient
   checkpointing where the JSON checkpoints, block.compile() where it compiles; the same micro batch, fed the same
   loader and flow.prepare_batch (reference tokens after the target's, loss over the target's). Timed per step
   with a device sync; peak from torch.cuda.max_memory_allocated.

Writes $OUT/<name>.json with both sides and fluxzero / baseline; exit 0 when both measured (fluxzero with
--no-baseline), 2 otherwise.
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import runner  # noqa: E402 - needs the line above
import sweep  # noqa: E402

# diffusers' module names of fluxzero's `attention+mlp` targets (fluxzero.config.lora), as one regular expression
# PEFT matches against whole module names (a list would also take the final layer's proj_out)
_SUFFIXES = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
    "proj_mlp",
]
DIFFUSERS_TARGETS = (
    r".*\.(" + "|".join(x.replace(".", r"\.") for x in _SUFFIXES) + r")"
    r"|single_transformer_blocks\.\d+\.proj_out"
)


def fit_config(a, path: Path) -> None:
    """gen-config --fit's JSON for the run, written to `path` (SystemExit with its message when nothing fits)."""
    cmd = [
        sys.executable,
        "-m",
        "fluxzero.cli",
        "gen-config",
        "--fit",
        "--model",
        a.model,
        "--resolution",
        str(a.res),
        "--lora-rank",
        str(a.rank),
        "--world-size",
        "1",
        "-o",
        str(path),
        *(["--gpu", a.gpu] if a.gpu else ["--gpu-memory", str(a.gpu_memory)]),
        *(["--zero-stage", str(a.zero_stage)] if a.zero_stage is not None else []),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT), env=_env(a.device))
    if p.returncode:
        raise SystemExit(f"gen-config --fit failed: {(p.stderr or p.stdout).strip()[-500:]}")
    print(p.stdout.strip()[-800:], flush=True)


def _env(device: str) -> dict:
    env = {
        **os.environ,
        "FLUXZERO_NO_PROGRESS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    return env


def _rows(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return rows


def run_trainer(case: sweep.Case, device: str, work: Path, timeout: float) -> dict:
    """launch/train.py on the case (one process, one GPU); the timed steps' median samples/s and peak memory."""
    ds_path, run_path, out = work / "ds.json", work / "run.yaml", work / "run"
    ds_path.write_text(json.dumps(sweep.deepspeed_config(case, 1), indent=1))
    run_path.write_text(json.dumps(sweep.run_file(case, 1, ds_path, out), indent=1))  # JSON is YAML
    total, t0 = case.warmup + case.steps, time.monotonic()
    with open(work / "trainer.log", "w") as log:
        p = runner.start(
            [sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(run_path)], log=log, env=_env(device)
        )
        while p.poll() is None and time.monotonic() - t0 < timeout and len(_rows(out / "metrics.jsonl")) < total:
            time.sleep(0.5)
        if p.poll() is None:
            runner.kill_group(p)
        p.wait()
    rows = _rows(out / "metrics.jsonl")
    rec = {"run_file": json.loads(run_path.read_text()), "wall_s": time.monotonic() - t0, "steps_logged": len(rows)}
    timed = [r["samples_per_s"] for r in rows if r["step"] > case.warmup]
    if len(rows) < total or not timed:
        return {
            **rec,
            "status": f"{len(rows)} of {total} steps logged",
            "log_tail": runner.log_tail(work / "trainer.log", 1500),
        }
    return {
        **rec,
        "status": "ok",
        "samples_per_s": statistics.median(timed),
        "samples_per_s_all": timed,
        "peak_memory_gb": max(r["peak_memory_gb"] for r in rows),
        "losses": [r["loss"] for r in rows],
    }


def baseline(case: sweep.Case, device: str) -> dict:
    """diffusers + PEFT on the case (see the module docstring); {"samples_per_s", "peak_memory_gb", ...}."""
    import torch
    from baseline_diffusers import diffusers_config
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    from fluxzero.config import FlowConfig, get_model_config
    from fluxzero.data import build_dataloader
    from fluxzero.train import flow

    dev = torch.device(device)
    m = get_model_config(case.model)
    ds = sweep.deepspeed_config(case, 1)
    bf16 = ds.get("bf16", {}).get("enabled", False)
    torch.manual_seed(0)
    with dev:
        model = FluxTransformer2DModel.from_config(diffusers_config(m)).to(torch.bfloat16 if bf16 else torch.float32)
    model.requires_grad_(False)
    if case.ckpt:
        model.enable_gradient_checkpointing()
    rank = case.lora["rank"]
    model.add_adapter(
        LoraConfig(
            r=rank,
            lora_alpha=case.lora.get("alpha", rank),
            init_lora_weights="gaussian",
            target_modules=DIFFUSERS_TARGETS,
        )
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:  # diffusers' examples: cast_training_params(..., torch.float32)
        p.data = p.data.float()
    if case.compile:
        for block in list(model.transformer_blocks) + list(model.single_transformer_blocks):
            block.compile()
    opt = torch.optim.AdamW(trainable, lr=1e-4, fused=dev.type == "cuda")
    loader = build_dataloader(sweep.data_source(case, 1), micro_batch=case.mb, rank=0, world_size=1, seed=0)
    model.train()
    times, step = [], 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for epoch in range(10**6):
        loader.set_epoch(epoch)
        for batch in loader:
            if step == case.warmup + case.steps:
                break
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            inputs, target = flow.prepare_batch(
                batch,
                FlowConfig(),
                0,
                epoch,
                guidance_embed=m.guidance_embed,
                device=dev,
                dtype=torch.bfloat16 if bf16 else torch.float32,
            )
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                pred = model(
                    hidden_states=inputs["img"],
                    encoder_hidden_states=inputs["txt"],
                    pooled_projections=inputs["y"],
                    timestep=inputs["timesteps"],
                    img_ids=inputs["img_ids"][0],
                    txt_ids=inputs["txt_ids"][0],
                    guidance=inputs["guidance"],
                    return_dict=False,
                )[0]
            loss = flow.loss(pred, target)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            step += 1
            if step > case.warmup:
                times.append(time.perf_counter() - t0)
        else:
            continue
        break
    peak = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None
    return {
        "status": "ok",
        "samples_per_s": case.mb / statistics.median(times),
        "step_s_all": times,
        "peak_memory_gb": peak,
        "trained_params": sum(p.numel() for p in trainable),
        "final_loss": loss.item(),
        "api": "diffusers FluxTransformer2DModel + PEFT add_adapter, torch AdamW, bf16 autocast",
    }


def run_baseline(a, case: sweep.Case) -> dict:
    """diffusers + PEFT on the same case, in a process of its own; a row with a status either way."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--device",
        a.device,
        "--baseline-case",
        json.dumps(dataclasses.asdict(case)),
    ]
    try:  # a baseline that runs out of time is a row of its own: the trainer's figures are kept either way
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT), timeout=a.timeout, env=_env(a.device))
        line = next((x for x in p.stdout.splitlines() if x.startswith("BASELINE ")), None)
        theirs = (
            json.loads(line[9:])
            if line
            else {"status": f"failed (exit {p.returncode})", "log_tail": p.stderr.strip().splitlines()[-8:]}
        )
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        theirs = {"status": f"timed out after {a.timeout} s", "log_tail": err.strip().splitlines()[-8:]}
    return theirs


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out", help="folder for <name>.json")
    p.add_argument("--name", default="kontext_lora", help="file stem of the results")
    p.add_argument("--model", default="flux-kontext-dev")
    p.add_argument("--res", type=int, default=512, help="target (and reference) side in pixels")
    p.add_argument("--txt", type=int, default=512, help="T5 tokens")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = rank)")
    p.add_argument("--gpu", default="h200", help="gen-config --fit's --gpu (empty: use --gpu-memory)")
    p.add_argument("--gpu-memory", type=float, default=None, help="GiB, for --fit instead of --gpu")
    p.add_argument(
        "--zero-stage", type=int, choices=(0, 1, 2, 3), help="pin --fit's ZeRO stage (default: the one --fit chooses)"
    )
    p.add_argument("--attn", default="flash")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (a compiled run compiles in the first)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--timeout", type=int, default=500, help="seconds for the trainer, start-up included")
    p.add_argument("--no-baseline", action="store_true", help="measure fluxzero alone (a second trainer row)")
    p.add_argument("--baseline-case", help=argparse.SUPPRESS)  # the baseline's own process
    a = p.parse_args(argv)
    if a.gpu_memory is not None:
        a.gpu = ""
    return a


def main(argv=None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.baseline_case:
        print("BASELINE " + json.dumps(baseline(sweep.Case(**json.loads(a.baseline_case)), a.device)), flush=True)
        return 0
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ds_path = out_dir / f"{a.name}_fit.json"
    fit_config(a, ds_path)
    case = sweep.Case(
        model=a.model,
        res=a.res,
        txt=a.txt,
        attn=a.attn,
        warmup=a.warmup,
        steps=a.steps,
        timeout=a.timeout,
        min_s=0,
        lora={"rank": a.rank, "alpha": a.rank, "targets": "attention+mlp"},
    )
    case = sweep.with_ds_json(case, str(ds_path), a.device)
    with tempfile.TemporaryDirectory(prefix="fz-kontext-lora-") as tmp:
        print(f"fluxzero: launch/train.py, {case.name}, {case.warmup} + {case.steps} steps", flush=True)
        ours = run_trainer(case, a.device, Path(tmp), a.timeout)
    speed = f", {ours['samples_per_s']:.3f} samples/s" if ours.get("samples_per_s") else ""
    print(f"fluxzero: {ours['status']} [{ours['wall_s']:.0f} s]{speed}", flush=True)
    theirs = {"status": "not run (--no-baseline)"} if a.no_baseline else run_baseline(a, case)
    print(f"diffusers + PEFT: {theirs['status']}", flush=True)
    result = {
        "case": dataclasses.asdict(case),
        "name": case.name,
        **runner.provenance_fields("torch", "deepspeed", "diffusers", "peft"),
        "fit_json": json.loads(ds_path.read_text()),
        "fluxzero": ours,
        "baseline": theirs,
        "deepspeed_loops": bool(os.environ.get("FLUXZERO_DEEPSPEED_LOOPS")),  # the before of the batched update
    }
    code = 0 if ours["status"] == "ok" and a.no_baseline else 2
    if ours["status"] == "ok" and theirs["status"] == "ok":
        result["speedup"] = ours["samples_per_s"] / theirs["samples_per_s"]
        code = 0
        mem = lambda r: "n/a" if r.get("peak_memory_gb") is None else f"{r['peak_memory_gb']:.1f} GB"  # noqa: E731
        print(
            f"{case.name}: fluxzero {ours['samples_per_s']:.3f} samples/s, peak {mem(ours)}; diffusers + PEFT "
            f"{theirs['samples_per_s']:.3f} samples/s, peak {mem(theirs)}; fluxzero / baseline = "
            f"{result['speedup']:.2f}x"
        )
    path = out_dir / f"{a.name}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
