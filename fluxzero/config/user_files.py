"""Reading a file the user names (the run file, the DeepSpeed JSON, a hostfile): each way it can be unreadable is one
sentence that names the file and says what to pass instead. Pure Python.
"""
from __future__ import annotations

import os
from pathlib import Path


def read_text(path: str | os.PathLike, what: str, fix: str, error: type[Exception], missing: str | None = None) -> str:
    """The text of `path`, or `error(sentence)` when it does not exist, is a folder, is not text or is unreadable.

    `what` names the file for the reader ("run file"), `fix` says what to pass instead; `missing`, when given,
    is said instead of `fix` for a file that does not exist (how to make one).
    """
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist; {missing or fix}") from None
    except IsADirectoryError:
        raise error(f"{what} {path} is a folder; {fix}") from None
    except UnicodeDecodeError:
        raise error(f"{what} {path} is not a text file; {fix}") from None
    except OSError as e:
        raise error(f"cannot read {what} {path} ({e.strerror or e}); {fix}") from None
