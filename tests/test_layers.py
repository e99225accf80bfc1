"""The package is a stack of layers, each importing only the layers below it.

These read the source (no imports run).  Every import counts: at module level, inside functions
and under ``TYPE_CHECKING`` alike, so a late import cannot hide an import that climbs.  A module
the list below does not place, an import that climbs, an import circle, a rule module that
builds decisions by hand, or a module past the size a newcomer can read fails here first.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "shardtensor"
MAX_LINES = 520

# The layers, ground first.  A module belongs to the longest prefix that names it; it may import
# its own layer (without a circle) and every layer below, never one above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("ground: placements, errors, local kernels", (
        "errors", "placement", "observe", "kernels", "version", "implicit", "aliasing")),
    ("collectives", ("comm",)),
    ("meshes", ("mesh", "groups")),
    ("specs and local pieces", ("spec", "pieces", "rng", "submesh", "async_tensor", "compile", "blocks")),
    ("redistribution", ("redistribute",)),
    ("the tensor, and propagation (rules decide)", ("tensor", "propagation")),
    ("built on DTensor", ("factories", "experimental", "listops", "parallel", "fsdp", "checkpoint", "debug", "transfer", "cp", "auto")),
    ("dispatch (runs ops)", ("dispatch",)),
    ("entry points", ("", "__main__", "cli", "dropin", "examples")),
]


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    where: str  # "module", "function" or "type-checking"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _owner(name: str) -> str:
    """The module ``name`` lives in (``shardtensor.comm.SimWorld`` -> ``shardtensor.comm``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(path: Path) -> list[Import]:
    """Every import of a shardtensor module in ``path``, with where it stands."""
    me = _module_name(path)
    pkg = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out: list[Import] = []

    def visit(node: ast.AST, where: str) -> None:
        for ch in ast.iter_child_nodes(node):
            w = where
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                w = "function"
            elif isinstance(ch, ast.If) and "TYPE_CHECKING" in ast.unparse(ch.test):
                w = "type-checking"
            if isinstance(ch, ast.ImportFrom):
                base = pkg.split(".")[:len(pkg.split(".")) - ch.level + 1] if ch.level else []
                mod = ".".join(base + ([ch.module] if ch.module else []))
                names = [_owner(f"{mod}.{a.name}") for a in ch.names]
            elif isinstance(ch, ast.Import):
                names = [_owner(a.name) for a in ch.names]
            else:
                names = []
            out.extend(Import(me, n, ch.lineno, w) for n in names if n.startswith("shardtensor") and n != me)
            visit(ch, w)

    visit(ast.parse(path.read_text()), "module")
    return out


def _layer(module: str) -> int:
    """The index in ``LAYERS`` of ``module`` (-1: unplaced)."""
    rel = module.removeprefix("shardtensor").removeprefix(".")
    best, found = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (rel == p or (p and rel.startswith(p + "."))) and len(p) > best:
                best, found = len(p), i
    return found


IMPORTS = [imp for p in MODULES.values() for imp in _imports(p)]


def test_every_module_has_a_layer():
    loose = sorted(m for m in MODULES if _layer(m) < 0)
    assert not loose, f"modules no layer of tests/test_layers.py:LAYERS names: {loose}"


def test_no_import_climbs_a_layer():
    up = [f"{i.source} (line {i.line}, {i.where}) imports {i.target}: layer '{LAYERS[_layer(i.target)][0]}' "
          f"is above '{LAYERS[_layer(i.source)][0]}'"
          for i in IMPORTS if _layer(i.target) > _layer(i.source)]
    assert not up, "imports that climb:\n" + "\n".join(up)


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in IMPORTS:
        edges[i.source].add(i.target)
    circles = _circles(edges)
    assert not circles, f"modules that import each other in a circle: {circles}"


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_late_imports():
    """Imports stand at the top of a module, before its first definition."""
    late = []
    for name, path in MODULES.items():
        seen_def = False
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                seen_def = True
            elif seen_def and isinstance(node, (ast.Import, ast.ImportFrom)):
                late.append(f"{name}:{node.lineno}")
    assert not late, f"imports after a definition: {late}"


def test_rules_never_import_the_layers_that_execute():
    bad = [i for i in IMPORTS if i.source.startswith("shardtensor.propagation")
           and i.target.startswith(("shardtensor.tensor", "shardtensor.dispatch"))]
    assert not bad, f"rules decide, the dispatch layer runs things: {bad}"


def _rules_that_talk(imports: list[Import]) -> list[Import]:
    """Imports of collectives, random draws or the redistribution executor by rule modules (any
    module under those packages, at any depth)."""
    talk = ("shardtensor.comm", "shardtensor.rng", "shardtensor.redistribute")
    return [i for i in imports if i.source.startswith("shardtensor.propagation.rules")
            and any(i.target == t or i.target.startswith(t + ".") for t in talk)]


def test_every_collective_a_rule_runs_is_in_propagation_kernels():
    """Rule modules name kernels that talk to other ranks (``propagation/kernels.py``); they do
    not import collectives, random draws or the redistribution executor themselves."""
    bad = _rules_that_talk(IMPORTS)
    assert not bad, f"import it in propagation/kernels.py and name the kernel from there: {bad}"


def test_the_talk_check_sees_submodules_and_function_imports():
    rule = "shardtensor.propagation.rules.pointwise"
    seen = _rules_that_talk([Import(rule, "shardtensor.redistribute.execute", 1, "function"),
                             Import(rule, "shardtensor.comm", 2, "module"),
                             Import(rule, "shardtensor.redistribution_notes", 3, "module"),
                             Import(rule, "shardtensor.placement", 4, "module")])
    assert [i.line for i in seen] == [1, 2]


def test_dispatch_calls_aliasing_once_before_and_once_after_the_kernel():
    """Dispatch's aliasing bookkeeping is ``check`` before anything runs and ``record`` after,
    in ``dispatch/run.py`` alone (at most 4 call sites: the detach shortcut records too); the
    hit path, decompositions, the fallback and the packed path return facts instead."""
    calls: dict[str, list[tuple[str, int]]] = {}
    for path in sorted((SRC / "dispatch").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                 and (n.module or "").endswith("aliasing") for a in n.names}
        names -= {"op_kind", "NOTHING", "VIEWS", "COPIES", "OWN"}  # a schema fact and the fact names
        modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   for a in n.names if a.name.endswith("aliasing")}
        for n in ast.walk(tree):
            if isinstance(n, ast.Call):
                f = n.func
                if (isinstance(f, ast.Name) and f.id in names) or (
                        isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules):
                    calls.setdefault(path.name, []).append((ast.unparse(f), n.lineno))
    assert set(calls) <= {"run.py"}, f"aliasing is called outside dispatch/run.py: {calls}"
    assert len(calls.get("run.py", [])) <= 4, calls
    assert {c for c, _ in calls["run.py"]} == {"check", "record"}, calls


@pytest.mark.parametrize("path", sorted((SRC / "propagation" / "rules").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(SRC)))
def test_rules_build_decisions_one_way(path):
    """Every rule returns candidates (``decide``) or calls ``strategy.finish``; none builds a
    ``Decision`` by hand, so the shard-order and moved-input logic lives in one place."""
    calls = [n.lineno for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "Decision"]
    assert not calls, f"{path.relative_to(SRC)} builds Decision(...) on lines {calls}; use strategy.finish"


def test_the_library_never_imports_its_examples():
    users = [i for i in IMPORTS if i.target.startswith("shardtensor.examples")
             and not i.source.startswith(("shardtensor.examples", "shardtensor.cli"))]
    assert not users, f"only the CLI runs the examples: {users}"


def test_no_module_is_longer_than_a_newcomer_can_read():
    long = {str(p.relative_to(SRC)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_import_reader_sees_every_kind_of_import():
    """The checks above are only as good as ``_imports``: relative imports, names imported from
    a package (owned by the package), imports inside functions and under TYPE_CHECKING."""
    seen = {(i.target, i.where) for i in _imports(SRC / "dispatch" / "run.py")}
    assert ("shardtensor.tensor", "module") in seen and ("shardtensor.propagation", "module") in seen
    assert any(i.target == "shardtensor.propagation.call" for i in _imports(SRC / "propagation" / "rules" / "view.py"))
    wheres = {i.where for p in MODULES.values() for i in _imports(p)}
    assert {"module", "function"} <= wheres
    tree = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .mesh import DeviceMesh\n"
    probe = SRC / "_layers_probe.py"
    try:
        probe.write_text(tree + "def f():\n    from . import tensor\n")
        got = {(i.target, i.where) for i in _imports(probe)}
    finally:
        probe.unlink()
    assert got == {("shardtensor.mesh", "type-checking"), ("shardtensor.tensor", "function")}
    assert _layer("shardtensor.dispatch.run") > _layer("shardtensor.tensor") > _layer("shardtensor.comm.simulated")
