"""Training-speed sweep: the trainer's own train step and loader (and the diffusers + DeepSpeed baseline).

    PYTHONPATH=. python3 benchmarks/sweep.py --set lite1            # named set (see SETS / --list)
    PYTHONPATH=. python3 benchmarks/sweep.py --model flux-dev-lite --zero 0,3 --mb 1,4 --res 512
    PYTHONPATH=. python3 benchmarks/sweep.py --set cpu-test --device cpu   # the same code path on CPU

Every configuration ("case") runs in its own `torch.distributed.run` process group with its own timeout,
so an OOM or a hang costs one row, not the sweep. Each row is appended to $OUT/<set>.jsonl (or
--out) as soon as it is measured, and a one-line summary is printed, so a sweep cut short still returns
data. benchmarks/report.py turns the JSON lines into a markdown table and a plot.

A fluxzero step IS the trainer's: `fluxzero.train.loop.setup(cfg, rank, world, device)` builds what
`train()` runs (the DeepSpeed config view, the trainer's data loader, the engine with checkpointing / compile
applied by fluxzero.train.engine, and `run.step`, the public TrainStep), from a run file (TrainConfig, see
run_file) and the case's DeepSpeed JSON written by fluxzero.config.deepspeed.build.build; the sweep times
`run.step()`. Data comes through the trainer's loader: a synthetic source of the case's sizes, or a shard
folder (--data, Case.data). The one difference from train(): a non-finite loss is recorded (the row becomes
INVALID) instead of stopping the case. Rows say engine_api = "fluxzero.train.loop.setup + TrainStep" (rows of
the older hand-written step say otherwise). The diffusers baseline keeps its own step (it is the baseline:
diffusers + DeepSpeed as users write it), fed by the same loader and flow.prepare_batch.

Measurement: `warmup` steps, then `steps` timed steps, each from a synchronised start to a synchronised
end (torch.cuda.synchronize); the row reports the median. Within a step, CUDA events recorded by TrainStep's
on_phase hook (no sync inside a step) split the time into data (next(loader) + prepare_batch + host-to-device copy),
forward (incl. loss), backward (incl. the loss reduction over ranks, one host sync), optimizer step.
FLOPs: ModelConfig.flops_per_sample(img_tokens, txt_tokens) is the forward cost of one sample (every
linear layer on its real tokens, attention's two matmuls, per-sample modulation once). Training costs
ModelConfig.train_flops_per_sample: 3x that (backward = 2x forward), and for a LoRA 2x on the frozen linears (no
weight gradient) with attention still 3x (rows before 2026-12-05 counted 3x for a LoRA too);
recomputation by activation checkpointing is NOT counted, so MFU is "useful" work: MFU = training FLOPs *
micro_batch / step_time / peak, per GPU, with peak the bf16 dense matmul rate (8192^3, median of 20) measured
once at the start of the same sweep.
A row whose engine skipped steps (overflow / non-finite gradients) or whose loss or gradient norm went
non-finite is marked invalid: its speed is not a training speed.
--profile adds one step under torch.profiler per case (row "profile": GPU time by kernel category).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # runner, provenance, baseline_diffusers; also when this file is loaded by path

import provenance  # noqa: E402 - needs the line above
import runner  # noqa: E402

GIB = 1024**3
OPTIMS = ("torch-fused", "torch", "deepspeed-fused")
IMPLS = ("fluxzero", "diffusers")
ATTENTION = ("flash", "auto", "cudnn", "efficient", "math")


# ---------------------------------------------------------------------------------------------------------
# Cases and named sets
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Case:
    """One measured configuration. `gpus` is the number of ranks (processes on --device cpu)."""

    impl: str = "fluxzero"
    model: str = "flux-dev-lite"
    gpus: int = 1
    zero: int = 0
    precision: str = "bf16"
    ckpt: int = 1  # checkpoint every k-th block; 0 = off
    mb: int = 1  # micro batch per GPU
    res: int = 512  # image side in pixels: latent res/8, packed image tokens (res/16)^2
    txt: int = 512  # T5 tokens
    attn: str = "flash"
    optim: str = "torch-fused"
    zero_opts: dict = field(default_factory=dict)  # extra fluxzero.config.deepspeed.build options, e.g. stage-3 buckets
    env: dict = field(default_factory=dict)  # extra environment, e.g. PYTORCH_CUDA_ALLOC_CONF
    warmup: int = 2
    steps: int = 5
    timeout: int = 120  # seconds for the whole case, start-up included
    min_s: int = 25  # a case is started only while at least this much of the sweep budget is left
    inject_oom: str = ""  # tests only: raise an OOM in this phase on rank 0
    inject_nan: bool = False  # tests only: a NaN loss in the first timed step (its gradients are non-finite)
    profile: bool = False  # one extra step under torch.profiler: where the time goes (row["profile"])
    compile: bool = False  # torch.compile of the transformer blocks (fluxzero.compile, inductor, mode default)
    # ZeRO-3: the blocks as DeepSpeed leaf modules (zero_optimization.leaf_module), each gathered whole by one
    # hook; compiled rows get it from the trainer anyway (engine.zero3_leaf_blocks)
    z3_leaf: bool = False
    # the trainer's data: "" = a synthetic source of the case's sizes (see data_source), or a shard folder made
    # by `fluxzero cache` / fluxzero.data.ShardWriter (res and txt then come from the shards)
    data: str = ""
    workers: int | None = 0  # the loader's worker processes (run-file num_workers; None: the trainer's choice)
    lora: dict = field(default_factory=dict)  # the run file's lora: section (the baseline: PEFT's); {} = full fine-tune
    # a DeepSpeed JSON written by `fluxzero gen-config` (or --fit), used as it is instead of the case's own; its
    # micro batch, stage and checkpointing must be the case's (main() reads them from it for --ds-json)
    ds_json: str = ""

    def __post_init__(self):
        problems = []
        if self.impl not in IMPLS:
            problems.append(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if self.optim not in OPTIMS:
            problems.append(f"optim must be one of {OPTIMS}, got {self.optim!r}")
        if self.attn not in ATTENTION:
            problems.append(f"attn must be one of {ATTENTION}, got {self.attn!r}")
        if self.precision not in ("bf16", "fp16", "fp32"):
            problems.append(f"precision must be bf16, fp16 or fp32, got {self.precision!r}")
        if self.zero not in (0, 1, 2, 3):
            problems.append(f"zero must be 0-3, got {self.zero}")
        if self.res % 16:
            problems.append(f"res must be a multiple of 16 pixels (8x VAE, 2x2 packing), got {self.res}")
        if self.z3_leaf and self.zero != 3:
            problems.append("z3_leaf needs zero 3")
        if min(self.gpus, self.mb, self.txt, self.steps) < 1 or min(self.ckpt, self.warmup, self.workers or 0) < 0:
            problems.append("gpus, mb, txt, steps must be >= 1 and ckpt, warmup, workers >= 0")
        if (
            self.lora
            and self.impl == "diffusers"
            and (set(self.lora) - {"rank", "targets"} or self.lora.get("targets", "all-linear") != "all-linear")
        ):
            problems.append("lora: the baseline's PEFT adapters take a rank on all-linear targets only")
        if self.inject_oom and self.inject_oom not in PHASE_NAMES.values():
            problems.append(f"inject_oom must be one of {sorted(PHASE_NAMES.values())}, got {self.inject_oom!r}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def latent(self) -> int:
        return self.res // 8

    @property
    def img_tokens(self) -> int:
        return (self.res // 16) ** 2

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the case: warm-up, timed, and the profiled one."""
        return self.warmup + self.steps + int(self.profile)

    @property
    def name(self) -> str:
        short = {"fluxzero": "fz", "diffusers": "diffusers"}[self.impl]
        model = self.model.replace("flux-", "")
        parts = [
            short,
            model,
            f"z{self.zero}",
            self.precision,
            f"ck{self.ckpt}",
            f"mb{self.mb}",
            f"{self.res}px",
            self.attn,
            f"{self.gpus}g",
        ]
        if self.optim != "torch-fused":
            parts.append(self.optim)
        parts += [f"{_SHORT.get(k, k)}={_num(v)}" for k, v in sorted(self.zero_opts.items())]
        parts += [f"{k}={v}" for k, v in sorted(self.env.items())]
        if self.inject_oom:
            parts.append(f"inject-oom@{self.inject_oom}")
        if self.inject_nan:
            parts.append("inject-nan")
        if self.profile:
            parts.append("profiled")
        if self.z3_leaf:
            parts.append("leaf-blocks")
        if self.compile:
            parts.append("compiled")
        if self.data:
            parts.append(f"data={Path(self.data).name or self.data}")
        if self.workers != 0:
            parts.append(f"workers={'auto' if self.workers is None else self.workers}")
        if self.lora:
            parts.append(f"lora{self.lora.get('rank')}")
        if self.ds_json:
            parts.append(f"ds={Path(self.ds_json).name}")
        return " ".join(parts)


_SHORT = {
    "stage3_prefetch_bucket_size": "prefetch",
    "stage3_param_persistence_threshold": "persist",
    "reduce_bucket_size": "reduce",
    "allgather_bucket_size": "allgather",
    "stage3_max_live_parameters": "live",
    "stage3_max_reuse_distance": "reuse",
}


def _num(v) -> str:
    return f"{v:.0e}".replace("e+0", "e") if isinstance(v, int) and not isinstance(v, bool) and v >= 100_000 else str(v)


def _cases(base: dict, rows: list[dict]) -> list[Case]:
    return [Case(**{**base, **r}) for r in rows]


def _lite1() -> list[Case]:
    # one H200, flux-dev-lite (3.18B): ~15-25 s a case (start-up dominates), 15 cases
    b = dict(model="flux-dev-lite", gpus=1, precision="bf16", attn="flash", warmup=2, steps=5, timeout=90)
    sizes = [dict(mb=1, res=512), dict(mb=4, res=512), dict(mb=8, res=512), dict(mb=2, res=1024)]
    return (
        _cases({**b, "zero": 0, "ckpt": 1}, sizes)
        + _cases(
            b,
            [
                dict(impl="diffusers", zero=0, ckpt=1, mb=8, res=512),
                dict(impl="diffusers", zero=3, ckpt=1, mb=4, res=512),
            ],
        )
        + _cases({**b, "zero": 0, "ckpt": 0}, sizes)
        + _cases({**b, "zero": 3, "ckpt": 1}, sizes)
        + _cases(b, [dict(zero=0, ckpt=1, mb=8, res=512, attn="cudnn")])
    )


def _dev2() -> list[Case]:
    # two H200s, flux-dev (11.9B) under ZeRO-3: ~45-75 s a case (12B init + 5 steps of 2-7 s)
    b = dict(
        model="flux-dev",
        gpus=2,
        zero=3,
        precision="bf16",
        ckpt=1,
        attn="flash",
        warmup=2,
        steps=3,
        timeout=150,
        min_s=60,
    )
    return _cases(
        b,
        [
            dict(mb=16, res=512),
            dict(mb=8, res=1024),
            dict(impl="diffusers", mb=16, res=512),
            dict(mb=4, res=512),
            dict(impl="diffusers", mb=4, res=512),
            dict(mb=4, res=1024),
            dict(mb=1, res=512),
            # expected to run out of memory (12B bf16 weights + grads replicated): shows why ZeRO-3
            dict(zero=2, mb=1, res=512, timeout=120),
        ],
    )


def _dev2_extra() -> list[Case]:
    # two H200s, flux-dev ZeRO-3 levers past dev2: larger micro batch, larger ZeRO-3 buckets / persistence
    # (what the baseline needed at 1024 px), cuDNN attention
    b = dict(
        model="flux-dev",
        gpus=2,
        zero=3,
        precision="bf16",
        ckpt=1,
        attn="flash",
        warmup=2,
        steps=3,
        timeout=170,
        min_s=60,
    )
    big = dict(
        stage3_prefetch_bucket_size=200_000_000,
        stage3_param_persistence_threshold=1_000_000,
        reduce_bucket_size=200_000_000,
    )
    return _cases(
        b,
        [
            dict(mb=32, res=512),
            dict(mb=16, res=512, zero_opts=big),
            dict(mb=8, res=1024, zero_opts=big),
            dict(mb=16, res=512, attn="cudnn"),
        ],
    )


def _scale() -> list[Case]:
    # flux-dev-lite, 1 vs 2 GPUs at the same per-GPU micro batch
    b = dict(
        model="flux-dev-lite", precision="bf16", attn="flash", ckpt=1, mb=8, res=512, warmup=2, steps=5, timeout=90
    )
    return _cases(b, [dict(zero=z, gpus=g) for z in (0, 2, 3) for g in (1, 2)])


def _levers() -> list[Case]:
    # one H200, flux-dev-lite ZeRO-0 mb 8 512 px: one lever changed per row against the first row
    b = dict(
        model="flux-dev-lite",
        gpus=1,
        zero=0,
        precision="bf16",
        ckpt=1,
        mb=8,
        res=512,
        attn="flash",
        warmup=2,
        steps=5,
        timeout=90,
    )
    return _cases(
        b,
        [
            {},
            dict(attn="cudnn"),
            dict(attn="auto"),
            dict(optim="torch"),
            dict(ckpt=2),
            dict(ckpt=3),
            dict(env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
            dict(optim="deepspeed-fused", timeout=180),  # JIT build of FusedAdam (~62 s) the first time
        ],
    )


def _levers2() -> list[Case]:
    # one H200, torch.compile of the blocks, each compiled row right after its eager twin (same run, same
    # batches: losses_rank0 of the two should agree to bf16 noise). Warm-up 3: the first step compiles
    # (inductor, ~1 min on the host CPU), a recompile in step 2 would still land before the timed steps;
    # warmup_s_all holds those step times and compile_graphs / compile_graph_breaks what Dynamo made.
    b = dict(
        model="flux-dev-lite", gpus=1, precision="bf16", mb=8, res=512, attn="flash", warmup=3, steps=5, timeout=90
    )
    c = dict(compile=True, timeout=200, min_s=90)
    return _cases(
        b,
        [
            dict(zero=0, ckpt=1),
            dict(zero=0, ckpt=1, **c),
            dict(zero=0, ckpt=0),
            dict(zero=0, ckpt=0, **c),
            # ZeRO-3: compiled blocks are also made ZeRO-3 leaf modules (gathered whole); the middle row separates that
            # change from the compilation
            dict(zero=3, ckpt=1),
            dict(zero=3, ckpt=1, z3_leaf=True),
            dict(zero=3, ckpt=1, **c),
            # the baseline eager and with block.compile() on every diffusers block, against the ZeRO-0 ck1 pair
            dict(impl="diffusers", zero=0, ckpt=1),
            dict(impl="diffusers", zero=0, ckpt=1, **c),
        ],
    )


def _cpu(gpus=1, **kw) -> dict:
    return {
        **dict(
            model="flux-tiny", gpus=gpus, precision="bf16", res=64, txt=16, attn="auto", warmup=1, steps=2, timeout=120
        ),
        **kw,
    }


def _cpu_test() -> list[Case]:
    # --device cpu: the GPU sets' code path on flux-tiny (tests/benchmarks/test_benchmarks.py)
    return [
        Case(**_cpu(gpus=2, zero=3, ckpt=1, mb=2)),
        Case(**_cpu(gpus=2, impl="diffusers", zero=3, ckpt=1, mb=2)),
        # ZeRO-2, every other block checkpointed, and non-finite gradients in one step: DeepSpeed skips that
        # step, so the row is measured but INVALID
        Case(**_cpu(zero=2, ckpt=2, mb=1, inject_nan=True)),
        # an OOM on rank 0 while rank 1 waits in the gradient all-reduce: the row must say "OOM at backward"
        # and the sweep must go on after the hung rank is ended
        Case(**_cpu(gpus=2, zero=0, ckpt=0, mb=1, inject_oom="backward")),
    ]


SETS = {
    "lite1": (_lite1, 350, "1 GPU, flux-dev-lite: ZeRO-0/3 x ckpt on/off x mb 1/4/8 @512 + mb 2 @1024, baseline x2"),
    "dev2": (_dev2, 520, "2 GPUs, flux-dev ZeRO-3: 512 mb 1/4/16, 1024 mb 4/8, baseline mb 4/16, ZeRO-2 OOM"),
    "dev2-extra": (_dev2_extra, 520, "2 GPUs, flux-dev ZeRO-3: mb 32, larger stage-3 buckets, cuDNN attention"),
    "scale": (_scale, 240, "1 vs 2 GPUs, flux-dev-lite mb 8 @512, ZeRO-0/2/3"),
    "levers": (_levers, 330, "1 GPU, flux-dev-lite ZeRO-0 mb 8: attention, optimizer, ckpt every k, allocator"),
    "levers2": (
        _levers2,
        480,
        "1 GPU, flux-dev-lite mb 8 @512: eager vs torch.compile'd blocks, ZeRO-0 ck1/ck0, "
        "ZeRO-3 ck1 (and leaf blocks eager), the baseline eager vs block.compile()",
    ),
    "cpu-test": (_cpu_test, 400, "--device cpu, flux-tiny: the same code path, for tests"),
}


# ---------------------------------------------------------------------------------------------------------
# Worker: one case, inside torch.distributed.run
# ---------------------------------------------------------------------------------------------------------
class _Phase:
    """Where the worker is, for 'OOM at <phase>' and 'timeout at <phase>' rows."""

    def __init__(self, rowdir: Path, rank: int):
        self.rowdir, self.rank, self.name, self.persist = rowdir, rank, "start", True

    def __call__(self, name: str):
        self.name = name
        if self.persist:  # not during timed steps: a file write there would be measured
            (self.rowdir / f"phase{self.rank}").write_text(name)


def _is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


Z3_LEAF_CLASSES = ["fluxzero.model.layers.DoubleStreamBlock", "fluxzero.model.layers.SingleStreamBlock"]
DS_CONFIG_SOURCE = "fluxzero.config.deepspeed.build"
ENGINE_API = "fluxzero.train.loop.setup + TrainStep"
BASELINE_API = "deepspeed.initialize (diffusers FluxTransformer2DModel, as users wrap it)"


def deepspeed_config(case: Case, world: int) -> dict:
    """The case's DeepSpeed config, written by fluxzero's generator (`fluxzero gen-config`'s builder), or the
    gen-config JSON the case names (then its batch, stage and checkpointing must be the case's)."""
    if case.ds_json:
        ds = json.loads(Path(case.ds_json).read_text())
        got = (ds["train_micro_batch_size_per_gpu"], ds.get("zero_optimization", {}).get("stage", 0))
        if got != (case.mb, case.zero):
            raise ValueError(
                f"{case.ds_json} has micro batch {got[0]}, ZeRO-{got[1]}; the case says {case.mb}, ZeRO-{case.zero}"
            )
        return ds
    from fluxzero.config.deepspeed import build as gen

    adam = {"torch-fused": "torch", "torch": "torch", "deepspeed-fused": "fused"}[case.optim]
    opts = gen.options_from(
        model=case.model,
        micro_batch=case.mb,
        grad_accum=1,
        world_size=world,
        zero_stage=case.zero,
        precision=case.precision,
        checkpoint_every=case.ckpt,
        checkpoint_impl="torch",
        adam_impl=adam,
        gradient_clipping=1.0,
        scheduler="none",
        steps_per_print=10**9,
        compile=case.compile,
        **case.zero_opts,
    )
    ds = gen.build(opts)
    if case.z3_leaf:
        ds["zero_optimization"]["leaf_module"] = {"classes": Z3_LEAF_CLASSES}
    if case.optim == "torch-fused":
        # deepspeed 0.19.8 (engine.get_optimizer_configuration) passes every optimizer param left after
        # popping torch_adam to torch.optim.AdamW: "fused" reaches it and picks the fused CUDA kernel.
        ds["optimizer"]["params"]["fused"] = True
    elif case.optim == "torch":  # foreach AdamW: gen-config's --adam-impl torch writes "fused": true since 4a1f765
        ds["optimizer"]["params"].pop("fused", None)
    return ds


def with_ds_json(case: Case, path: str, device: str) -> Case:
    """The case timing the DeepSpeed JSON at `path` (gen-config's) as it is: its micro batch, stage,
    checkpointing and compile replace the case's."""
    ds = json.loads(Path(path).read_text())
    fz, stage = ds.get("fluxzero", {}), ds.get("zero_optimization", {}).get("stage", 0)
    return dataclasses.replace(
        case,
        ds_json=str(Path(path).resolve()),
        mb=ds["train_micro_batch_size_per_gpu"],
        zero=stage,
        ckpt=fz.get("activation_checkpointing", {}).get("every_k_blocks", 0),
        # absent: the trainer compiles the blocks on a GPU below ZeRO-3
        compile=fz.get("compile", {}).get("blocks", device == "cuda" and stage < 3),
    )


def data_source(case: Case, world: int) -> str:
    """The case's data: its shard folder, or a synthetic spec of the case's sizes with one epoch covering every
    step of the case (no epoch boundary among the timed steps)."""
    if case.data:
        return case.data
    from fluxzero.config import get_model_config

    m = get_model_config(case.model)
    n = case.mb * world * case.total_steps
    return (
        f"synthetic:n={n},hw={case.latent}x{case.latent},txt={case.txt},ctx={m.context_in_dim},"
        f"vec={m.vec_in_dim},ch={m.latent_channels}" + (",ref=1" if m.kontext else "")
    )  # Kontext: pairs


def run_file(case: Case, world: int, ds_path: str, output_dir: str) -> dict:
    """The run-file keys (TrainConfig) of the case: what `launch/train.py --config` would get for it.
    Batch sizes, precision, ZeRO, checkpointing and compile are the DeepSpeed JSON's."""
    return {
        "deepspeed": str(ds_path),
        "data": data_source(case, world),
        "output_dir": str(output_dir),
        "model": case.model,
        "steps": case.total_steps,
        "seed": 0,
        "attention": case.attn,
        "num_workers": case.workers,
        "log_every": 1,
        "checkpoint": {"resume": False},
        **({"lora": case.lora} if case.lora else {}),
        "export": {"format": None},
    }


class _Clock:
    """Phase marks of one step from TrainStep's on_phase hook: CUDA events on the device (no sync inside a
    step), perf_counter on CPU. The first mark of each name in a step counts (the sweep's grad_accum is 1)."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch
        self.marks: dict = {}

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def mark(self, name: str) -> None:
        if name in self.marks:
            return
        if self.cuda:
            e = self.torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks[name] = e
        else:
            self.marks[name] = time.perf_counter()

    def span(self, a: str, b: str) -> float:
        x, y = self.marks[a], self.marks[b]
        return x.elapsed_time(y) / 1e3 if self.cuda else y - x

    def spans(self) -> dict:
        """data: next(loader) + prepare_batch (noise, packing, host-to-device copy); fwd: forward + loss;
        bwd: backward, the loss reduction over ranks (one host sync) and the finite check; opt: engine.step."""
        return dict(
            data=self.span("data", "forward"),
            fwd=self.span("forward", "backward"),
            bwd=self.span("backward", "update"),
            opt=self.span("update", "end"),
        )


# on_phase names -> the names rows and timeouts use ("OOM at backward", "timeout ... at optimizer step")
PHASE_NAMES = {
    "data": "data",
    "forward": "forward",
    "backward": "backward",
    "update": "optimizer step",
    "end": "step end",
}


def _with_nan(source, at: int):
    """The loader's (epoch, batch) stream with NaN latents in batch `at` (tests: a non-finite step)."""
    for i, (epoch, batch) in enumerate(source):
        if i == at:
            batch = {**batch, "latents": batch["latents"] * float("nan")}
        yield epoch, batch


def _fluxzero_runner(case: Case, cfg, rank: int, world: int, device, hook):
    """The trainer's own run: loop.setup builds DeepSpeed config view, loader, engine and TrainStep exactly as
    train() does; the sweep times run.step()."""
    from fluxzero.train import loop

    run = loop.setup(cfg, rank, world, device)
    step = run.step
    step.on_phase = hook
    # The trainer raises at a non-finite loss (before the update); the sweep keeps measuring and marks the row
    # invalid from its recorded losses instead. A float compare either way: the timing does not change.
    step.before_update = None
    if case.inject_nan:
        step.source = _with_nan(step.source, case.warmup)
    return run.engine, step


def baseline_runner(case: Case, cfg, rank: int, world: int, device, hook):
    """The baseline keeps a step of its own (diffusers + DeepSpeed as users write it), fed as the trainer feeds
    its own: the trainer's loader with the trainer's worker count, flow.prepare_batch run ahead of the step by the
    trainer's prefetch thread (prefetch_batches), and the same phase marks. So the two differ in model, engine
    use and step alone, not in how the data arrives. The returned step has close() (the prefetch thread)."""
    import baseline_diffusers
    import torch
    from torch.nn.attention import sdpa_kernel

    from fluxzero.config import get_model_config
    from fluxzero.config.deepspeed.file import load_for_training
    from fluxzero.model.math import ATTENTION_BACKENDS
    from fluxzero.train import flow
    from fluxzero.train.loop import build_loader
    from fluxzero.train.step import StepResult, ahead, batches, prepared_batches

    model_cfg = get_model_config(cfg.model)
    ds, v = load_for_training(cfg.deepspeed, world)
    loader = build_loader(cfg, v.micro_batch, rank, world, device)
    engine = baseline_diffusers.build_engine(
        model_cfg, ds, v.checkpoint_every, device, seed=cfg.seed, compile=v.compile, lora_rank=case.lora.get("rank", 0)
    )
    dtype = getattr(torch, v.dtype_name)
    source = batches(loader)
    if case.inject_nan:
        source = _with_nan(source, case.warmup)
    allowed = ATTENTION_BACKENDS[cfg.attention]  # diffusers calls SDPA: restrict it as our model does
    prepared = ahead(
        lambda: prepared_batches(
            source, cfg.flow, seed=cfg.seed, guidance_embed=model_cfg.guidance_embed, device=device, dtype=dtype
        ),
        cfg.prefetch_batches,
        device,
    )

    def step() -> StepResult:
        lr = engine.get_lr()[0]
        hook("data")
        item = next(prepared)
        inputs, target = item.inputs, item.target
        hook("forward")
        with sdpa_kernel(allowed):
            loss = flow.loss(baseline_diffusers.forward(engine, inputs), target)
            hook("backward")
            engine.backward(loss)
        hook("update")
        engine.step()
        hook("end")
        norm = engine.get_global_grad_norm()
        return StepResult(
            loss=float(loss.detach()),
            lr=lr,
            grad_norm=None if norm is None else float(norm),
            skipped_steps=int(engine.skipped_steps),
            img_tokens=inputs["img"].shape[1],
            txt_tokens=inputs["txt"].shape[1],
        )

    step.close = getattr(prepared, "close", lambda: None)
    return engine, step


def run_case(case: Case, phase: _Phase) -> dict:
    import torch
    import torch.distributed as dist

    from fluxzero.config import TrainConfig, get_model_config
    from fluxzero.train import distributed

    phase("init distributed")
    t_start = time.perf_counter()
    rank, world, device = distributed.init_distributed()
    if world != case.gpus:
        raise RuntimeError(f"case wants {case.gpus} ranks but the process group has {world}")
    model_cfg = get_model_config(case.model)
    ds_path = phase.rowdir / "ds.json"  # written by the driver (run_one)
    cfg = TrainConfig(**run_file(case, world, ds_path, phase.rowdir / "run"))
    clock = _Clock(device)

    def hook(name: str) -> None:
        clock.mark(name)
        phase(PHASE_NAMES[name])
        if case.inject_oom and PHASE_NAMES[name] == case.inject_oom and rank == 0:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the benchmark test)")

    phase("model init")
    t0 = time.perf_counter()
    if case.impl == "fluxzero":
        engine, train_step = _fluxzero_runner(case, cfg, rank, world, device, hook)
        engine_api = ENGINE_API
    else:
        engine, train_step = baseline_runner(case, cfg, rank, world, device, hook)
        engine_api = BASELINE_API
    clock.sync()
    init_s = time.perf_counter() - t0
    mem_after_init = torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None
    skipped_before = int(getattr(engine, "skipped_steps", 0) or 0)
    optimizer = _describe_optimizer(engine)

    def step(timed: bool) -> dict:
        clock.marks = {}
        clock.sync()
        w0 = time.perf_counter()
        r = train_step()
        clock.sync()
        wall = time.perf_counter() - w0
        return dict(
            wall=wall,
            **clock.spans(),
            loss=r.loss,
            norm=r.grad_norm,
            timed=timed,
            img_tokens=r.img_tokens,
            txt_tokens=r.txt_tokens,
        )

    rows = []
    for i in range(case.warmup + case.steps):
        timed = i >= case.warmup
        # Every step's start goes to disk (before its clock starts); the phases inside a step only in the
        # first step (a hang there is common), so no file write lands inside a timed step.
        phase.persist = True
        phase(f"{'timed' if timed else 'warm-up'} step {i + 1}")
        phase.persist = i == 0
        rows.append(step(timed))
    profile = None
    if case.profile:  # one more step under torch.profiler, after (and not part of) the timed ones
        phase.persist = True
        phase("profiled step")
        phase.persist = False
        from contextlib import nullcontext

        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch_profile(activities=acts) if rank == 0 else nullcontext() as prof:
            r = step(timed=False)
        if rank == 0:
            try:
                profile = _profile_summary(prof, r["wall"])
            except Exception as e:  # noqa: BLE001 - a profile that cannot be read must not cost the row
                profile = {"error": f"{type(e).__name__}: {e}"[:300]}
    phase.persist = True
    phase("report")
    train_step.close()  # the prefetch thread: none left inside torch while the process tears down
    skipped = int(getattr(engine, "skipped_steps", 0) or 0) - skipped_before
    compiled = None
    if case.compile:
        from torch._dynamo.utils import counters

        compiled = {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}
    mine = {
        "rank": rank,
        "peak_alloc_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB if device.type == "cuda" else None,
        "alloc_after_init_gib": mem_after_init,
        "skipped_steps": skipped,
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["norm"] for r in rows],
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return {"rank": rank, "ok": True}

    timed = [r for r in rows if r["timed"]]
    med = {k: statistics.median(r[k] for r in timed) for k in ("wall", "data", "fwd", "bwd", "opt")}
    step_s = med["wall"]
    # tokens as the loader delivered them (shards: the bucket of the last timed step; synthetic: the case's)
    img_tokens, txt_tokens = timed[-1]["img_tokens"], timed[-1]["txt_tokens"]
    flops = model_cfg.flops_per_sample(img_tokens, txt_tokens)
    step_flops = model_cfg.train_flops_per_sample(img_tokens, txt_tokens, frozen_linears=bool(case.lora))
    losses = [x for m in everyone for x in m["losses"]]
    skipped_all = max(m["skipped_steps"] for m in everyone)
    norms = [x for m in everyone for x in m["grad_norms"] if x is not None]
    finite = all(math.isfinite(x) for x in losses + norms)
    peak = float(os.environ.get("FLUXZERO_BENCH_PEAK_TFLOPS", "0")) or None
    tflops = step_flops * case.mb / step_s / 1e12
    return {
        "rank": 0,
        "ok": True,
        "status": "ok"
        if finite and not skipped_all
        else ("skipped steps" if skipped_all else "non-finite loss or grad norm"),
        "valid": bool(finite and not skipped_all),
        "step_s": step_s,
        "step_s_all": [r["wall"] for r in timed],
        "data_s": med["data"],
        "fwd_s": med["fwd"],
        "bwd_s": med["bwd"],
        "opt_s": med["opt"],
        "samples_per_s": case.mb * world / step_s,
        "img_tokens": img_tokens,
        "txt_tokens": txt_tokens,
        "img_tokens_per_s": case.mb * world * img_tokens / step_s,
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_tflops": peak,
        "flops_per_sample_fwd": flops,
        "skipped_steps": skipped_all,
        "losses_rank0": everyone[0]["losses"],
        "grad_norms_rank0": everyone[0]["grad_norms"],
        "peak_alloc_gib": [m["peak_alloc_gib"] for m in everyone],
        "peak_reserved_gib": [m["peak_reserved_gib"] for m in everyone],
        "alloc_after_init_gib": [m["alloc_after_init_gib"] for m in everyone],
        "init_s": init_s,
        "case_s": time.perf_counter() - t_start,
        "engine_api": engine_api,
        "ds_config_source": DS_CONFIG_SOURCE,
        "ds_config": json.loads(ds_path.read_text()),
        "run_file": {k: v for k, v in cfg.to_dict().items() if k != "flow"},
        "data_source": cfg.data,
        "optimizer": optimizer,
        "profile": profile,
        "warmup_s_all": [r["wall"] for r in rows if not r["timed"]],
        "compile_graphs": compiled and compiled["graphs"],
        "compile_graph_breaks": compiled and compiled["graph_breaks"],
        "versions": _versions(case, device),
    }


# kernel name fragments -> category (first match wins; matched lower-case)
_KERNEL_CATEGORIES = (
    ("nccl all-gather", ("allgather", "all_gather")),
    ("nccl reduce-scatter", ("reducescatter", "reduce_scatter")),
    ("nccl all-reduce", ("allreduce", "all_reduce")),
    ("nccl other", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm100_")),
    ("optimizer / foreach", ("adam", "multi_tensor")),
    ("memcpy / memset", ("memcpy", "memset")),
)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _profile_summary(prof, wall: float) -> dict:
    """Where one step's time goes: GPU kernel time per category (sums; streams overlap), GPU busy time
    (union of all kernels) and compute-busy time (union of non-NCCL kernels), the top kernels.
    On CPU: the top operators by self CPU time."""
    from torch.autograd import DeviceType

    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not events:
        ops = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:10]
        return {"wall_s": wall, "top": [[a.key[:90], a.self_cpu_time_total / 1e6] for a in ops]}
    cats, kernels, spans, compute = {}, {}, [], []
    for e in events:
        start, end = e.time_range.start / 1e6, e.time_range.end / 1e6
        name = e.name.lower()
        cat = next((c for c, keys in _KERNEL_CATEGORIES if any(k in name for k in keys)), "other")
        cats[cat] = cats.get(cat, 0.0) + end - start
        kernels[e.name] = kernels.get(e.name, 0.0) + end - start
        spans.append((start, end))
        if not cat.startswith("nccl"):
            compute.append((start, end))
    busy, compute_busy = _union(spans), _union(compute)
    top = sorted(kernels.items(), key=lambda kv: kv[1], reverse=True)[:12]
    return {
        "wall_s": wall,
        "gpu_busy_s": busy,
        "compute_busy_s": compute_busy,
        "gpu_idle_s": max(0.0, wall - busy),
        "exposed_comm_s": busy - compute_busy,
        "kernel_s": cats,
        "kernels": len(events),
        "top": [[k[:90], v] for k, v in top],
    }


def _describe_optimizer(engine) -> str:
    """What actually steps: DeepSpeed's wrapper and the torch / DeepSpeed optimizer inside, with its flags."""
    outer = engine.optimizer
    inner = getattr(outer, "optimizer", outer)
    defaults = getattr(inner, "defaults", {}) or {}
    flags = ", ".join(f"{k}={defaults[k]}" for k in ("fused", "foreach") if k in defaults)
    return f"{type(outer).__name__} > {type(inner).__module__}.{type(inner).__name__}" + (
        f" ({flags})" if flags else ""
    )


def _versions(case: Case, device) -> dict:
    import deepspeed
    import torch

    v = {
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    if case.impl == "diffusers":
        import diffusers

        v["diffusers"] = diffusers.__version__
    return v


def _release() -> None:
    """The case ends: give up rank 0's lock on its output_dir (loop.setup took it), as train() does."""
    try:
        from fluxzero.train.checkpoint import locks

        locks.release_output_dir()
    except Exception:  # noqa: BLE001 - the process exits next; the kernel drops the lock then anyway
        pass


def worker_main(case_json: str, rowdir: str) -> int:
    rank = int(os.environ.get("RANK", "0"))
    from fluxzero.train import distributed

    distributed.quiet_other_ranks()  # as launch/train.py: before DeepSpeed's import, which already warns
    rowdir = Path(rowdir)
    phase = _Phase(rowdir, rank)
    case = Case(**json.loads(case_json))
    try:
        out = run_case(case, phase)
    except BaseException as e:  # noqa: BLE001 - every failure becomes this case's row
        msg = f"OOM at {phase.name}" if _is_oom(e) else f"{type(e).__name__} at {phase.name}: {str(e)[:300]}"
        (rowdir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "ok": False, "error": msg}))
        _release()
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # no process-group teardown: the other ranks may be stuck in a collective
    _release()
    (rowdir / f"rank{rank}.json").write_text(json.dumps(out))
    # The last collective is behind every rank: skip NCCL / DeepSpeed teardown, which can stall at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------------------
# Peak: bf16 dense matmul, once per sweep
# ---------------------------------------------------------------------------------------------------------
def peak_main(device: str) -> int:
    import torch

    n, reps = (8192, 20) if device == "cuda" else (512, 5)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = []
    for i in range(5 + reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if device == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            a @ b
            e.record()
            e.synchronize()
            dt = s.elapsed_time(e) / 1e3
        else:
            a @ b
            dt = time.perf_counter() - t0
        if i >= 5:
            times.append(dt)
    print(
        json.dumps(
            {
                "peak_tflops": 2 * n**3 / statistics.median(times) / 1e12,
                "n": n,
                "reps": reps,
                "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                "gpus": torch.cuda.device_count() if device == "cuda" else 0,
            }
        )
    )
    return 0


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------
def run_one(case: Case, device: str, timeout: float, log_path: Path, env: dict, grace: float) -> dict:
    """Launch one case under torch.distributed.run and turn whatever it left behind into a row."""
    rowdir = Path(tempfile.mkdtemp(prefix="fzbench-"))
    try:  # one DeepSpeed JSON for every rank, as a user's run has it
        (rowdir / "ds.json").write_text(json.dumps(deepspeed_config(case, case.gpus), indent=1))
    except ValueError as e:  # gen-config refuses the options (DSConfigError): a row, not a crash of the sweep
        shutil.rmtree(rowdir, ignore_errors=True)
        return {"status": f"DeepSpeed config refused: {e}"[:400], "valid": False, "wall_s": 0.0}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={case.gpus}",
        str(Path(__file__).resolve()),
        "--worker",
        json.dumps(dataclasses.asdict(case)),
        "--rowdir",
        str(rowdir),
    ]
    t0 = time.time()
    outcome = "exit"
    with open(log_path, "w") as log:
        proc = runner.start(cmd, log=log, env={**env, **case.env})
        first_error = finished = None
        while proc.poll() is None:
            time.sleep(0.25)
            now = time.time()
            written = [_read_json(p) for p in rowdir.glob("rank*.json")]
            if first_error is None and any("error" in r for r in written):
                first_error = now  # the other ranks are likely stuck in a collective: give them `grace`
            if finished is None and any("status" in r for r in written):
                finished = now  # rank 0 has the row: exiting must not cost more than `grace`
            if first_error is not None and now - first_error > grace:
                outcome = "killed after error"
                runner.kill_group(proc, term_s=5)
            elif finished is not None and now - finished > grace:
                outcome = "killed after its row"
                runner.kill_group(proc, term_s=5)
            elif now - t0 > timeout:
                outcome = "timeout"
                runner.kill_group(proc, term_s=5)
    wall = time.time() - t0
    ranks = {p.name: _read_json(p) for p in sorted(rowdir.glob("rank*.json"))}
    row = ranks.get("rank0.json", {})
    if not (row.get("ok") and "status" in row):  # rank 0 measured the case: its row stands
        errors = [r["error"] for r in ranks.values() if "error" in r]
        oom = [e for e in errors if e.startswith("OOM")]
        if oom or errors:
            status = (oom or errors)[0]
        elif outcome == "timeout":
            phases = sorted({(rowdir / f).read_text() for f in os.listdir(rowdir) if f.startswith("phase")})
            status = f"timeout after {timeout:.0f} s at {'/'.join(phases) or 'start-up'}"
        else:
            status = f"exit code {proc.returncode}: " + _tail(log_path)
        row = {"status": status, "valid": False}
    shutil.rmtree(rowdir, ignore_errors=True)  # the case's ds.json, per-rank rows and output_dir
    row["wall_s"] = wall
    return row


def _read_json(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def _tail(path: Path, n: int = 300) -> str:
    text = path.read_text(errors="replace").strip().splitlines()
    lines = [ln for ln in text if ln.strip() and not ln.startswith("[rank")][-3:]
    return " | ".join(lines)[-n:]


def _append_log(combined: Path, i: int, case: Case, row: dict, log: Path) -> None:
    lines = log.read_text(errors="replace").splitlines()
    keep = 40 if row.get("status") == "ok" else 150
    with open(combined, "a") as f:
        f.write(f"===== [{i}] {case.name}: {row.get('status')} (full log: {log})\n")
        f.write("\n".join(lines[-keep:]) + "\n")


def summary(i: int, n: int, case: Case, row: dict) -> str:
    head = f"[{i}/{n}] {case.name}:"
    if row.get("status") != "ok":
        extra = f" ({row['samples_per_s']:.2f} samples/s)" if "samples_per_s" in row else ""
        return f"{head} {'INVALID ' if 'samples_per_s' in row else ''}{row['status']}{extra} [{row['wall_s']:.0f} s]"
    mfu = f"MFU {100 * row['mfu']:.1f}%" if row.get("mfu") else f"{row['tflops_per_gpu']:.1f} TFLOP/s"
    mem = max(x or 0 for x in row["peak_alloc_gib"])
    res = max(x or 0 for x in row["peak_reserved_gib"])
    return (
        f"{head} {row['samples_per_s']:.2f} samples/s, {mfu}, step {row['step_s']:.3f} s "
        f"(data {row['data_s']:.3f} fwd {row['fwd_s']:.3f} bwd {row['bwd_s']:.3f} opt {row['opt_s']:.3f}), "
        f"peak {mem:.1f}/{res:.1f} GiB alloc/reserved [{row['wall_s']:.0f} s]"
    )


def _measure_peak(device: str, env: dict) -> dict:
    try:
        p = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--peak", "--device", device],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=str(ROOT),
        )
        return json.loads(p.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - a missing peak only leaves MFU empty
        return {"peak_tflops": None, "error": f"{type(e).__name__}: {e}"[:300]}


def sweep(
    name: str,
    cases: list[Case],
    out_dir: Path,
    device: str,
    budget: float,
    grace: float,
    peak_tflops: float | None = None,
    parallel: int = 1,
) -> list[dict]:
    """Run `cases` one after another (or `parallel` 1-GPU cases side by side, one GPU each)."""
    if parallel > 1 and any(c.gpus > 1 for c in cases):
        raise ValueError("--parallel runs 1-GPU cases side by side; this selection has multi-GPU cases")
    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / f"{name}.jsonl"
    # Whole per-case logs stay outside out_dir, which keeps few files; out_dir gets one <name>.log with
    # each case's tail (more of it when the case failed).
    logs = Path(tempfile.mkdtemp(prefix=f"fzbench-logs-{name}-"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    # FusedAdam (optim deepspeed-fused) is JIT-built once per machine, not once per case
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(tempfile.gettempdir()) / "fluxzero-torch-extensions"))
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # deprecation notes at every collective
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("DS_ACCELERATOR", "cpu")
    t_start = time.time()
    if peak_tflops is None:
        peak = _measure_peak(device, env)
        peak_tflops = peak.get("peak_tflops")
        print(f"bf16 matmul peak: {peak_tflops and round(peak_tflops, 1)} TFLOP/s {peak}", flush=True)
    else:
        peak = {"peak_tflops": peak_tflops, "given": True}
    env["FLUXZERO_BENCH_PEAK_TFLOPS"] = str(peak_tflops or 0)
    # seconds in the start time: report.py tells sweeps apart by set and start, and a rerun can start within a minute
    stamp = provenance.stamp()
    # every row, measured or not, records the code it ran (or would have run): "unknown" without git / .git
    code = provenance.code_version(ROOT)
    rows, pending, lock = [], list(enumerate(cases, 1)), threading.Lock()

    def lane(lane_env: dict):
        while True:
            with lock:
                if not pending:
                    return
                i, case = pending.pop(0)
            left = budget - (time.time() - t_start)
            if left < case.min_s:
                row = {"status": f"not run (sweep budget {budget:.0f} s spent)", "valid": False, "wall_s": 0.0}
                log = None
            else:
                log = logs / f"{i:02d}-{case.name.replace(' ', '_').replace('/', '-')}.log"
                row = run_one(case, device, min(case.timeout, left), log, {**env, **lane_env}, grace)
            row = {
                "set": name,
                "index": i,
                "name": case.name,
                **dataclasses.asdict(case),
                "img_tokens": case.img_tokens,
                "device_kind": device,
                "date": stamp,
                "peak": peak,
                "parallel": len(lanes),
                "lane_env": lane_env,
                **row,
            }
            row["versions"] = {**row.get("versions", {}), **code}
            with lock:
                if log is not None:
                    _append_log(out_dir / f"{name}.log", i, case, row, log)
                runner.append_row(jsonl, row)
                print(summary(i, len(cases), case, row), flush=True)
                rows.append(row)

    if device == "cuda" and parallel > 1 and peak.get("gpus") and peak["gpus"] < parallel:
        print(
            f"--parallel {parallel}: only {peak['gpus']} GPU(s) visible, running {peak['gpus']} at a time", flush=True
        )
        parallel = peak["gpus"]
    lanes = _lanes(parallel, device, env)
    threads = [threading.Thread(target=lane, args=(e,)) for e in lanes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows.sort(key=lambda r: r["index"])
    print(f"{name}: {len(rows)} rows in {time.time() - t_start:.0f} s -> {jsonl}", flush=True)
    return rows


def _lanes(parallel: int, device: str, env: dict) -> list[dict]:
    """Extra environment of each lane: one GPU per lane when 1-GPU cases run side by side."""
    if parallel <= 1:
        return [{}]
    if device == "cpu":
        return [{} for _ in range(parallel)]
    visible = [x for x in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    ids = visible or [str(k) for k in range(parallel)]
    if len(ids) < parallel:
        raise ValueError(f"--parallel {parallel} needs {parallel} visible GPUs, CUDA_VISIBLE_DEVICES has {len(ids)}")
    return [{"CUDA_VISIBLE_DEVICES": ids[k]} for k in range(parallel)]


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x != ""]


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--set", choices=sorted(SETS), help="a named sweep (see --list)")
    p.add_argument("--list", action="store_true", help="print the named sets and their cases, then exit")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out", help="folder for <set>.jsonl and logs")
    p.add_argument("--name", help="file stem of the results (default: the set name, or 'custom')")
    p.add_argument("--budget", type=float, help="seconds for the whole sweep; later cases are recorded as not run")
    p.add_argument("--grace", type=float, default=15.0, help="seconds the other ranks get after one rank failed")
    p.add_argument("--peak-tflops", type=float, help="skip the matmul measurement and use this peak")
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="run this many 1-GPU cases side by side, one GPU each (e.g. 2 on a 2-GPU machine)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="add one torch.profiler step to every case (row 'profile': kernel time by category)",
    )
    p.add_argument("--only", help="run only cases whose name contains each of these comma-separated words")
    p.add_argument(
        "--data",
        help="train every selected case on this shard folder (made by `fluxzero cache`) "
        "or synthetic spec, through the trainer's loader (default: synthetic latents "
        "of each case's res and txt)",
    )
    p.add_argument(
        "--workers",
        type=lambda v: None if v == "auto" else int(v),
        default=0,
        help="loader worker processes (run-file num_workers); auto: the trainer's own choice (up to 4 on a GPU)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train a LoRA of this rank (targets all-linear) instead of the whole model (fluxzero rows; the "
        "diffusers baseline takes PEFT adapters of that rank)",
    )
    p.add_argument(
        "--ds-json",
        help="time the DeepSpeed JSON gen-config (or --fit) wrote, as it is: its micro "
        "batch, stage, checkpointing and compile replace --mb/--zero/--ckpt/--compile",
    )
    g = p.add_argument_group("a custom sweep: the cartesian product of these comma-separated lists")
    g.add_argument("--impl", type=_csv(str), default=["fluxzero"])
    g.add_argument("--model", type=_csv(str), default=["flux-dev-lite"])
    g.add_argument("--gpus", type=_csv(int), default=[1])
    g.add_argument("--zero", type=_csv(int), default=[0])
    g.add_argument("--precision", type=_csv(str), default=["bf16"])
    g.add_argument("--ckpt", type=_csv(int), default=[1], help="checkpoint every k-th block; 0 = off")
    g.add_argument("--mb", type=_csv(int), default=[1])
    g.add_argument("--res", type=_csv(int), default=[512])
    g.add_argument("--txt", type=int, default=512)
    g.add_argument("--attn", type=_csv(str), default=["flash"])
    g.add_argument("--optim", type=_csv(str), default=["torch-fused"])
    g.add_argument("--compile", type=_csv(int), default=[0], help="torch.compile the blocks: 0 eager, 1 compiled")
    g.add_argument("--warmup", type=int, default=2)
    g.add_argument("--steps", type=int, default=5)
    g.add_argument("--timeout", type=int, default=150, help="seconds per case")
    # internal
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rowdir", help=argparse.SUPPRESS)
    p.add_argument("--peak", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:  # noqa: C901
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker_main(args.worker, args.rowdir)
    if args.peak:
        return peak_main(args.device)
    if args.list:
        for name, (fn, budget, doc) in SETS.items():
            cases = fn()
            print(f"{name} ({len(cases)} cases, budget {budget} s): {doc}")
            for c in cases:
                print(f"    {c.name}")
        return 0
    if args.set:
        fn, budget, _ = SETS[args.set]
        cases, name = fn(), args.name or args.set
    else:
        budget, name = 1e9, args.name or "custom"
        cases = [
            Case(
                impl=i,
                model=m,
                gpus=g,
                zero=z,
                precision=p,
                ckpt=k,
                mb=b,
                res=r,
                txt=args.txt,
                attn=a,
                optim=o,
                compile=bool(c),
                warmup=args.warmup,
                steps=args.steps,
                timeout=args.timeout,
            )
            for i, m, g, z, p, k, b, r, a, o, c in itertools.product(
                args.impl,
                args.model,
                args.gpus,
                args.zero,
                args.precision,
                args.ckpt,
                args.mb,
                args.res,
                args.attn,
                args.optim,
                args.compile,
            )
        ]
    if args.only:
        words = args.only.split(",")
        cases = [c for c in cases if all(w in c.name for w in words)]
    if args.profile:
        cases = [dataclasses.replace(c, profile=True, timeout=c.timeout + 60) for c in cases]
    if args.data:
        if not args.data.startswith("synthetic:") and not (Path(args.data) / "manifest.json").is_file():
            print(
                f"--data {args.data}: no manifest.json there; pass a folder made by `fluxzero cache`", file=sys.stderr
            )
            return 2
        cases = [
            dataclasses.replace(
                c, data=str(Path(args.data).resolve()) if not args.data.startswith("synthetic:") else args.data
            )
            for c in cases
        ]
    if args.workers != 0:
        cases = [dataclasses.replace(c, workers=args.workers) for c in cases]
    if args.lora_rank:
        cases = [dataclasses.replace(c, lora={"rank": args.lora_rank, "targets": "all-linear"}) for c in cases]
    if args.ds_json:  # gen-config's JSON decides batch, stage, checkpointing and compile
        cases = [with_ds_json(c, args.ds_json, args.device) for c in cases]
    if not cases:
        print("no cases selected", file=sys.stderr)
        return 2
    if args.parallel > 1 and any(c.gpus > 1 for c in cases):
        print(f"--parallel runs 1-GPU cases side by side; {name} has multi-GPU cases: drop --parallel", file=sys.stderr)
        return 2
    sweep(name, cases, Path(args.out), args.device, args.budget or budget, args.grace, args.peak_tflops, args.parallel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
