"""Reading a file the user names (the run file, the DeepSpeed JSON, a hostfile): each way it can be unreadable is one
sentence that names the file and says what to pass instead. Also the one JSON reader (parse_json) and the one YAML
reader (parse_yaml) of every file fluxzero is given, bounded in nesting and YAML alias expansion, and `excerpt`,
the bounded quote of a value in an error message. Pure Python (json, yaml and reprlib imported inside the calls).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def check_regular(path: str | os.PathLike, what: str, fix: str, error, missing: str | None = None) -> None:
    """`error(sentence)` unless `path` is a regular file: missing, a folder, or a pipe, socket or device (opening a
    FIFO waits for a writer that may never come). `what`, `fix` and `missing` as for `read_text`."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist; {missing or fix}") from None
    except OSError as e:
        raise error(f"cannot read {what} {path} ({e.strerror or e}); {fix}") from None
    if stat.S_ISDIR(mode):
        raise error(f"{what} {path} is a folder; {fix}")
    if not stat.S_ISREG(mode):
        raise error(f"{what} {path} is not a regular file (a pipe, socket or device); {fix}")


def read_text(path: str | os.PathLike, what: str, fix: str, error: type[Exception], missing: str | None = None) -> str:
    """The text of `path`, or `error(sentence)` when it does not exist, is a folder, a pipe or device, is not text
    or is unreadable.

    `what` names the file for the reader ("run file"), `fix` says what to pass instead; `missing`, when given,
    is said instead of `fix` for a file that does not exist (how to make one).
    """
    check_regular(path, what, fix, error, missing)
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


# Deeper than any file fluxzero reads or writes needs; far below Python's recursion limit, so neither a parser nor
# code walking what it returned ever meets a RecursionError.
MAX_DEPTH = 64
# Nodes a YAML document may expand to through its aliases (a run file has a few hundred): an "alias bomb" of a few
# hundred bytes otherwise expands to billions when a value is printed or copied.
MAX_YAML_NODES = 100_000
_EXCERPT = 80


class ParseError(ValueError):
    """Text that is not valid JSON or YAML, or nested or aliased beyond what fluxzero reads; the message is the
    parser's cause with its line and column, bounded in length. Callers put it in their one sentence."""


def excerpt(value, limit: int = _EXCERPT) -> str:
    """`repr(value)` cut to about `limit` characters ("..." where cut), without building the whole repr: what an
    error message quotes of a value the user gave (a value from a file can be megabytes long)."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 3, limit, limit
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = r.maxfrozenset = 6
    text = r.repr(value)
    return text if len(text) <= limit + 20 else text[:limit] + "..."


def _too_deep(obj) -> bool:
    """Whether `obj` (lists and dicts, as a parser returns them) nests more than MAX_DEPTH levels (no recursion)."""
    todo = [(obj, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (dict, list)):
            if depth > MAX_DEPTH:
                return True
            todo.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


def parse_json(text: str | bytes, **kw):
    """json.loads(text, **kw), the one JSON reader of files fluxzero is given; ParseError (a ValueError) for
    invalid JSON (its cause, line and column), nesting deeper than MAX_DEPTH, or bytes that are not UTF-8."""
    import json

    try:
        obj = json.loads(text, **kw)
    except json.JSONDecodeError as e:
        raise ParseError(f"{excerpt(e.msg)[1:-1]} at line {e.lineno}, column {e.colno}") from None
    except RecursionError:
        raise ParseError(f"nested more than {MAX_DEPTH} levels deep") from None
    except UnicodeDecodeError:
        raise ParseError("not UTF-8 text") from None
    if _too_deep(obj):
        raise ParseError(f"nested more than {MAX_DEPTH} levels deep")
    return obj


def _yaml_loader(unique_keys: bool):
    """A yaml.SafeLoader bounded in nesting (MAX_DEPTH) and alias expansion (MAX_YAML_NODES); with `unique_keys`,
    a key given twice in one mapping is an error (plain YAML keeps the last silently)."""
    import yaml
    from yaml.composer import ComposerError

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            self._depth = getattr(self, "_depth", 0) + 1
            try:
                if self._depth > MAX_DEPTH:
                    raise ComposerError(
                        None, None, f"nested more than {MAX_DEPTH} levels deep", self.peek_event().start_mark
                    )
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def compose_document(self):
            node = super().compose_document()
            if _expanded_nodes(node) > MAX_YAML_NODES:
                raise ComposerError(
                    None, None, f"its aliases (*name) expand to more than {MAX_YAML_NODES} values", node.start_mark
                )
            return node

    if unique_keys:

        def mapping(loader, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = loader.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {excerpt(key)} appears twice (keep one), the second time", key_node.start_mark
                    )
                seen.add(key)
            return loader.construct_mapping(node, deep)

        Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Loader


def _expanded_nodes(root) -> int:
    """How many nodes the composed YAML `root` stands for with every alias written out (each node once, shared
    nodes counted at every use); no recursion, so a deep or recursive document cannot exhaust the stack."""
    size: dict[int, int] = {}
    open_nodes: set[int] = set()
    todo = [(root, False)]
    while todo:
        node, children_done = todo.pop()
        if id(node) in size:
            continue
        if not children_done and id(node) in open_nodes:  # an alias inside its own anchor: endless
            return MAX_YAML_NODES + 1
        kids = node.value if isinstance(node.value, list) else []
        kids = [n for kid in kids for n in (kid if isinstance(kid, tuple) else (kid,))]
        if children_done:
            size[id(node)] = 1 + sum(size.get(id(k), MAX_YAML_NODES + 1) for k in kids)
            if size[id(node)] > MAX_YAML_NODES:
                return size[id(node)]
            continue
        open_nodes.add(id(node))
        todo.append((node, True))
        todo.extend((k, False) for k in kids if id(k) not in size)
    return size.get(id(root), 0)


def parse_yaml(text: str, unique_keys: bool = False):
    """yaml.safe_load(text), the one YAML reader of files fluxzero is given; ParseError (a ValueError) naming
    PyYAML's problem, line and column (bounded), or nesting / alias expansion beyond what fluxzero reads."""
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader(unique_keys))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(e.problem or e.context or "").split())
        raise ParseError(f"{problem[:160]}{where}") from None
    except yaml.YAMLError as e:
        raise ParseError(" ".join(str(e).split())[:160]) from None
    except RecursionError:
        raise ParseError(f"nested more than {MAX_DEPTH} levels deep") from None
