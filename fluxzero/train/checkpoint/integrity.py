"""Whether a checkpoint folder holds what a fluxzero save wrote, intact, judged before anything in it is
unpickled: the names a clean save writes (nothing else may lie beside them), each torch file's CRCs and pickle scan
(safe_files), the `latest` pointer, and each rank's view of the files it will read. Each check answers with a
sentence or None; the callers (the resume decision, export) decide what follows.
"""

from __future__ import annotations

import os
import socket
import zipfile
from pathlib import Path

from fluxzero.config.deepspeed.view import DSView
from fluxzero.train.checkpoint.locks import READ_LOCK


def checkpoint_files(stage: int, bf16: bool, rank: int) -> tuple[list[str], list[str]]:
    """(files only `rank` reads, files every rank reads) of a fluxzero checkpoint folder.

    DeepSpeed 0.19.8's names (engine._get_ckpt_name, _get_rank_zero_ckpt_name) without model parallelism
    (mp rank 00): under ZeRO-3 each rank has its own model states, below it all ranks read one file; from
    stage 1 on each rank has its own optimizer partition ("bf16_" prefix in bf16), at stage 0 the optimizer
    lives in the model states file.
    """
    own = [f"trainer_state_rank{rank}.pt"]
    shared = []
    if stage == 3:
        own.append(f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    else:
        shared.append("mp_rank_00_model_states.pt")
    if stage >= 1:
        own.append(f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return own, shared


FLUXZERO_FILES = ("run.yaml", "ds_config.json")  # rank 0's, besides each rank's trainer state and EMA shard


def clean_save_files(stage: int, bf16: bool, world: int, ema) -> set[str]:
    """Every name a fluxzero save writes into a step folder at this ZeRO stage, precision and world size.

    ema: whether the run had an ema: section (its shards); None when unknown (an older run.yaml), which
    allows them. Measured with real 2-rank saves of flux-tiny at ZeRO 0, 1, 2, 3, 2 and 3 with CPU offload,
    fp32 and bf16, full fine-tunes and LoRA + EMA: the folder holds exactly these names (tests/train/
    test_train_reliability.py's test_a_clean_save_writes_exactly_the_expected_files); DeepSpeed's recovery
    scripts (zero_to_fp32.py, zero_to_torch.py) go one folder up, into checkpoints/.
    """
    from fluxzero.train.ema import shard_name

    names = {*FLUXZERO_FILES, READ_LOCK}
    for rank in range(world):
        own, shared = checkpoint_files(stage, bf16, rank)
        names.update(own, shared)
        if ema or ema is None:
            names.add(shard_name(rank))
    return names


def stray_files_problem(tag_dir: Path, expected, universal: bool = False, advice: str = "") -> str | None:
    """The sentence refusing a step folder that holds a name no clean save writes, or None.

    DeepSpeed's loader finds its files by wildcard (mp_rank_*_model_states.pt, zero_pp_rank_N_mp_rank_*_...)
    and unpickles the first match in sorted order, so a torch file planted beside the intact ones would run its
    code whatever fluxzero checks of the files it expects: nothing in such a folder is loaded. A universal
    checkpoint (DeepSpeed's ds_to_universal, checkpoint.load_universal) has its own tree: there every torch
    file in it, at any depth, must pass the pickle scan instead.
    """
    tag_dir = Path(tag_dir)
    if universal:
        for f in sorted(p for p in tag_dir.rglob("*") if p.is_file() and _loadable(p)):
            if problem := file_problem(f, crc=False):
                return f"checkpoint {tag_dir} is incomplete or corrupt ({problem}); {advice}"
        return None
    try:
        names = sorted(os.listdir(tag_dir))
    except OSError as e:
        return f"cannot list checkpoint {tag_dir} ({e.strerror or e}); {advice}"
    stray = [n for n in names if n not in set(expected) | {READ_LOCK}]  # older checkpoints lack the lock file
    if not stray:
        return None
    more = f" (and {len(stray) - 1} more)" if len(stray) > 1 else ""
    return (
        f"checkpoint {tag_dir} holds {stray[0]}{more}, which no fluxzero save of this run writes (DeepSpeed's "
        f"loader picks its files by name pattern and would unpickle it), so nothing in it is loaded; "
        f"remove it if you know what it is, otherwise {advice or 'use another checkpoint'}"
    )


def _loadable(path: Path) -> bool:
    """Whether torch.load could be handed `path`: a .pt name, or a zip archive or pickle by its first bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return True  # unreadable: the scan says so
    return path.suffix == ".pt" or head == b"PK\x03\x04" or head[:1] == b"\x80"


def latest_problem(ckpt_dir: Path, advice) -> tuple[str | None, str | None]:
    """(tag named by `latest`, None), (None, None) without `latest`, or (None, what is wrong with it).

    advice(ckpt_dir, None): what to do instead, ending the sentence (the resume's or the export's)."""
    latest = ckpt_dir / "latest"
    if not latest.is_file():
        return None, None
    try:
        tag = latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"cannot read {latest} ({getattr(e, 'strerror', None) or e}); {advice(ckpt_dir, None)}"
    if not tag:
        return None, f"{latest} is empty; {advice(ckpt_dir, None)}"
    if "/" in tag or "\\" in tag or not (ckpt_dir / tag).is_dir():
        return None, f"{latest} names {tag!r}, which is not a folder in {ckpt_dir}; {advice(ckpt_dir, None)}"
    return tag, None


def rank_checkpoint_problem(v: DSView, ckpt_dir: Path, tag: str, rank: int, advice: str) -> str | None:
    """This rank's view of the checkpoint rank 0 chose: the folder, then the files it reads, then their CRCs.

    The files every rank reads (the model states below ZeRO-3) are CRC-checked once per node (local rank 0),
    the rest by the rank that reads them. CRC-checking reads the whole file, at about the speed of
    torch.load of the same file. advice ends the sentence of a refusal.
    """
    tag_dir = ckpt_dir / tag
    if not tag_dir.is_dir():
        return (
            f"rank {rank} (host {socket.gethostname()}) cannot see {tag_dir}, the checkpoint rank 0 resumes "
            f"from; output_dir must be on a filesystem all nodes share (or hold identical copies on every "
            f"node)"
        )
    own, shared = checkpoint_files(v.stage, v.precision == "bf16", rank)
    if v.load_universal:  # DeepSpeed reads the universal layout itself
        own, shared = own[:1], []
    mine = own + (shared if int(os.environ.get("LOCAL_RANK", "0")) == 0 else [])
    for name in own + shared:
        problem = file_problem(tag_dir / name, crc=name in mine)
        if problem:
            return f"checkpoint {tag_dir} is incomplete or corrupt ({problem}); {advice}"
    return None


def file_problem(path: Path, crc: bool = True) -> str | None:
    """What makes a torch.save file unusable, in a few words (missing, truncated, overwritten), or None.

    torch.save writes a zip archive with a CRC-32 for every record, which torch.load never checks: a file
    overwritten in place with its size unchanged loads silently. testzip() reads every record and compares.
    """
    if not path.is_file():
        return f"{path.name} is missing"
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip() if crc else None
    except Exception:  # zipfile raises BadZipFile, EOFError, struct.error, ... for damaged archives
        return f"{path.name} is not a complete torch file"
    if bad:
        return f"{path.name} fails its CRC-32 check in {bad}"
    from fluxzero.train.checkpoint import safe_files

    # before anything unpickles it: torch.load and DeepSpeed's loads would run code that a crafted file names
    try:
        bad = [g for g in safe_files.unsafe_globals(path) if g not in safe_files.ALLOWED_GLOBALS]
    except (OSError, ValueError):
        return f"{path.name} is not a torch file fluxzero can read"
    if bad:
        return (
            f"{path.name} holds Python code references ({', '.join(bad[:3])}), which no fluxzero or DeepSpeed "
            f"checkpoint holds, so it is not loaded"
        )
    return None


def unreadable_files(tag_dir: Path) -> list[str]:
    """Names of the checkpoint folder's torch files that are truncated, overwritten or otherwise damaged."""
    return [f.name for f in sorted(Path(tag_dir).glob("*.pt")) if file_problem(f)]
