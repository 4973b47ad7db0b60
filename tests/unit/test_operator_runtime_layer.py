"""The operator's runtime (embedops_operator/runtime/) stays a layer of its own: nothing in it imports the
operator's modules (spec, render, metrics, ...), so it can be read, tested and changed without them."""
from __future__ import annotations

import ast
from pathlib import Path

import embedops_operator.runtime as runtime

RUNTIME = Path(runtime.__file__).parent


def imports_outside_the_runtime(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level > 1 or (node.level == 0 and module.split(".")[0] == "embedops_operator"
                                  and not module.startswith("embedops_operator.runtime")):
                found.append(f"{path.name}:{node.lineno} from {'.' * node.level}{module}")
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.startswith("embedops_operator") and not a.name.startswith("embedops_operator.runtime")]
    return found


def test_nothing_in_the_runtime_imports_the_operator():
    files = sorted(RUNTIME.glob("*.py"))
    assert len(files) >= 7
    assert [line for f in files for line in imports_outside_the_runtime(f)] == []


def test_the_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from .. import render\nfrom embedops_operator import spec\nfrom .client import Client\n")
    assert imports_outside_the_runtime(bad) == ["bad.py:1 from ..", "bad.py:2 from embedops_operator"]
