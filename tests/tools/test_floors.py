"""The Python package's floors: every module of python/mgpu sits on one floor of FLOORS, and an
import (at the top of a file or inside a function) points to the module's own floor or one below,
never up; the import graph has no cycle; no name starting with one underscore is imported from
another module or read through it (``ops._pair``), but for the few in KNOWN_PRIVATE. Read from the
sources with ``ast``, nothing is imported."""
import ast
import functools
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python",
                       "mgpu")

# Bottom to top. A module imports from its own floor or the floors below it.
FLOORS = [
    ("engine", ["mgpu._core", "mgpu._startup", "mgpu.engine"]),
    # Leaves on the engine: devices, the timeline's spans, the fault-injection hook, d2l's plots.
    # The table of environment variables and the safetensors format's reader and writer too.
    ("base", ["mgpu.device", "mgpu.trace", "mgpu.faults", "mgpu.plot", "mgpu.environment",
              "mgpu.tensorfile"]),
    ("tensor", ["mgpu.amp", "mgpu.autograd", "mgpu.tensor", "mgpu.random"]),
    # Weights from other frameworks (state dicts) and gradient clipping work on tensors alone.
    ("tensor utilities", ["mgpu.weights", "mgpu.nn_utils"]),
    ("ops", ["mgpu.ops", "mgpu.distributed"]),
    ("modules", ["mgpu.nn", "mgpu.optim"]),
    # What the loops build on: networks, the data-parallel wrappers and the fused step's layer
    # list, data and checkpoints.
    ("parallel", ["mgpu.models", "mgpu.parallel", "mgpu.fused_spec", "mgpu.data_parallel",
                  "mgpu.data", "mgpu.checkpoint"]),
    # The loops and the scaffolding they share (epochs, checkpoints, metrics log, preemption).
    ("loops", ["mgpu.loop", "mgpu.train", "mgpu.chapter"]),
    ("tools", ["mgpu.cli", "mgpu.bench", "mgpu.advisor"]),
    # The package itself (mgpu/__init__.py imports every floor) and python -m mgpu.
    ("package", ["mgpu", "mgpu.__main__"]),
]


# Private names one module still reads through another, each with why it is left: (reader, the
# module read, name). A new one fails the test.
KNOWN_PRIVATE = {
    # The engine's binding (cpp/bind) of the stream a DLPack producer is asked to order work on.
    ("mgpu.tensor", "mgpu._core", "_dlpack_stream"),
}


def floor_of(module: str, floors=FLOORS) -> int:
    """The floor of ``module``: its own entry, else its package's (mgpu.bench.train is on
    mgpu.bench's floor); KeyError for a module the table does not place."""
    table = {m: i for i, (_, mods) in enumerate(floors) for m in mods}
    name = module
    while name not in table and "." in name:
        name = name.rsplit(".", 1)[0]
    if name not in table or (name == "mgpu" and module != "mgpu"):
        raise KeyError(module)
    return table[name]


def modules(root: str = PACKAGE) -> dict:
    """{dotted name: source} of every .py file under ``root``, plus the engine (_core, its .pyi)."""
    out = {"mgpu._core": ""}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), os.path.dirname(root))[:-3]
                name = rel.replace(os.sep, ".")
                name = name[: -len(".__init__")] if name.endswith(".__init__") else name
                with open(os.path.join(d, f)) as fh:
                    out[name] = fh.read()
    return out


@functools.lru_cache(maxsize=None)
def _parse(source: str) -> ast.Module:
    return ast.parse(source)


# Names that stand for a module: mgpu.engine's ``core`` is the compiled engine, mgpu._core, so a
# private name read through ``from .engine import core as _core`` is seen as read from it.
MODULE_NAMES = {("mgpu.engine", "core"): "mgpu._core"}


def _bindings(name: str, node, mods: dict):
    """(module imported, name imported from it or None, local name) for each alias of an import
    node of module ``name``; ``from m import x`` imports module m.x when that is a module, else
    name x of m. Imports of other packages are skipped."""
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name in mods:
                yield a.name, None, a.asname or a.name.split(".")[0]
        return
    if node.level:
        is_pkg = name == "mgpu" or any(k.startswith(name + ".") for k in mods)
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        src = ".".join(base + ([node.module] if node.module else []))
    else:
        src = node.module or ""
    if src not in mods:
        return
    for a in node.names:
        sub = MODULE_NAMES.get((src, a.name), f"{src}.{a.name}")
        if sub in mods:
            yield sub, None, a.asname or a.name
        else:
            yield src, a.name, a.asname or a.name


def imports(mods: dict):
    """(importer, imported module, name or None, line) for every import of an mgpu module,
    followed by (reader, module, private name, line) for every ``alias._name`` read through an
    imported module (``from . import ops as functional`` ... ``functional._pair``), the name
    marked by a leading ``.``."""
    for name, source in mods.items():
        tree = _parse(source)
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target, what, local in _bindings(name, node, mods):
                    if what is None:
                        aliases[local] = target
                    yield name, target, what, node.lineno
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                yield name, aliases[node.value.id], "." + node.attr, node.lineno


def problems(mods: dict, floors=FLOORS, known=KNOWN_PRIVATE) -> list:
    """Every upward import, private name used across modules and import cycle, as readable lines."""
    out, edges = [], {m: set() for m in mods}
    for m in mods:
        try:
            floor_of(m, floors)
        except KeyError:
            out.append(f"{m} is on no floor: add it to FLOORS in tests/test_floors.py")
    for importer, target, name, line in imports(mods):
        if name and name.startswith("."):  # a private name read through a module
            if target != importer and (importer, target, name[1:]) not in known:
                out.append(f"{importer} (line {line}) reads the private {target}{name}")
            continue
        if target != importer:
            edges[importer].add(target)
        try:
            up = floor_of(target, floors) > floor_of(importer, floors)
        except KeyError:
            continue
        if up:
            out.append(f"{importer} (line {line}) imports {target}, a floor above it "
                       f"({floors[floor_of(target, floors)][0]} over "
                       f"{floors[floor_of(importer, floors)][0]})")
        if name and name.startswith("_") and not name.startswith("__") and target != importer:
            out.append(f"{importer} (line {line}) imports the private {target}.{name}")
    out += [f"import cycle: {' -> '.join(c)}" for c in cycles(edges)]
    return out


def cycles(edges: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_package_keeps_its_floors():
    found = problems(modules())
    assert not found, "\n".join(found)


def test_every_module_is_read():
    mods = modules()
    for m in ("mgpu", "mgpu.tensor", "mgpu.ops", "mgpu.nn", "mgpu.train", "mgpu.cli",
              "mgpu.bench.train", "mgpu.advisor.model"):
        assert m in mods
    assert len(mods) > 30


@pytest.mark.parametrize("planted, expected", [
    ({"mgpu.tensor": "from .nn import Module\n"},
     "mgpu.tensor (line 1) imports mgpu.nn, a floor above it (modules over tensor)"),
    ({"mgpu.ops": "def f():\n    from . import train\n"},
     "mgpu.ops (line 2) imports mgpu.train, a floor above it (loops over ops)"),
    ({"mgpu.train": "from .chapter import train_batch\n"},
     "import cycle: mgpu.chapter -> mgpu.train"),
    ({"mgpu.chapter": "from .train import _private\n"},
     "mgpu.chapter (line 1) imports the private mgpu.train._private"),
    ({"mgpu.bench.layers": "from ..advisor.steps import _x\n"},
     "mgpu.bench.layers (line 1) imports the private mgpu.advisor.steps._x"),
    ({"mgpu.autograd": "from . import trace as t\nx = t._start\n"},
     "mgpu.autograd (line 2) reads the private mgpu.trace._start"),
    ({"mgpu.nn": "from . import random\nx = random._seed\n"},
     "mgpu.nn (line 2) reads the private mgpu.random._seed"),
    ({"mgpu.ops": "from .engine import core as _core\nx = _core._planted\n"},
     "mgpu.ops (line 2) reads the private mgpu._core._planted"),
    ({"mgpu.newcomer": ""}, "mgpu.newcomer is on no floor"),
])
def test_a_planted_import_is_found(planted, expected):
    """Each plant put at the top of the real sources (a new module for the last): the check
    names it."""
    mods = modules()
    for m, code in planted.items():
        mods[m] = code + mods.get(m, "")
    found = problems(mods)
    assert any(expected in f for f in found), found
