"""No file that fluxzero reads may run code: checkpoint files are checked before they are unpickled.

torch.load(weights_only=False), which the trainer and DeepSpeed's own checkpoint loads use, unpickles: a
`trainer_state_rank0.pt` or `mp_rank_00_model_states.pt` replaced by a crafted pickle runs whatever that
pickle imports and calls. A pickle can only reach code through a global (module + name) it imports, so
`check_checkpoint_file` lists the globals a torch.save file would import WITHOUT unpickling it and refuses
any that fluxzero's and DeepSpeed's checkpoints do not hold (`ALLOWED_GLOBALS`, below).

Why an opcode scan of our own (pickletools) and not torch's weights_only loading or
torch.serialization.get_unsafe_globals_in_checkpoint:
- weights_only=True cannot be the loader: DeepSpeed's own checkpoint loads call torch.load(weights_only=False)
  themselves, and their files hold globals outside torch's allow-list (DeepSpeed's ZeroStageEnum, LossScaler,
  fragment_address; numpy's RNG state), so they fail a weights_only load. It is used where fluxzero loads a file
  itself (load_trainer_state).
- get_unsafe_globals_in_checkpoint fails on some valid pickles (protocol 4's MEMOIZE: "Unsupported operand 149"),
  so a refusal could not say what the file imports; it reads only data.pkl of a zip (a payload in a second record
  goes unseen); it is missing from torch 2.4 (setup.cfg allows torch>=2.4); and its answer depends on what any
  code in the process added with add_safe_globals.
pickletools parses every protocol; the scan below tracks the string arguments of STACK_GLOBAL through the memo
and refuses what it cannot resolve, so the list it returns is complete. The pickle bytes are taken from torch's
own zip reader (the one torch.load uses) as well as Python's zipfile, so a zip built to show the two readers
different records cannot hide a payload from the scan.

A scan covers the files fluxzero hands DeepSpeed, but DeepSpeed finds some of its files by wildcard and
unpickles the first match: integrity.stray_files_problem refuses a step folder holding any name a clean save
does not write, so every torch file a load can reach is one of the scanned ones.

Torch only: no deepspeed import, so the export command and tests use it without starting DeepSpeed.
"""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path

# Every global in every .pt file that DeepSpeed writes under deepspeed.initialize at ZeRO 0, 1, 2 and 3 (and
# the CPU-offload presets), in fp32 and bf16, and in fluxzero's trainer state; tests/train/test_safe_files.py's
# checkpoint script saves them and asserts that this set is exactly what those files hold. The files of
# DeepSpeed's universal checkpoint (ds_to_universal, for a resume at another world size) hold a subset of it.
MEASURED_GLOBALS = frozenset(
    {
        "torch._utils._rebuild_tensor_v2",  # every tensor
        "torch._tensor._rebuild_from_type_v2",
        "torch.Tensor",  # ZeRO-3 optimizer states: a tensor with attributes
        "torch.FloatStorage",
        "torch.BFloat16Storage",  # tensor data of each dtype
        "torch.ByteStorage",  # torch's RNG state (uint8)
        "torch.Size",  # shapes (param_shapes, ...)
        "collections.OrderedDict",  # state dicts
        "deepspeed.runtime.zero.config.ZeroStageEnum",  # ZeRO optimizer states: "zero_stage"
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",  # ZeRO optimizer states: the (static) loss scaler
        "deepspeed.utils.tensor_fragment.fragment_address",  # ZeRO-1/2 optimizer states: parameter slices
        "numpy._core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",  # numpy RNG state (an ndarray)
        "_codecs.encode",  # ... whose bytes numpy pickles as a latin-1 string
    }
)
# fp16 runs, where DeepSpeed's accelerator trains fp16 (a GPU, or a CPU with AVX512-FP16):
# the ZeRO optimizer states hold a DynamicLossScaler and name the fp16 dtype, the model states float16 tensors.
FP16_GLOBALS = frozenset(
    {
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "torch.HalfStorage",
        "torch.float16",
    }
)
# fluxzero's optimizer modes: adamw8bit-sr saves each 8-bit state as its plain parts and its dtype
# (optim.state._pack), so its files name the bf16 dtype (tests/train/test_train_optim_modes.py resumes and exports
# them). A dtype is a constant, not code.
OPTIMIZER_MODE_GLOBALS = frozenset({"torch.bfloat16"})
# Not measurable here: numpy < 2 (setup.cfg pins no numpy) names the same ndarray constructor
# numpy.core.multiarray._reconstruct.
UNMEASURED_GLOBALS = frozenset({"numpy.core.multiarray._reconstruct"})
ALLOWED_GLOBALS = MEASURED_GLOBALS | FP16_GLOBALS | OPTIMIZER_MODE_GLOBALS | UNMEASURED_GLOBALS

_UNRESOLVED = "<a computed import>"  # STACK_GLOBAL whose module or name is not a literal string
_MARK = object()
_UNKNOWN = object()
_STRING_OPS = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}


def _pickle_globals(data: bytes) -> set[str]:  # noqa: C901
    """Every "module.name" the pickle `data` imports, from its opcodes alone (it is never unpickled).

    A small stack machine follows what pickletools reports about each opcode's stack effect, keeping only
    literal strings (and memo copies of them), because STACK_GLOBAL takes its module and name off the stack.
    A module or name that is not such a string, an extension-registry code (EXT1/2/4) or a malformed pickle
    yields an entry that no allow-list holds, so the file is refused rather than misread.
    """
    found: set[str] = set()
    stack: list = []
    memo: dict = {}

    def pop_to_mark():
        while stack:
            if stack.pop() is _MARK:
                return
        raise ValueError("MARK missing")

    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name in _STRING_OPS:
                stack.append(arg.decode("latin-1") if isinstance(arg, bytes) else arg)
            elif name in ("GLOBAL", "INST"):  # arg: "module name"
                found.add(".".join(str(arg).split(" ", 1)))
                if name == "INST":
                    pop_to_mark()
                stack.append(_UNKNOWN)
            elif name == "STACK_GLOBAL":
                name_, module = stack.pop(), stack.pop()
                ok = isinstance(module, str) and isinstance(name_, str)
                found.add(f"{module}.{name_}" if ok else _UNRESOLVED)
                stack.append(_UNKNOWN)
            elif name in ("EXT1", "EXT2", "EXT4"):
                found.add(f"<extension registry code {arg}>")
                stack.append(_UNKNOWN)
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo.get(arg, _UNKNOWN))
            elif name == "DUP":
                stack.append(stack[-1])
            elif name == "MARK":
                stack.append(_MARK)
            else:  # generic effect: pops what stack_before lists (a markobject pops through the mark)
                before = op.stack_before
                if pickletools.markobject in before:
                    pop_to_mark()
                    before = before[: before.index(pickletools.markobject)]
                for _ in before:
                    stack.pop()
                stack.extend(_UNKNOWN for _ in op.stack_after)
    except (ValueError, IndexError, KeyError, EOFError, UnicodeDecodeError) as e:
        found.add(f"<unreadable pickle: {type(e).__name__}>")
    return found


def _pickles(path: Path) -> list[bytes]:
    """The pickle records torch.load could unpickle from the zip archive `path` (ValueError if not one)."""
    # torch.load takes a file for a zip archive by its first four bytes and unpickles anything else from the
    # start; zipfile.is_zipfile looks at the end, so it would pass a pickle with a zip appended to it
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04" or not zipfile.is_zipfile(path):
            raise ValueError(f"{path} is not a zip-format torch.save file")
    out = []
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        if any(n.endswith("constants.pkl") or "/code/" in n for n in names):
            raise ValueError(f"{path} is a TorchScript archive, which torch.load would run as a program")
        out += [z.read(n) for n in names if n.endswith(".pkl")]
    try:  # torch's own reader: exactly the record torch.load unpickles
        import torch

        reader = torch._C.PyTorchFileReader(str(path))
        out.append(reader.get_record("data.pkl"))
    except (AttributeError, RuntimeError):  # torch cannot open it: torch.load could not either
        pass
    if not out:
        raise ValueError(f"{path} holds no data.pkl record")
    return out


def unsafe_globals(path) -> list[str]:
    """Globals the torch.save file `path` would import when unpickled, sorted, WITHOUT unpickling it.

    All of them, torch's own included (compare with ALLOWED_GLOBALS, or use check_checkpoint_file).
    ValueError if `path` is not a zip-format torch.save file (the legacy format and TorchScript are refused).
    """
    found: set[str] = set()
    for data in _pickles(Path(path)):
        found |= _pickle_globals(data)
    return sorted(found)


def check_checkpoint_file(path) -> None:
    """Raise ValueError (one sentence) unless every global in the torch.save file `path` is in ALLOWED_GLOBALS.

    Call before torch.load(weights_only=False) or a DeepSpeed load of the file: the check reads only the
    pickle records (kilobytes of a checkpoint), never the tensor data, and imports nothing.
    """
    path = Path(path)
    advice = "it was not written by fluxzero or DeepSpeed; delete it and resume from another checkpoint"
    try:
        found = unsafe_globals(path)
    except OSError as e:
        raise ValueError(
            f"checkpoint file {path} cannot be read ({e.strerror or e}); resume from another checkpoint"
        ) from None
    except ValueError as e:
        raise ValueError(f"{e}, so fluxzero does not load it: {advice}") from None
    bad = [g for g in found if g not in ALLOWED_GLOBALS]
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ValueError(
            f"checkpoint file {path} holds Python code references ({shown}); fluxzero does not load "
            f"such files: {advice}"
        )


def _numpy_safe_globals() -> list:
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    import codecs

    out = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    # not a global of the pickle, but torch's unpickler checks the class of what it BUILDs: the uint32
    # dtype's state is set on a numpy.dtypes.UInt32DType (numpy >= 1.25 has that module)
    if getattr(np, "dtypes", None) is not None:
        out.append(np.dtypes.UInt32DType)
    return out


def load_trainer_state(path) -> dict:
    """fluxzero's own trainer state (step, loader position, RNG states) with torch.load(weights_only=True).

    numpy's RNG state, as np.random.get_state() returns it, is an ndarray: the four globals it pickles
    (numpy's array constructor, ndarray, dtype and _codecs.encode for its bytes) are allow-listed for this
    load, so every trainer state already written resumes; storing the RNG state as plain lists instead would
    need the writer changed and would still leave the old files to read this way. weights_only=True is
    torch's restricted unpickler: nothing outside torch's tensor types, plain containers and these names
    can be imported, whatever the file holds.
    """
    import torch

    check_checkpoint_file(path)
    extra = _numpy_safe_globals()
    if hasattr(torch.serialization, "safe_globals"):  # torch >= 2.5: for this load only
        with torch.serialization.safe_globals(extra):
            return torch.load(path, map_location="cpu", weights_only=True)
    torch.serialization.add_safe_globals(extra)  # torch 2.4: process-wide, and only these harmless names
    return torch.load(path, map_location="cpu", weights_only=True)
