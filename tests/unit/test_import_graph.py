"""The project's modules import each other without a circle: every import counts, those inside functions too
(a function-level import that closes a circle only hides it). A circle means two modules that each need the
other, i.e. one job split badly; the fix is a module both can use (as localcluster/pki.py or bench/logs.py)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"server/embedops_server": "embedops_server", "operator/embedops_operator": "embedops_operator",
            "bench": "bench", "localcluster": "localcluster"}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in PACKAGES.items():
        for f in (REPO / folder).rglob("*.py"):
            parts = [package, *f.relative_to(REPO / folder).with_suffix("").parts]
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in mods and t != name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    mods = _modules()
    assert len(mods) > 60
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert graph["localcluster.controlplane"] >= {"localcluster.node", "localcluster.pki"}  # the graph is read
    assert _cycles(graph) == []


def test_the_check_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_product_code_never_imports_the_tests():
    """The demo, the bench, the server and the operator run without tests/ (the demo once imported its cluster
    client and model folders from there): nothing outside tests/ imports ``tests``."""
    offenders = []
    for folder in PACKAGES:
        for f in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                offenders += [f"{f.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                              if n == "tests" or n.startswith("tests.")]
    assert offenders == []
