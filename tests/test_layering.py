"""The package layering, checked from the source (AST), not from a run: no import cycles among
the project's modules, ``kernels`` never imports the worker or the driver, ``metadata`` imports
only itself, and the driver reads a checkpoint's architecture without the model or Triton code.

Every import counts, a function-local one too (it is a dependency all the same); only imports
under ``if TYPE_CHECKING:`` are skipped (annotations, never executed)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "workers", "metadata", "kernels", "placement", "benchmarks")


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from a import b`` names module ``a.b``
    where that is a module, else ``a``)."""
    files = {_module_name(root, p): p for pkg in packages if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        is_pkg = path.name == "__init__.py"
        deps = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".")[: len(mod.split(".")) - node.level + (1 if is_pkg else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:  # import a.b.c where only a.b is ours
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    deps.add(name)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _top(mod: str) -> str:
    return mod.split(".")[0]


def test_no_import_cycles():
    assert cycles(import_graph(ROOT)) == []


def test_kernels_import_neither_workers_nor_cluster():
    bad = sorted(
        f"{m} -> {d}"
        for m, deps in import_graph(ROOT).items()
        if _top(m) == "kernels"
        for d in deps
        if _top(d) in ("workers", "cluster", "benchmarks")
    )
    assert bad == []


def test_metadata_imports_only_itself():
    bad = sorted(
        f"{m} -> {d}"
        for m, deps in import_graph(ROOT).items()
        if _top(m) == "metadata"
        for d in deps
        if _top(d) != "metadata"
    )
    assert bad == []


def test_the_checks_see_cycles_and_back_arrows(tmp_path):
    """The graph on a small tree with a function-local cycle, a relative import and a
    TYPE_CHECKING-only import (which does not count)."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "kernels" / "ops.py").write_text("from kernels import leaf\n")
    (tmp_path / "kernels" / "leaf.py").write_text("def f():\n    from . import ops\n    from workers.x import y\n")
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "__init__.py").write_text("")
    (tmp_path / "workers" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kernels import ops\n"
    )
    graph = import_graph(tmp_path, ("kernels", "workers"))
    assert graph["kernels.leaf"] == {"kernels.ops", "workers.x"}
    assert graph["workers.x"] == set()
    assert cycles(graph) == [["kernels.leaf", "kernels.ops"]]


def test_the_driver_reads_an_architecture_without_model_or_triton_code():
    code = (
        "import sys, cluster.engine, workers.models.arch\n"
        "print(sorted(m for m in ('triton', 'torch', 'workers.models.llama', 'kernels.ops')"
        " if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    loaded = eval(out.stdout.strip().splitlines()[-1])
    assert "triton" not in loaded and "workers.models.llama" not in loaded, loaded
    assert "kernels.ops" not in loaded, loaded
