"""What every run-file section shares (stdlib only): the did-you-mean of a refused unknown key, the field type
check, the mapping a section is read from."""

from __future__ import annotations

import dataclasses
import os

from fluxzero.config.user_files import excerpt


def did_you_mean(unknown, names) -> str:
    """' (did you mean 'rank' for 'rnak'?)' for the unknown keys with a close valid name, else ''."""
    import difflib

    hints = [
        f"{excerpt(m[0])} for {excerpt(k)}"
        for k in unknown
        if (m := difflib.get_close_matches(str(k), sorted(map(str, names)), n=1, cutoff=0.6))
    ]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def and_list(words: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def check_types(obj, prefix: str = "") -> None:
    """Each field of a run-file dataclass has the type its annotation names (YAML gives `steps: abc` a str,
    `resume: maybe` a str that would read as true); ints are accepted where a float is expected. Sets through
    object.__setattr__, so frozen sections are normalised the same way."""
    for f in dataclasses.fields(obj):
        value, kind = getattr(obj, f.name), str(f.type)
        if value is None and "None" in kind:
            continue
        if kind.startswith("int"):
            ok, want = isinstance(value, int) and not isinstance(value, bool), "a whole number"
        elif kind.startswith("float"):
            ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
            if ok:
                object.__setattr__(obj, f.name, float(value))
        elif kind.startswith("bool"):
            ok, want = isinstance(value, bool), "true or false"
        elif kind.startswith("str"):
            if isinstance(value, os.PathLike):  # Python callers may pass paths
                value = os.fspath(value)
                object.__setattr__(obj, f.name, value)
            ok, want = isinstance(value, str), "text" + (" or null" if "None" in kind else "")
        else:
            continue
        if not ok:
            raise ValueError(f"{prefix}{f.name} must be {want}, got {excerpt(value)}")


def section_from_dict(cls, name: str, d):
    """Section `name` of a run file as `cls`: a mapping of its keys (unknown ones refused with a did-you-mean and
    the valid keys), or null / absent for its defaults."""
    if d is None:
        return cls()
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(d, dict):
        raise ValueError(f"{name} must be a mapping of {name} options ({', '.join(names)}), got {excerpt(d)}")
    unknown = sorted(set(map(str, d)) - set(names))
    if unknown:
        raise ValueError(f"unknown {name} keys {unknown}{did_you_mean(unknown, names)}; valid keys: {', '.join(names)}")
    return cls(**d)
