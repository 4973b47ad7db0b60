"""The GitHub workflow users' CI runs (.github/workflows/e2e-kind.yaml) passes actionlint (issue 40, point 2):
workflow syntax, `${{ }}` expressions, the inputs of each action, and, when shellcheck is on the PATH, the
shell of every `run:` step. actionlint is built from its Go module by `make cluster-binaries`."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from localcluster.components import provided

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.y*ml"))


def test_every_workflow_passes_actionlint():
    actionlint = provided("actionlint")
    if not os.access(actionlint, os.X_OK):
        pytest.skip("actionlint not built (make cluster-binaries)")
    assert WORKFLOWS, "no workflow under .github/workflows"
    p = subprocess.run([str(actionlint), "-no-color", *map(str, WORKFLOWS)], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert p.returncode == 0 and not p.stdout.strip(), p.stdout + p.stderr


def test_actionlint_finds_a_broken_workflow(tmp_path):
    """The check can fail: an unknown expression context and a misspelt key are reported."""
    actionlint = provided("actionlint")
    if not os.access(actionlint, os.X_OK):
        pytest.skip("actionlint not built (make cluster-binaries)")
    bad = tmp_path / ".github" / "workflows" / "bad.yaml"
    bad.parent.mkdir(parents=True)
    bad.write_text("on: push\njobs:\n  j:\n    runs-on: ubuntu-24.04\n    step:\n      - run: echo ${{ nothing.here }}\n")
    p = subprocess.run([str(actionlint), "-no-color", str(bad)], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120)
    assert p.returncode == 1 and "step" in p.stdout, p.stdout + p.stderr
