"""The package's layers stay apart: rules decide, the dispatch layer executes, examples sit on top.

These read the source (no imports run), so a rule module that starts importing DTensor or the
dispatcher, or a module that grows past the size a newcomer can read, fails here first.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "shardtensor"
MAX_LINES = 520


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every shardtensor module ``path`` imports (top level or inside functions)."""
    pkg = _module_name(path)
    if path.name != "__init__.py":
        pkg = pkg.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("shardtensor")}


def _modules(sub: str) -> list[Path]:
    return sorted((SRC / sub).rglob("*.py"))


# what a layer may never import: the layers above it
ABOVE = ("shardtensor.tensor", "shardtensor.dispatch", "shardtensor.examples", "shardtensor.fsdp",
         "shardtensor.parallel", "shardtensor.checkpoint", "shardtensor.cli")


@pytest.mark.parametrize("path", _modules("propagation"), ids=lambda p: str(p.relative_to(SRC)))
def test_rules_never_import_the_layers_that_execute(path):
    bad = sorted(m for m in _imports(path) if m.startswith(ABOVE))
    assert not bad, f"{path.relative_to(SRC)} imports {bad}: rules decide, the dispatch layer runs things"


@pytest.mark.parametrize("path", _modules("propagation/rules"), ids=lambda p: str(p.relative_to(SRC)))
def test_rules_build_decisions_one_way(path):
    """Every rule returns candidates (``decide``) or calls ``strategy.finish``; none builds a
    ``Decision`` by hand, so the shard-order and moved-input logic lives in one place."""
    calls = [n.lineno for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "Decision"]
    assert not calls, f"{path.relative_to(SRC)} builds Decision(...) on lines {calls}; use strategy.finish"


@pytest.mark.parametrize("path", _modules("redistribute") + _modules("comm"), ids=lambda p: str(p.relative_to(SRC)))
def test_redistribution_and_comm_sit_below_propagation(path):
    bad = sorted(m for m in _imports(path) if m.startswith(ABOVE + ("shardtensor.propagation",)))
    assert not bad, f"{path.relative_to(SRC)} imports {bad}"


def test_the_library_never_imports_its_examples():
    users = [p for p in SRC.rglob("*.py") if "examples" not in p.parts and p.name != "cli.py"
             and any(m.startswith("shardtensor.examples") for m in _imports(p))]
    assert not users, f"{users} import shardtensor.examples (only the CLI runs them)"


def test_no_module_is_longer_than_a_newcomer_can_read():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_import_reader_sees_relative_imports():
    """The checks above are only as good as ``_imports``: it must resolve ``from ...x import y``."""
    seen = _imports(SRC / "dispatch" / "run.py")
    assert "shardtensor.tensor" in seen and "shardtensor.propagation" in seen
    assert "shardtensor.propagation.call" in _imports(SRC / "propagation" / "rules" / "view.py")
