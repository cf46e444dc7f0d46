"""The package's import graph, read from the source with `ast` (nothing is imported): no cycles, no import against
the layer order, every name imported from the module that defines it, and no private name across a package boundary.

Layers, lowest first (a module may import its own layer and lower ones):
  0  top-level utilities (fluxzero/fsutil.py, ...)
  1  config, cluster      pure Python
  2  plan                 pure Python: the memory planner, which reads the run and DeepSpeed configs
  3  model, data          torch
  4  sampling, train
  5  commands
  6  cli
Inside a layer, a package's subsystem folders are ordered too (ROOMS): in train, the optimizers know nothing of
checkpoints, checkpoints nothing of export, and nothing imports the loop; train's other modules sit between. In
config, the run file's modules know nothing of the DeepSpeed config (deepspeed/).
Function-level imports count like module-level ones: the house imports heavy dependencies (torch, deepspeed,
diffusers) inside command bodies, never its own modules to dodge a cycle, so an import inside a function is a
dependency all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fluxzero"
LAYERS = {
    "config": 1,
    "cluster": 1,
    "plan": 2,
    "model": 3,
    "data": 3,
    "sampling": 4,
    "train": 4,
    "commands": 5,
    "cli": 6,
}
# package -> {room (its first name below the package): rank}; a room not named has DEFAULT_ROOM
ROOMS = {"train": {"optim": 0, "checkpoint": 1, "export": 2, "loop": 3}, "config": {"deepspeed": 2}}
DEFAULT_ROOM = 1
OTHER_SOURCES = ("tests", "benchmarks", "launch")  # they import the package too: no names through re-exports


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], 0) if len(parts) > 1 else 0


def _room(module: str) -> tuple[str, int] | None:
    """(package, rank) of a module inside a package with ordered rooms, else None."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] not in ROOMS:
        return None
    return parts[1], ROOMS[parts[1]].get(parts[2], DEFAULT_ROOM)


def _is_package(module: str) -> bool:
    return module in MODULES and MODULES[module].name == "__init__.py"


def _absolute(node: ast.ImportFrom, module: str, path: Path) -> str:
    if not node.level:
        return node.module
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path, module: str | None):
    """(line, imported fluxzero module, name or None) for every import in the file, at any depth."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "fluxzero":
                    yield node.lineno, a.name, None
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, path) if module else node.module
            if base and base.split(".")[0] == "fluxzero":
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    yield (node.lineno, sub, None) if sub in MODULES else (node.lineno, base, a.name)


def _edges() -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}."""
    edges = {}
    for module, path in MODULES.items():
        for line, target, _ in _imports(path, module):
            while target not in MODULES and "." in target:  # `import fluxzero.x.y` of a name: its module
                target = target.rsplit(".", 1)[0]
            if target != module:
                edges.setdefault(module, {}).setdefault(target, line)
    return edges


def _cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm), sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on_stack.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(set(edges) | {w for targets in edges.values() for w in targets}):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    edges = _edges()
    cycles = _cycles(edges)
    described = []
    for comp in cycles:
        inside = [f"{a} -> {b} (line {line})" for a in comp for b, line in edges.get(a, {}).items() if b in comp]
        described.append("; ".join(inside))
    assert not cycles, "import cycles (function-level imports count): " + " | ".join(described)


def test_no_import_against_the_layer_order():
    upward = [
        f"{a}:{line} imports {b} (layer {_layer(b)} > {_layer(a)})"
        for a, targets in _edges().items()
        for b, line in targets.items()
        if _layer(b) > _layer(a)
    ]
    assert not upward, "lower layers must not import higher ones: " + "; ".join(upward)


def _against_the_rooms(edges: dict[str, dict[str, int]]) -> list[str]:
    out = []
    for a, targets in edges.items():
        for b, line in targets.items():
            ra, rb = _room(a), _room(b)
            if ra and rb and ra[0] == rb[0] and rb[1] > ra[1]:
                out.append(f"{a}:{line} imports {b} (room rank {rb[1]} > {ra[1]})")
    return out


def test_no_import_against_the_room_order():
    wrong = _against_the_rooms(_edges())
    assert not wrong, "a subsystem must not import a later one of its package (ROOMS): " + "; ".join(wrong)


def _borrowed(module: str) -> set[str]:
    """Names a module binds at top level by importing them from another fluxzero module: what others could
    import through it. Empty for a package: its __init__ is its public face and may gather its submodules' names."""
    if _is_package(module):
        return set()
    path = MODULES[module]
    names = set()

    def scan(body):
        for node in body:
            if isinstance(node, ast.ImportFrom):
                base = _absolute(node, module, path)
                if base and base.split(".")[0] == "fluxzero":
                    names.update(a.asname or a.name for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                scan(node.body + node.orelse + getattr(node, "finalbody", []))
                for h in getattr(node, "handlers", []):
                    scan(h.body)

    scan(ast.parse(path.read_text()).body)
    return names


def _sources():
    yield from ((path, module) for module, path in MODULES.items())
    for folder in OTHER_SOURCES:
        yield from ((path, None) for path in sorted((ROOT / folder).rglob("*.py")))


def _module_aliases(tree: ast.Module, path: Path, module: str | None) -> dict[str, str]:
    """Local name -> the fluxzero module it is bound to (`from fluxzero.x import mod`, `import fluxzero.x as m`)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update((a.asname, a.name) for a in node.names if a.asname and a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):  # `from fluxzero.x import mod`, `from . import mod as M`
            base = _absolute(node, module, path) if module else node.module
            aliases.update(
                (a.asname or a.name, f"{base}.{a.name}") for a in node.names if base and f"{base}.{a.name}" in MODULES
            )
    return aliases


def test_names_are_imported_from_the_module_that_defines_them():
    """No re-export shims: `from fluxzero.config.deepspeed.build import check` where `check` lives in ds_check, or
    `ds_config.check`, would keep two spellings of one name alive."""
    borrowed = {m: _borrowed(m) for m in MODULES}
    wrong = []
    for path, module in _sources():
        where = path.relative_to(ROOT)
        for line, target, name in _imports(path, module):
            if name is not None and name in borrowed.get(target, ()):
                wrong.append(f"{where}:{line} imports {name} from {target}, which imports it from elsewhere")
        tree = ast.parse(path.read_text())
        aliases = _module_aliases(tree, path, module)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                target = aliases[node.value.id]
                if node.attr in borrowed[target] and f"{target}.{node.attr}" not in MODULES:
                    wrong.append(
                        f"{where}:{node.lineno} reads {node.value.id}.{node.attr}, which {target} imports "
                        f"from elsewhere"
                    )
    assert not wrong, "import each name from where it lives: " + "; ".join(sorted(set(wrong)))


def _package(module: str) -> str:
    return module if _is_package(module) else module.rsplit(".", 1)[0]


def _private_across(path: Path, module: str | None) -> list[str]:
    """`line module._name` for each private name of a fluxzero module that `path` imports, or reads as an attribute
    of the module, from another package (a subpackage is another package; scripts belong to none)."""

    def foreign(target: str, name: str) -> bool:
        private = name.startswith("_") and not name.startswith("__")
        return private and target in MODULES and (module is None or _package(target) != _package(module))

    found = [(line, target, name) for line, target, name in _imports(path, module) if name and foreign(target, name)]
    tree = ast.parse(path.read_text())
    aliases = _module_aliases(tree, path, module)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, base = [], node.value  # fluxzero.x.y._z or mod._z: the module the attribute is read from
        while isinstance(base, ast.Attribute):
            chain.insert(0, base.attr)
            base = base.value
        if isinstance(base, ast.Name) and (base.id in aliases or base.id == "fluxzero"):
            target = ".".join([aliases.get(base.id, base.id), *chain])
            if foreign(target, node.attr):
                found.append((node.lineno, target, node.attr))
    return [f"{line} {target}.{name}" for line, target, name in sorted(set(found))]


def test_no_private_name_crosses_a_package_boundary():
    """A `_name` is its package's own: another package (or a benchmark, or launch/) asks for a public name instead.
    Tests may reach the private helpers of the module they test."""
    wrong = [
        f"{path.relative_to(ROOT)}:{hit}"
        for path, module in _sources()
        if path.relative_to(ROOT).parts[0] != "tests"
        for hit in _private_across(path, module)
    ]
    assert not wrong, "private names used outside their package (make them public, or move them): " + "; ".join(wrong)


def test_every_import_names_a_module_that_exists():
    """A moved module leaves no import of its old path behind (relative and function-level imports too)."""
    missing = [
        f"{path.relative_to(ROOT)}:{line} imports {target}, which is not a module of the package"
        for path, module in _sources()
        for line, target, _ in _imports(path, module)
        if target not in MODULES
    ]
    assert not missing, "; ".join(missing)


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path):
    """The graph reader finds what it must (a test that cannot fail is a defect)."""
    assert _cycles(
        {
            "fluxzero.a": {"fluxzero.b": 1},
            "fluxzero.b": {"fluxzero.c": 1},
            "fluxzero.c": {"fluxzero.a": 1},
            "fluxzero.d": {"fluxzero.a": 1},
        }
    ) == [["fluxzero.a", "fluxzero.b", "fluxzero.c"]]
    assert _cycles({"fluxzero.a": {"fluxzero.b": 1}}) == []
    assert (
        _layer("fluxzero.cli")
        > _layer("fluxzero.commands.train")
        > _layer("fluxzero.train.loop")
        > _layer("fluxzero.model.flux")
        > _layer("fluxzero.plan.fit")
        > _layer("fluxzero.config.run")
        > _layer("fluxzero.fsutil")
    )
    assert _layer("fluxzero.sampling.sampler") == _layer("fluxzero.train.flow")
    for package, rooms in ROOMS.items():  # each named room exists: a renamed folder must not leave its rank behind
        for room in rooms:
            assert f"fluxzero.{package}.{room}" in MODULES, room
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import fluxzero.data.encode\n"
        "from fluxzero.data import encode as E\n"
        "from fluxzero.data.encode import _read_json, check_model_folder\n"
        "from fluxzero.sampling.images import _private_probe\n"
        "E._read_json, fluxzero.data.encode._read_json, E.__name__, E.check_model_folder\n"
    )
    assert _private_across(probe, "fluxzero.sampling.probe") == [
        "3 fluxzero.data.encode._read_json",
        "5 fluxzero.data.encode._read_json",
    ]
    assert len(_private_across(probe, None)) == 3  # a script belongs to no package
    assert _against_the_rooms(
        {
            "fluxzero.train.optim.optimizers": {"fluxzero.train.checkpoint.store": 1},
            "fluxzero.train.export.full": {"fluxzero.train.loop": 2},
            "fluxzero.train.loop": {"fluxzero.train.export.full": 3},
        }
    ) == [
        "fluxzero.train.optim.optimizers:1 imports fluxzero.train.checkpoint.store (room rank 1 > 0)",
        "fluxzero.train.export.full:2 imports fluxzero.train.loop (room rank 3 > 2)",
    ]
