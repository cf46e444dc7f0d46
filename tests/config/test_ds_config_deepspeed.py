"""Generated and committed configs against deepspeed 0.19.8's own parser (DeepSpeedConfig, no GPU, no engine).

deepspeed is imported once for the whole module (a few seconds); each parse then takes milliseconds.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from fluxzero.cli import main
from fluxzero.config.deepspeed import build as ds_config
from fluxzero.config.deepspeed import check as ds_check
from fluxzero.config.deepspeed.build import build, options_from
from fluxzero.config.deepspeed.check import check
from fluxzero.config.deepspeed.validate import deepspeed_problems, parse
from fluxzero.config.deepspeed.view import DSConfigError
from tests.helpers import ONE_RANK

ROOT = Path(__file__).resolve().parents[2]
PRESET_DIR = ROOT / "ds_configs"


def _readme_commands() -> dict[str, list[str]]:
    """file name -> gen-config argv, from the command lines in ds_configs/README.md."""
    text = (PRESET_DIR / "README.md").read_text()
    commands = {}
    for line in text.splitlines():
        m = re.fullmatch(r"fluxzero (gen-config .*) -o ds_configs/(\S+\.json)", line.strip())
        if m:
            commands[m.group(2)] = shlex.split(m.group(1))
    return commands


# ---------------------------------------------------------------------------------------------------------
# committed presets


def test_every_committed_config_has_its_command():
    files = sorted(p.name for p in PRESET_DIR.glob("*.json"))
    assert len(files) >= 8
    assert sorted(_readme_commands()) == files


@pytest.mark.parametrize("name", sorted(_readme_commands()))
def test_committed_config_is_gen_config_output(tmp_path, name):
    out = tmp_path / name
    r = CliRunner().invoke(main, _readme_commands()[name] + ["-o", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == (PRESET_DIR / name).read_bytes(), f"regenerate ds_configs/{name} with its command"


@pytest.mark.parametrize("name", sorted(p.name for p in PRESET_DIR.glob("*.json")))
@pytest.mark.parametrize("world", [1, 8])
def test_committed_config_passes_deepspeed_and_our_checks(name, world):
    cfg = json.loads((PRESET_DIR / name).read_text())
    assert check(cfg, world) == []
    ds = parse(cfg, world)
    assert ds.train_batch_size == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * world
    assert ds.gradient_clipping == cfg["gradient_clipping"]
    assert ds.zero_optimization_stage == cfg["zero_optimization"]["stage"]


# ---------------------------------------------------------------------------------------------------------
# grid of option combinations

AXES = dict(
    zero_stage=[0, 1, 2, 3],
    offload_optimizer=["none", "cpu", "nvme"],
    offload_param=["none", "cpu", "nvme"],
    adam_impl=["torch", "fused", "cpu"],
    precision=["bf16", "fp16", "fp32"],
)
# cycled over the grid so that every value meets many combinations without multiplying the grid size
CYCLED = [
    dict(scheduler="WarmupLR", world_size=None),
    dict(scheduler="WarmupCosineLR", total_steps=1000, world_size=8, global_batch=64, micro_batch=2),
    dict(scheduler="WarmupDecayLR", total_steps=500, warmup_steps=50, world_size=3, grad_accum=4),
    dict(
        scheduler="none",
        checkpoint_impl="deepspeed",
        checkpoint_every=2,
        partition_activations=True,
        contiguous_memory_optimization=True,
        cpu_checkpointing=True,
        world_size=2,
        micro_batch=3,
    ),
    dict(checkpoint_every=0, tensorboard_dir="/tmp/tb", job_name="grid", overlap_comm=False, world_size=16),
]


def _grid():
    for i, values in enumerate(itertools.product(*AXES.values())):
        fields = dict(zip(AXES, values))
        if "nvme" in (fields["offload_optimizer"], fields["offload_param"]):
            fields["nvme_path"] = "/local_nvme"
        yield {**fields, **CYCLED[i % len(CYCLED)]}


def test_option_grid_passes_deepspeed_parser():
    accepted = refused = 0
    for fields in _grid():
        options = ds_config.DSOptions(**fields)
        try:
            cfg = build(options)
        except DSConfigError as e:
            refused += 1
            assert e.problems and all(isinstance(p, str) and p for p in e.problems)
            continue
        accepted += 1
        world = options.world_size or 1
        assert check(cfg, options.world_size) == [], fields
        ds = parse(cfg, world)
        micro, accum, train = ds_config.batch_numbers(options)
        assert (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (micro, accum), fields
        assert ds.train_batch_size == micro * accum * world
        if train is not None:
            assert ds.train_batch_size == train
        z = ds.zero_config
        assert z.stage == options.zero_stage
        want_opt = options.offload_optimizer
        assert (z.offload_optimizer.device if z.offload_optimizer else "none") == want_opt
        assert (z.offload_param.device if z.offload_param else "none") == options.offload_param
        assert ds.bfloat16_config.enabled == (options.precision == "bf16")
        assert ds.float16_config.enabled == (options.precision == "fp16")
        if options.precision == "fp16":
            assert ds.float16_config.initial_dynamic_scale() == 2**12 and ds.float16_config.loss_scale == 0
        assert ds.optimizer_name == "adamw"
        assert ds.optimizer_params["torch_adam"] == (options.adam_impl == "torch")
        assert ds.scheduler_name == (None if options.scheduler == "none" else options.scheduler)
        ac = ds.activation_checkpointing_config
        assert ac.partition_activations == (options.checkpoint_impl == "deepspeed" and options.partition_activations)
    # a grid that accepted (or refused) nothing would prove nothing
    assert accepted >= 80 and refused >= 200, (accepted, refused)


def test_deepspeed_catches_the_batch_mismatch_for_a_world_size():
    cfg = build(options_from("zero2", world_size=2, micro_batch=4, grad_accum=2))
    assert deepspeed_problems(cfg, 2) == []
    (line,) = deepspeed_problems(cfg, 4)
    assert line.startswith("deepspeed: ") and "16 != 4 * 2 * 4" in line


def test_what_deepspeed_accepts_silently_and_we_refuse():
    """The reason check() exists: each of these passes DeepSpeed's parser but is wrong."""
    base = build(options_from("zero2"))
    cases = []
    c = json.loads(json.dumps(base))
    c["zero_optimization"]["offload_param"] = {"device": "cpu"}  # ignored at stage 2
    cases.append(c)
    c = json.loads(json.dumps(base))
    c["zero_optimization"] = {"stage": 3, "offload_param": {"device": "nvme"}}  # no nvme_path
    cases.append(c)
    c = json.loads(json.dumps(base))
    c["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/n"}  # CPU at stage 2
    cases.append(c)
    c = json.loads(json.dumps(base))
    c["gradient_clip"] = 0.0  # unknown top-level key
    cases.append(c)
    c = json.loads(json.dumps(base))
    c["activation_checkpointing"] = {"partition_activation": True}
    cases.append(c)
    for c in cases:
        assert deepspeed_problems(c) == [], c
        assert len(check(c)) >= 1, c


def test_deepspeed_problems_are_one_line_each():
    cfg = build(options_from("zero2"))
    cfg["zero_optimization"]["overlap_com"] = True
    cfg["bf16"]["enabeld"] = True
    lines = deepspeed_problems(cfg)
    assert lines and all("\n" not in line and line.startswith("deepspeed: ") for line in lines)
    assert any("zero_optimization.overlap_com" in line for line in lines)


def test_check_config_runs_deepspeed_parser(tmp_path):
    f = tmp_path / "ds.json"
    cfg = build(options_from("zero3", world_size=4, micro_batch=2))
    f.write_text(json.dumps(cfg))
    r = CliRunner().invoke(main, ["check-config", str(f)])
    assert r.exit_code == 0 and "OK (fluxzero's checks and DeepSpeed's parser" in r.output
    # a value only DeepSpeed's parser knows is wrong: a non-boolean where it wants a boolean
    cfg["zero_optimization"]["overlap_comm"] = "maybe"
    f.write_text(json.dumps(cfg))
    assert CliRunner().invoke(main, ["check-config", str(f), "--no-deepspeed"]).exit_code == 0
    r = CliRunner().invoke(main, ["check-config", str(f), "--world-size", "4"])
    assert r.exit_code == 2
    (line,) = r.output.strip().splitlines()
    assert line.startswith(f"{f}: deepspeed: zero_optimization.overlap_comm: Input should be a valid boolean")


# ---------------------------------------------------------------------------------------------------------
# our key lists are deepspeed 0.19.8's


def _fields(model) -> set[str]:
    names = set()
    for name, f in model.model_fields.items():
        names.add(name)
        if f.alias:
            names.add(f.alias)
    return names


def test_section_key_lists_match_deepspeed_models():
    from deepspeed.monitor.config import TensorBoardConfig
    from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT_DEFAULT
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    assert _fields(DeepSpeedZeroConfig) == ds_check.ZERO_KEYS
    assert _fields(DeepSpeedZeroOffloadParamConfig) == ds_check.OFFLOAD_PARAM_KEYS
    assert _fields(DeepSpeedZeroOffloadOptimizerConfig) == ds_check.OFFLOAD_OPTIMIZER_KEYS
    assert _fields(DeepSpeedBF16Config) == ds_check.BF16_KEYS
    assert _fields(DeepSpeedFP16Config) == ds_check.FP16_KEYS
    assert _fields(TensorBoardConfig) == ds_check.TENSORBOARD_KEYS
    assert set(ACT_CHKPT_DEFAULT) == ds_check.ACTIVATION_CHECKPOINTING_KEYS


def test_minor_section_key_lists_match_deepspeed_constants():
    import deepspeed.profiling.constants as prof
    import deepspeed.runtime.constants as rc
    import deepspeed.runtime.model_checkpointing.constants as mc
    from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT

    def names(module, prefix):
        return {
            v
            for k, v in vars(module).items()
            if k.startswith(prefix) and isinstance(v, str) and not k.endswith("_DEFAULT") and v.isidentifier()
        }  # not the FORMAT help text

    assert set(AIO_DEFAULT_DICT) == ds_check.AIO_KEYS
    assert names(prof, "FLOPS_PROFILER_") - {prof.FLOPS_PROFILER} == ds_check.FLOPS_PROFILER_KEYS
    assert {rc.GRAD_ACCUM_DTYPE} == ds_check.DATA_TYPES_KEYS
    assert {
        rc.CHECKPOINT_TAG_VALIDATION,
        rc.LOAD_UNIVERSAL_CHECKPOINT,
        rc.USE_NODE_LOCAL_STORAGE_CHECKPOINT,
        rc.CHECKPOINT_PARALLEL_WRITE,
        mc.CHECKPOINT_SERIALIZATION,
        mc.CHECKPOINT_WRITER,
    } == ds_check.CHECKPOINT_KEYS


def test_top_level_keys_cover_what_deepspeed_reads():
    """Record every top-level key DeepSpeedConfig looks up; each must be known (or known-removed) to check()."""
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS

    seen = set()

    class Keys:
        def __init__(self, d):
            self.d = d

        def __contains__(self, k):
            seen.add(k)
            return dict.__contains__(self.d, k)

        def __iter__(self):
            return iter(dict.keys(self.d))

    class Recording(dict):
        def get(self, k, default=None):
            seen.add(k)
            return dict.get(self, k, default)

        def __getitem__(self, k):
            seen.add(k)
            return dict.__getitem__(self, k)

        def __contains__(self, k):
            seen.add(k)
            return dict.__contains__(self, k)

        def keys(self):
            return Keys(self)

        def __copy__(self):
            return self

        def __deepcopy__(self, memo):
            return self

    parse(Recording(build(options_from("zero2"))))
    assert len(seen) > 40
    assert set(_REMOVED_TOP_LEVEL_CONFIG_KEYS) == ds_check.REMOVED_TOP_LEVEL_KEYS
    missing = seen - ds_check.TOP_LEVEL_KEYS - ds_check.REMOVED_TOP_LEVEL_KEYS
    assert not missing, f"add to ds_check.TOP_LEVEL_KEYS: {sorted(missing)}"


# ---------------------------------------------------------------------------------------------------------
# the CPU-safe presets really train (one rank, gloo, tiny MLP): parser acceptance is not engine acceptance

_ENGINE_SMOKE = (
    ONE_RANK
    + r"""
import json, os, sys
for path in sys.argv[1:]:
    cfg = json.load(open(path))
    cfg.pop("fluxzero")  # the trainer pops it too
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for step in range(3):
        loss = eng(torch.randn(1, 16, dtype=torch.bfloat16)).float().pow(2).mean()
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    print(json.dumps({"file": os.path.basename(path), "optimizer": type(eng.optimizer).__name__,
                      "basic": type(eng.basic_optimizer).__name__, "steps": eng.global_steps, "losses": losses}))
torch.distributed.destroy_process_group()  # a gloo group left to interpreter teardown can abort the process
"""
)


@pytest.mark.slow
def test_cpu_safe_presets_train_one_rank():
    import subprocess
    import sys

    names = ["zero0.json", "zero1.json", "zero2.json", "zero2-offload.json", "zero3.json", "zero3-offload.json"]
    r = subprocess.run(
        [sys.executable, "-c", _ENGINE_SMOKE, *[str(PRESET_DIR / n) for n in names]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    runs = {d["file"]: d for d in map(json.loads, (ln for ln in r.stdout.splitlines() if ln.startswith("{")))}
    assert sorted(runs) == sorted(names)
    for _name, run in runs.items():
        assert run["basic"] == "AdamW" and run["steps"] == 3, run  # torch_adam: torch.optim.AdamW, no JIT build
        assert all(l == l and l < 1e3 for l in run["losses"]), run
    assert runs["zero0.json"]["optimizer"] == "FP16_UnfusedOptimizer"  # DeepSpeed's bf16 wrapper at stage 0
    assert runs["zero2-offload.json"]["optimizer"] == "DeepSpeedZeroOptimizer"
    assert runs["zero3-offload.json"]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"


def test_torch_names_exist():
    import torch

    for name in ds_check.TORCH_SCHEDULERS:
        assert hasattr(torch.optim.lr_scheduler, name), name
    for name in ds_check.TORCH_OPTIMIZERS:
        assert hasattr(torch.optim, name), name


# ---------------------------------------------------------------------------------------------------------
# the lr schedules gen-config writes, read from real engines: engine.get_lr() before each optimizer step

_LR_PROBE = (
    ONE_RANK
    + r"""
import json, os, sys
for arg in sys.argv[1:]:
    cfg = json.loads(arg)
    cfg.pop("fluxzero")
    model = torch.nn.Linear(4, 1)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    lrs = []
    for step in range(cfg.pop("_steps", 0) or 8):
        lrs.append(eng.get_lr()[0])  # the lr this optimizer step will use
        eng.backward(eng(torch.randn(1, 4)).pow(2).mean())
        eng.step()
    print("LRS", json.dumps(lrs))
torch.distributed.destroy_process_group()
"""
)


@pytest.mark.slow
def test_warmup_lr_of_real_engines():
    """gen-config's WarmupLR (linear and log) and WarmupDecayLR: step 1 already trains (lr / N) and the lr is
    reached at step N = --warmup-steps (DeepSpeed's defaults ran steps 1 and 2 at 0 and peaked at N + 2);
    WarmupCosineLR runs step 1 at 0 whatever its warmup_min_ratio (its constructor sets ratio 0) and ends
    its cosine at the last --total-steps step."""
    import subprocess
    import sys

    def cfg(*args):
        c = build(
            options_from(
                None,
                precision="fp32",
                zero_stage=0,
                checkpoint_every=0,
                gradient_clipping=0.0,
                lr=1e-3,
                **dict(zip(args[::2], args[1::2])),
            )
        )
        return json.dumps(c)

    argv = [
        cfg("warmup_steps", 5),
        cfg("warmup_steps", 5, "warmup_type", "log"),
        cfg("scheduler", "WarmupDecayLR", "warmup_steps", 4, "total_steps", 8),
        cfg("scheduler", "WarmupCosineLR", "warmup_steps", 4, "total_steps", 8, "cos_min_ratio", 0.1),
    ]
    r = subprocess.run([sys.executable, "-c", _LR_PROBE, *argv], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    linear, log, decay, cosine = (json.loads(ln[4:]) for ln in r.stdout.splitlines() if ln.startswith("LRS "))
    # float tolerance: DeepSpeed computes min + delta * gamma in Python floats
    assert linear == pytest.approx([2e-4, 2e-4, 2e-4 + 8e-4 / 3, 2e-4 + 16e-4 / 3, 1e-3, 1e-3, 1e-3, 1e-3])
    assert log[0] == pytest.approx(2e-4) and log[4] == pytest.approx(1e-3) and log[3] < 1e-3
    assert decay[0] == pytest.approx(2.5e-4) and decay[3] == pytest.approx(1e-3) and 0 < decay[7] < decay[4]
    assert cosine[0] == 0.0 and cosine[1] == pytest.approx(2.5e-4) and cosine[7] == pytest.approx(1e-4)


_MODE_ENGINES = (
    'import warnings\nwarnings.filterwarnings("ignore")\n'
    + ONE_RANK
    + r"""
import json, os, sys
from fluxzero.train.optim.optimizers import build_optimizer
for arg in sys.argv[1:]:
    cfg = json.loads(arg)
    mode = cfg.pop("fluxzero")["optimizer_mode"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    if "bf16" not in cfg:
        model = model.bfloat16()  # ZeRO 0, bf16 modes: the trainer casts the model (bf16 off in DeepSpeed)
    opt = build_optimizer(model.parameters(), mode, lr=1e-4)
    try:
        eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        for _ in range(2):
            eng.backward(eng(torch.randn(2, 64, dtype=torch.bfloat16)).float().pow(2).mean())
            eng.step()
        # the tensors the client optimizer steps: its param groups (ZeRO 0-2), ZeRO-3's flat sub-groups
        stepped = {str(p.dtype) for g in opt.param_groups for p in g["params"]}
        stepped |= {str(t.dtype) for t in getattr(eng.optimizer, "fp32_partitioned_groups_flat", [])}
        print(json.dumps({"mode": mode, "ok": True, "stepped": sorted(stepped), "steps": eng.global_steps}))
    except Exception as e:  # what DeepSpeed refused, in its words
        print(json.dumps({"mode": mode, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]}))
torch.distributed.destroy_process_group()
"""
)


@pytest.mark.slow
def test_mode_configs_start_real_engines():
    """What gen-config writes for a mode is what DeepSpeed 0.19.8 needs for its client optimizer: ZeRO 0 (bf16 off),
    ZeRO 2, ZeRO 3 with parameter offload (bf16 masters on the GPU); fp32 masters with optimizer offload. And the
    combination check-config refuses (bf16 masters with optimizer offload) is refused by DeepSpeed itself."""
    pytest.importorskip("torchao")
    import subprocess
    import sys

    def cfg(mode, stage, **kw):
        return build(
            options_from(
                None,
                model="flux-tiny",
                optimizer_mode=mode,
                zero_stage=stage,
                checkpoint_every=0,
                gradient_clipping=0.0,
                scheduler="none",
                **kw,
            )
        )

    written = [
        cfg("bf16-kahan", 0),
        cfg("bf16-sr", 2),
        cfg("adamw8bit-sr", 3, offload_param="cpu"),
        cfg("fp32", 2, offload_optimizer="cpu"),
    ]
    refused = cfg("bf16-kahan", 2)
    refused["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert any("offloads only for its own DeepSpeedCPUAdam" in p for p in check(refused, 1))
    r = subprocess.run(
        [sys.executable, "-c", _MODE_ENGINES, *map(json.dumps, written + [refused])],
        capture_output=True,
        text=True,
        timeout=420,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    runs = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert [run["ok"] for run in runs] == [True, True, True, True, False], runs
    for run in runs[:3]:
        assert run["stepped"] == ["torch.bfloat16"] and run["steps"] == 2, run  # bf16 masters really
    assert runs[3]["stepped"] == ["torch.float32"]
    assert "DeepSpeedCPUAdam" in runs[4]["error"]
