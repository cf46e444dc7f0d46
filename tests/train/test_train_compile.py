"""Opt-in torch.compile of the transformer blocks (fluxzero.compile): config, checks, and compiled training
equal to eager training on CPU.

The training cases run `backend="aot_eager"`: Dynamo capture and AOTAutograd's joint forward/backward graph,
which activation checkpointing and ZeRO-3's hooks go through, without inductor's C++ code generation (15-40 s
more per case on CPU). That proves the wiring; the kernels inductor writes on a GPU are measured by
benchmarks/sweep.py --set levers2.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from fluxzero.config.deepspeed import check as ds_check

ROOT = Path(__file__).resolve().parents[2]
DATA = "synthetic:n=8,hw=8x8,txt=4,ctx=64,vec=32"
STEPS = 3


def test_gen_config_compile_flag():
    from fluxzero.cli import main

    off = CliRunner().invoke(main, ["gen-config", "--preset", "zero3", "--model", "flux-tiny"])
    on = CliRunner().invoke(main, ["gen-config", "--preset", "zero3", "--model", "flux-tiny", "--compile"])
    assert off.exit_code == 0 and on.exit_code == 0, (off.output, on.output)
    off, on = json.loads(off.stdout), json.loads(on.stdout)
    assert "compile" not in off["fluxzero"]  # off writes nothing: the committed presets stay as they are
    assert on["fluxzero"]["compile"] == {"blocks": True, "mode": "default"}
    assert {k: v for k, v in on.items() if k != "fluxzero"} == {k: v for k, v in off.items() if k != "fluxzero"}
    assert ds_check.check(on) == []


@pytest.mark.parametrize(
    "section, match",
    [
        ({"blocks": "yes"}, "fluxzero.compile.blocks must be true or false"),
        ({"blocks": True, "mode": "reduce-overhead"}, "fluxzero.compile.mode must be one of .* CUDA graphs"),
        ({"blocks": True, "backend": "cudagraphs"}, "fluxzero.compile.backend must be one of"),
        ({"blocks": True, "dynamic": "auto"}, "fluxzero.compile.dynamic must be true or false"),
        ({"blocks": True, "mdoe": "default"}, "unknown key 'fluxzero.compile.mdoe' \\(did you mean 'mode'\\?\\)"),
    ],
)
def test_check_refuses_bad_compile_sections(section, match):
    import re

    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "fluxzero": {"compile": section}}
    problems = ds_check.check(cfg)
    assert len(problems) == 1 and re.search(match, problems[0]), problems


def test_check_refuses_deepcompile_the_trainer_never_runs():
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "compile": {"deepcompile": True}}
    assert ds_check.check(cfg) == [
        "compile.deepcompile takes effect only through DeepSpeed's engine.compile(), "
        "which the fluxzero trainer does not call: remove it, and set "
        "fluxzero.compile.blocks true to compile the blocks"
    ]


@pytest.mark.parametrize(
    "section, match",
    [
        (True, "fluxzero.compile must be a JSON object, got true"),
        ({"blocks": "yes"}, 'fluxzero.compile.blocks must be true or false, got "yes"'),
        (
            {"blocks": True, "mode": "reduce-overhead"},
            'fluxzero.compile.mode must be one of default, max-autotune-no-cudagraphs, got "reduce-overhead"',
        ),
        ({"blocks": True, "backend": "tvm"}, "fluxzero.compile.backend must be one of inductor, aot_eager, eager"),
    ],
)
def test_trainer_refuses_bad_compile_sections(tmp_path, section, match):
    # one rule set: the trainer refuses with check-config's own sentence
    from fluxzero.config.deepspeed.file import load_for_training
    from fluxzero.config.deepspeed.view import DSConfigError

    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "fluxzero": {"compile": section},
    }
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    with pytest.raises(DSConfigError, match=match):
        load_for_training(str(tmp_path / "ds.json"), 1)


CHILD = textwrap.dedent("""
    import contextlib, io, json, os, sys, time, warnings
    warnings.filterwarnings("ignore")
    os.environ["FLUXZERO_NO_PROGRESS"] = "1"
    import torch, torch._dynamo, torch.distributed as dist
    from torch._dynamo.utils import counters
    from fluxzero.config import TrainConfig
    from fluxzero.train.distributed import init_distributed
    from fluxzero.train.loop import train
    init_distributed()
    results = {}
    for name, cfg in json.load(open(sys.argv[1])):
        torch._dynamo.reset()  # each case compiles from scratch
        counters.clear()
        t = time.perf_counter()
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            losses = train(TrainConfig.from_dict(cfg))["losses"]
        sys.stderr.write(err.getvalue())
        results[name] = {"losses": losses, "graphs": counters["stats"]["unique_graphs"],
                         "graph_breaks": sum(counters["graph_break"].values()), "s": time.perf_counter() - t,
                         "compile_note": "compiling the blocks (torch.compile) during the first step" in err.getvalue()}
    if dist.get_rank() == 0:
        json.dump(results, open(sys.argv[2], "w"))
""")


def _jobs(tmp_path, cases, data=DATA):
    jobs = []
    for name, (stage, every, impl, compiled, *policy) in cases.items():
        ds = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9,
            "fluxzero": {"activation_checkpointing": {"every_k_blocks": every, "implementation": impl}},
        }
        if compiled:
            ds["fluxzero"]["compile"] = {"blocks": True, "backend": "aot_eager"}
        if policy:
            ds["fluxzero"]["activation_checkpointing"]["policy"] = policy[0]
        assert ds_check.check(ds) == []
        (tmp_path / f"{name}.json").write_text(json.dumps(ds))
        jobs.append(
            [
                name,
                {
                    "deepspeed": str(tmp_path / f"{name}.json"),
                    "data": data,
                    "steps": STEPS,
                    "output_dir": str(tmp_path / name),
                    "export": {"format": None},
                },
            ]
        )
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    (tmp_path / "child.py").write_text(CHILD)
    return [str(tmp_path / "child.py"), str(tmp_path / "jobs.json"), str(tmp_path / "out.json")]


def _run(tmp_path, cases) -> dict:
    """The cases in one child process; their results by name (timings printed)."""
    child = _jobs(tmp_path, cases)
    subprocess.run(
        [sys.executable, *child], check=True, cwd=tmp_path, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    r = json.loads((tmp_path / "out.json").read_text())
    print({name: round(v["s"], 1) for name, v in r.items()})
    return r


def _check(r, names):
    ref = r[names[0]]["losses"]
    assert len(ref) == STEPS and r[names[0]]["graphs"] == 0
    for name in names:  # same fp32 aten ops in the same order: equal up to float reassociation
        assert r[name]["losses"] == pytest.approx(ref, rel=1e-5, abs=0), name


@pytest.mark.slow
def test_compiled_blocks_train_like_eager(tmp_path):
    """Single process, flux-tiny, 3 steps: ZeRO-0, 2 and 3, no / torch / deepspeed checkpointing; the
    reference is eager ZeRO-0 without checkpointing."""
    cases = {  # name: (stage, checkpoint every k, implementation, compile)
        "z0": (0, 0, "torch", False),
        "z0_compiled": (0, 0, "torch", True),
        "z0_ck1_compiled": (0, 1, "torch", True),
        "z0_ck1_ds_compiled": (0, 1, "deepspeed", True),
        "z2_ck1_compiled": (2, 1, "torch", True),
        "z3_compiled": (3, 0, "torch", True),
        "z3_ck1": (3, 1, "torch", False),
        "z3_ck1_compiled": (3, 1, "torch", True),
    }
    r = _run(tmp_path, cases)
    _check(r, list(cases))
    # one graph per block class (the 2 double and the 2 single blocks share them) and nothing eager inside a
    # block, at every stage: ZeRO-3 gathers each block whole from a hook outside the compiled forward
    # (engine.zero3_leaf_blocks). A recompile per block would show 4, no compile 0, per-submodule ZeRO-3
    # hooks about 30 graphs and 40 breaks.
    for name in ("z0_compiled", "z0_ck1_compiled", "z2_ck1_compiled", "z3_compiled", "z3_ck1_compiled"):
        assert (r[name]["graphs"], r[name]["graph_breaks"]) == (2, 0), name
    assert r["z0_ck1_ds_compiled"]["graphs"] == 4  # reentrant: forward without grad, recompute with grad
    # the trainer says why its first step takes long, for the compiled runs only (rank 0's output)
    assert {name: r[name]["compile_note"] for name in cases} == {name: c[3] for name, c in cases.items()}


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_on_two_ranks(tmp_path):
    """2 ranks (gloo), ZeRO-3 with checkpointing: each rank holds half of every parameter."""
    child = _jobs(tmp_path, {"z3_ck1": (3, 1, "torch", False), "z3_ck1_compiled": (3, 1, "torch", True)})
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *child],
        check=True,
        cwd=tmp_path,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    r = json.loads((tmp_path / "out.json").read_text())
    _check(r, ["z3_ck1", "z3_ck1_compiled"])
    assert (r["z3_ck1_compiled"]["graphs"], r["z3_ck1_compiled"]["graph_breaks"]) == (2, 0)


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_on_aspect_buckets(tmp_path):
    """Three aspect buckets (16, 15 and 12 image tokens), 4 steps, ZeRO-2, every block checkpointed: the trainer
    hands the loader's buckets to the engine, which compiles each block class once with a dynamic token axis."""
    cases = {"z2_ck1": (2, 1, "torch", False), "z2_ck1_compiled": (2, 1, "torch", True)}
    child = _jobs(tmp_path, cases, data="synthetic:n=8,hw=8x8*2+6x10+4x12,txt=4,ctx=64,vec=32")
    subprocess.run(
        [sys.executable, *child], check=True, cwd=tmp_path, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    r = json.loads((tmp_path / "out.json").read_text())
    _check(r, list(cases))
    assert (r["z2_ck1_compiled"]["graphs"], r["z2_ck1_compiled"]["graph_breaks"]) == (2, 0)


@pytest.mark.slow
def test_selective_checkpointing_trains_like_no_checkpointing(tmp_path):
    """fluxzero.activation_checkpointing.policy selective through the trainer, 3 steps of flux-tiny: eager at
    ZeRO-0 and ZeRO-3 (DeepSpeed's hooks gather the parameters again in the recompute), compiled at ZeRO-2 and ZeRO-3
    (the checkpoint inside the compiled graph: still one graph per block class, no break); the reference is eager
    ZeRO-0 without checkpointing."""
    cases = {
        "z0": (0, 0, "torch", False),
        "z0_sel": (0, 1, "torch", False, "selective"),
        "z3_sel": (3, 1, "torch", False, "selective"),
        "z2_sel_compiled": (2, 1, "torch", True, "selective"),
        "z3_sel2_compiled": (3, 2, "torch", True, "selective"),
    }
    r = _run(tmp_path, cases)
    _check(r, list(cases))
    assert (r["z2_sel_compiled"]["graphs"], r["z2_sel_compiled"]["graph_breaks"]) == (2, 0)
    # every 2nd block: the checkpointed and the plain forward of each block class, one graph each
    assert (r["z3_sel2_compiled"]["graphs"], r["z3_sel2_compiled"]["graph_breaks"]) == (4, 0)


def _train(tmp_path: Path, name: str, backend: str, cache: str, steps: int = 1, save_step: str = "") -> str:
    """launch/train.py, flux-tiny, `steps` steps with compiled blocks (`backend`), output_dir tmp_path/name, an empty
    Inductor cache folder of its own (FLUXZERO_COMPILE_SAVE_STEP `save_step` where given); returns its stderr."""
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "fluxzero": {"compile": {"blocks": True, "backend": backend}},
    }
    (tmp_path / f"{name}.json").write_text(json.dumps(ds))
    run = {
        "deepspeed": str(tmp_path / f"{name}.json"),
        "data": DATA,
        "steps": steps,
        "output_dir": str(tmp_path / name),
    }
    (tmp_path / f"{name}.yaml").write_text(json.dumps({**run, "export": {"format": None}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache)}
    env["FLUXZERO_NO_PROGRESS"] = "1"
    env["FLUXZERO_COMPILE_SAVE_STEP"] = save_step
    p = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(tmp_path / f"{name}.yaml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stderr


@pytest.mark.slow
def test_the_compiled_blocks_are_kept_beside_the_checkpoints_and_read_by_a_later_run(tmp_path):
    """Inductor (CPU) compiles the blocks in the first step; the trainer keeps that in output_dir/compile_cache.bin
    (once, after the step FLUXZERO_COMPILE_SAVE_STEP names, not again at the final checkpoint).
    A later run whose output_dir holds the file (a resume on another machine) loads it; a broken one costs a
    warning line, not the run."""
    err = _train(tmp_path, "first", "inductor", "cache-a", steps=2, save_step="1")
    kept = tmp_path / "first" / "compile_cache.bin"
    assert kept.stat().st_size > 0
    # once per start, after FLUXZERO_COMPILE_SAVE_STEP steps (50 by default) or at its first checkpoint
    assert err.count("compiled blocks kept in") == 1 and f"compiled blocks kept in {kept} after step 1 (" in err
    (tmp_path / "second").mkdir()
    (tmp_path / "second" / "compile_cache.bin").write_bytes(kept.read_bytes())
    err = _train(tmp_path, "second", "aot_eager", "cache-b")
    assert f"loaded the compiled blocks of an earlier run ({tmp_path / 'second' / 'compile_cache.bin'}" in err
    # aot_eager caches nothing, and the file's Inductor entries went unused: the file is left as it was
    assert (tmp_path / "second" / "compile_cache.bin").read_bytes() == kept.read_bytes()
    (tmp_path / "third").mkdir()
    (tmp_path / "third" / "compile_cache.bin").write_bytes(b"not a cache")
    err = _train(tmp_path, "third", "aot_eager", "cache-c")
    assert "warning: could not load" in err and "the blocks compile from scratch" in err
    assert "done: step 1/1" in err
