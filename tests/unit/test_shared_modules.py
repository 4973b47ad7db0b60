"""The server's modules the operator imports run in the operator's image, which installs the server's package
without the server's dependencies: they may import the standard library only, and the operator imports no other
server module."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = {"embedops_server.sizing", "embedops_server.logs"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_the_operator_imports_only_the_shared_server_modules():
    used = set()
    for path in (REPO / "operator" / "embedops_operator").rglob("*.py"):
        used |= {n for n in _imports(path) if n.startswith("embedops_server")}
    # `from embedops_server import sizing` names the package and the module; `from embedops_server.logs import
    # JsonFormatter` the module and its class
    modules = {n for n in used - {"embedops_server"} if not n.rsplit(".", 1)[-1][:1].isupper()}
    assert modules <= SHARED, used


def test_the_shared_modules_import_the_standard_library_only():
    for module in SHARED:
        path = REPO / "server" / (module.replace(".", "/") + ".py")
        top = {n.split(".")[0] for n in _imports(path)} - {"__future__"}
        assert top <= set(sys.stdlib_module_names), (module, top - set(sys.stdlib_module_names))
