"""fluxzero.train.checkpoint.safe_files: a torch.save file that would import code is refused before anything unpickles
it, and every file of a real DeepSpeed checkpoint (ZeRO 0-3, fp32 and bf16) and fluxzero's trainer state
passes."""

import io
import json
import os
import pickle
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fluxzero.train.checkpoint.safe_files import (
    ALLOWED_GLOBALS,
    FP16_GLOBALS,
    MEASURED_GLOBALS,
    _pickle_globals,
    check_checkpoint_file,
    load_trainer_state,
    unsafe_globals,
)
from tests.helpers import ONE_RANK

ROOT = Path(__file__).resolve().parents[2]


class _Payload:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _trainer_state():
    loader = {
        "epoch": 0,
        "batches_done": 3,
        "micro_batch": 1,
        "world_size": 1,
        "seed": 0,
        "data": "0f" * 8,
        "num_samples": 8,
    }
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    return {"step": 3, "loader": loader, "rng": rng, "world_size": 1}


@pytest.mark.parametrize("protocol", [2, 4])  # 2: torch.save's default (GLOBAL); 4: STACK_GLOBAL + memo
def test_a_pickle_payload_is_refused_and_never_runs(tmp_path, protocol):
    marker = tmp_path / "ran"
    path = tmp_path / "trainer_state_rank0.pt"
    torch.save({"step": 1, "rng": _Payload(marker)}, path, pickle_protocol=protocol)
    assert "posix.system" in unsafe_globals(path) or "nt.system" in unsafe_globals(path)
    with pytest.raises(ValueError) as e:
        check_checkpoint_file(path)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint file {path} holds Python code references (") and "system" in msg, msg
    assert "fluxzero does not load such files: it was not written by fluxzero or DeepSpeed" in msg, msg
    assert "\n" not in msg
    with pytest.raises(ValueError, match="holds Python code references"):
        load_trainer_state(path)
    assert not marker.exists()
    # the payload is live: an unchecked torch.load(weights_only=False), as the trainer did, runs it
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_stack_global_strings_are_followed_through_the_memo_and_computed_ones_refused():
    # PROTO 4; 'os' MEMOIZE; 'system' MEMOIZE; POP POP; GET 0; GET 1; STACK_GLOBAL; STOP
    via_memo = b"\x80\x04\x8c\x02os\x94\x8c\x06system\x940\x30h\x00h\x01\x93."
    assert _pickle_globals(via_memo) == {"os.system"}
    assert pickle.loads(via_memo) is os.system  # the hand-written pickle is valid and really imports it
    # STACK_GLOBAL of a list and a string: the module is not a literal, so the scan cannot name it
    computed = b"\x80\x04]\x94\x8c\x06system\x94\x93."
    assert _pickle_globals(computed) == {"<a computed import>"}
    assert _pickle_globals(b"\x80\x02\x82\x01.") == {"<extension registry code 1>"}  # EXT1
    assert next(iter(_pickle_globals(b"\x80\x02c"))).startswith("<unreadable pickle")  # truncated


def test_other_torch_formats_are_refused(tmp_path):
    legacy = tmp_path / "legacy.pt"
    torch.save({"x": torch.zeros(2)}, legacy, _use_new_zipfile_serialization=False)  # unpickled directly
    with pytest.raises(
        ValueError,
        match=r"legacy.pt is not a zip-format torch.save file, so fluxzero does not "
        r"load it: it was not written by fluxzero or DeepSpeed; delete it",
    ):
        check_checkpoint_file(legacy)
    script = tmp_path / "script.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), script)  # torch.load would hand it to torch.jit.load
    with pytest.raises(ValueError, match="is a TorchScript archive"):
        check_checkpoint_file(script)


def test_a_pickle_with_a_torch_zip_appended_is_refused(tmp_path):
    # zipfile finds the appended archive (it reads the end of the file); torch.load unpickles from the start
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, buf)
    path = tmp_path / "mp_rank_00_model_states.pt"
    path.write_bytes(pickle.dumps(_Payload(marker), protocol=2) + buf.getvalue())
    assert zipfile.is_zipfile(path)
    with pytest.raises(ValueError, match="is not a zip-format torch.save file"):
        check_checkpoint_file(path)
    assert not marker.exists()
    with pytest.raises(Exception):
        torch.load(path, weights_only=False)  # fails, but only after running the payload
    assert marker.exists()


def test_a_payload_in_another_record_of_the_zip_is_seen(tmp_path):
    path = tmp_path / "model_states.pt"
    torch.save({"w": torch.zeros(2)}, path)
    check_checkpoint_file(path)
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("model_states/extra.pkl", pickle.dumps(_Payload(tmp_path / "ran"), protocol=2))
    with pytest.raises(ValueError, match="holds Python code references"):
        check_checkpoint_file(path)


def test_trainer_state_loads_with_weights_only_and_equals_the_unrestricted_load(tmp_path):
    path = tmp_path / "trainer_state_rank0.pt"
    torch.save(_trainer_state(), path)
    check_checkpoint_file(path)
    got, want = load_trainer_state(path), torch.load(path, weights_only=False)
    assert got["step"] == 3 and got["loader"] == want["loader"] and got["world_size"] == 1
    assert torch.equal(got["rng"]["torch"], want["rng"]["torch"]) and got["rng"]["python"] == want["rng"]["python"]
    name, keys, *rest = got["rng"]["numpy"]
    assert (
        name == "MT19937" and np.array_equal(keys, want["rng"]["numpy"][1]) and rest == list(want["rng"]["numpy"][2:])
    )
    np.random.set_state(got["rng"]["numpy"])  # what resume does with it
    a = np.random.rand(3)
    np.random.set_state(want["rng"]["numpy"])
    assert np.array_equal(a, np.random.rand(3))
    # the numpy names were allowed for that load only (torch >= 2.5): a plain weights_only load still refuses
    if hasattr(torch.serialization, "safe_globals"):
        with pytest.raises(pickle.UnpicklingError):
            torch.load(path, weights_only=True)


def test_the_dtypes_of_fp16_runs_and_of_adamw8bit_sr_states_are_allowed(tmp_path):
    # what an fp16 run's ZeRO optimizer states and adamw8bit-sr's packed 8-bit states hold, on any CPU
    path = tmp_path / "states.pt"
    torch.save(
        {
            "state": {0: {"codes": torch.zeros(4, dtype=torch.uint8), "dtype": torch.bfloat16}},
            "fp16": torch.zeros(2, dtype=torch.float16),
            "dtype": torch.float16,
        },
        path,
    )
    assert {"torch.bfloat16", "torch.float16", "torch.HalfStorage"} <= set(unsafe_globals(path))
    check_checkpoint_file(path)


# ---------------------------------------------------------------------------------------------------------
# real DeepSpeed checkpoints: what the allow-list was measured from

_WRITE_CHECKPOINTS = (
    ONE_RANK
    + r"""
import json, os, random, sys
from pathlib import Path
import numpy as np, torch, deepspeed
from fluxzero.config import get_model_config
from fluxzero.model import build_model
from fluxzero.model import packing
presets, out = Path(sys.argv[1]), Path(sys.argv[2])
from deepspeed.accelerator import get_accelerator
precisions = ("fp32", "bf16") + (("fp16",) if get_accelerator().is_fp16_supported() else ())
for name in sys.argv[3:]:
    for prec in precisions:
        bf16 = prec == "bf16"
        ds = json.loads((presets / name).read_text())
        ds.pop("fluxzero", None)  # the trainer pops it too
        ds.pop("bf16", None)
        ds[prec if prec != "fp32" else "bf16"] = {"enabled": prec != "fp32"}
        ds["steps_per_print"] = 10**9
        stage = ds["zero_optimization"]["stage"]
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=ds, enabled=stage == 3):  # as the trainer builds it
            model = build_model(get_model_config("flux-tiny"), device="cpu")
        eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[prec]
        pred = eng(packing.pack(torch.randn(1, 16, 4, 4)).to(dt), packing.img_ids(1, 4, 4).to(dt),
                   torch.randn(1, 8, 64, dtype=dt), packing.txt_ids(1, 8).to(dt), torch.rand(1, dtype=dt),
                   torch.randn(1, 32, dtype=dt), torch.ones(1, dtype=dt))
        eng.backward(pred.float().pow(2).mean())
        eng.step()  # optimizer states exist only after a step
        d = out / f"{name[:-5]}-{prec}"
        eng.save_checkpoint(str(d), tag="step_00000001", client_state={"step": 1}, save_latest=False)
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        loader = {"epoch": 0, "batches_done": 1, "micro_batch": 1, "world_size": 1, "seed": 0,
                  "data": "0123456789abcdef", "num_samples": 8}
        torch.save({"step": 1, "loader": loader, "rng": rng, "world_size": 1},
                   d / "step_00000001" / "trainer_state_rank0.pt")  # fluxzero's trainer state, same structure
        print(json.dumps({"dir": str(d / "step_00000001"), "stage": stage, "bf16": bf16, "precision": prec,
                          "optimizer": type(eng.optimizer).__name__}), flush=True)
torch.distributed.destroy_process_group()  # a gloo group left to interpreter teardown can abort the process
"""
)


@pytest.mark.slow
def test_every_file_of_real_deepspeed_checkpoints_passes(tmp_path):
    presets = ["zero0.json", "zero1.json", "zero2.json", "zero3.json", "zero2-offload.json", "zero3-offload.json"]
    r = subprocess.run(
        [sys.executable, "-c", _WRITE_CHECKPOINTS, str(ROOT / "ds_configs"), str(tmp_path), *presets],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    runs = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    fp16 = [d for d in runs if d["precision"] == "fp16"]  # where DeepSpeed's accelerator trains fp16
    runs = [d for d in runs if d["precision"] != "fp16"]
    assert sorted((d["stage"], d["bf16"]) for d in runs) == sorted(
        [(s, b) for s in (0, 1, 2, 3) for b in (False, True)] + [(s, b) for s in (2, 3) for b in (False, True)]
    )
    from fluxzero.train.checkpoint.integrity import FLUXZERO_FILES, clean_save_files
    from fluxzero.train.checkpoint.locks import READ_LOCK

    seen = set()
    for run in runs:
        files = sorted(Path(run["dir"]).glob("*.pt"))
        names = {f.name for f in files}
        # DeepSpeed writes exactly the names the resume's stray-file check expects (rank 0 adds the others)
        assert set(os.listdir(run["dir"])) == clean_save_files(run["stage"], run["bf16"], 1, False) - {
            *FLUXZERO_FILES,
            READ_LOCK,
        }, run
        assert "trainer_state_rank0.pt" in names and any("model_states" in n for n in names), names
        if run["stage"] >= 1:
            assert any("optim_states" in n for n in names), names
        for f in files:
            check_checkpoint_file(f)
            found = set(unsafe_globals(f))
            seen |= found
            if hasattr(torch.serialization, "get_unsafe_globals_in_checkpoint"):  # torch >= 2.5
                # our scan lists every global, torch's only those outside its own allow-list: a subset
                assert set(torch.serialization.get_unsafe_globals_in_checkpoint(str(f))) <= found, f
        state = load_trainer_state(Path(run["dir"]) / "trainer_state_rank0.pt")
        assert state["step"] == 1 and state["rng"]["numpy"][0] == "MT19937"
    # the allow-list is what these files hold, nothing more (the rest is named in UNMEASURED_GLOBALS)
    assert seen == MEASURED_GLOBALS, (sorted(seen - MEASURED_GLOBALS), sorted(MEASURED_GLOBALS - seen))
    assert seen <= ALLOWED_GLOBALS
    if fp16:  # fp16 adds exactly FP16_GLOBALS
        seen16 = set().union(*(unsafe_globals(f) for d in fp16 for f in Path(d["dir"]).glob("*.pt")))
        assert seen16 - MEASURED_GLOBALS == FP16_GLOBALS, sorted(seen16 - MEASURED_GLOBALS)
        for f in (f for d in fp16 for f in Path(d["dir"]).glob("*.pt")):
            check_checkpoint_file(f)
    # a resume at another world size reads DeepSpeed's universal checkpoint: its files pass too (~10 s)
    src = next(d["dir"] for d in runs if d["stage"] == 3 and d["bf16"])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            src,
            "--output_folder",
            str(tmp_path / "universal"),
            "--inject_missing_state",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted((tmp_path / "universal").rglob("*.pt"))
    assert any(f.name == "optimizer_state.pt" for f in files) and any(f.name == "exp_avg.pt" for f in files)
    for f in files:
        check_checkpoint_file(f)
