"""The import graph of accel, snapkv and speculative, read from the source (ast): no cycles,
and dependencies pointing one way (DESIGN.md: snapkv and speculative depend on accel and
know nothing of each other; accel finds them through the strategy registry)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("accel", "snapkv", "speculative")


def _modules(root: Path) -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (root / pkg).rglob("*.py"):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its source (function bodies and
    ``TYPE_CHECKING`` blocks included: a cycle hidden in a function is still a cycle)."""
    mods = _modules(root)

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(filter(None, (known(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    target = full if full in mods else known(source)
                    if target:
                        deps.add(target)
        deps.discard(mod)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_reader_finds_a_cycle_where_there_is_one(tmp_path):
    (tmp_path / "accel" / "sub").mkdir(parents=True)
    for pkg in ("snapkv", "speculative"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "accel" / "__init__.py").write_text("")
    (tmp_path / "accel" / "sub" / "__init__.py").write_text("")
    (tmp_path / "accel" / "a.py").write_text("from .sub import b\n")
    (tmp_path / "accel" / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (tmp_path / "accel" / "c.py").write_text("import accel.a\n")
    graph = import_graph(tmp_path)
    assert graph["accel.a"] == {"accel.sub.b"}
    assert graph["accel.sub.b"] == {"accel.a"}
    assert cycles(graph) == [["accel.a", "accel.sub.b"]]


def test_no_import_cycle():
    graph = import_graph()
    assert "accel.engine" in graph and "accel.kernels.invariance" in graph  # the reader found the modules
    assert cycles(graph) == []


@pytest.mark.parametrize("package, forbidden", [("accel", ("snapkv", "speculative")),
                                                ("snapkv", ("speculative",)),
                                                ("speculative", ("snapkv",))])
def test_dependencies_point_one_way(package, forbidden):
    # accel.cli is the application: `accel train-heads` runs speculative's training
    allowed = {"accel.cli"}
    wrong = {(m, d) for m, deps in import_graph().items() if m.split(".")[0] == package and m not in allowed
             for d in deps if d.split(".")[0] in forbidden}
    assert not wrong
