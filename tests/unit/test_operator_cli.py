"""`embedops-operator render` on input that is not a manifest: one line on stderr, exit 1, no traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from embedops_operator import yamlio

REPO = Path(__file__).resolve().parents[2]


def _render(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embedops_operator.cli", "render", *args], input=stdin,
                          capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO / "operator")},
                          timeout=60)


def _one_line_error(res: subprocess.CompletedProcess, needle: str) -> str:
    assert res.returncode == 1, (res.returncode, res.stderr)
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr and needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("text, needle", [
    ("kind: EmbeddingService\nspec: {model: [}\n", "not valid YAML: line 2, column 16"),
    ("a: [1, 2\n", "line 2, column 1: expected ',' or ']', but got '<stream end>' "
                   "(while parsing a flow sequence at line 1, column 4)"),
    ("\tkind: EmbeddingService\n", "not valid YAML: line 1, column 1"),
    ("kind: !!python/object:os.system x\n", "not valid YAML"),
    ("- 1\n- 2\n", "document 1 is not a mapping (a YAML list)"),
    ("just a string\n", "document 1 is not a mapping (a YAML string)"),
    ("---\nkind: ConfigMap\n---\n42\n", "document 2 is not a mapping (a YAML number)"),
])
def test_render_refuses_what_is_not_a_manifest(text, needle):
    line = _one_line_error(_render("-f", "-", stdin=text), needle)
    assert line.startswith("embedops-operator render: <stdin>: ")


def test_render_names_the_file_and_refuses_unreadable_ones(tmp_path):
    broken = tmp_path / "svc.yaml"
    broken.write_text("apiVersion: embedops.dev/v1alpha1\nkind: EmbeddingService\nmetadata: {name: x\n")
    _one_line_error(_render("-f", str(broken)), f"{broken}: not valid YAML: line 4")
    _one_line_error(_render("-f", str(tmp_path / "missing.yaml")), "cannot read: [Errno 2] No such file")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00k")
    _one_line_error(_render("-f", str(binary)), "cannot read:")


def test_render_refuses_metadata_that_is_not_a_mapping():
    _one_line_error(_render("-f", "-", stdin="kind: EmbeddingService\nmetadata: 5\n"),
                    "metadata must be a mapping")


def test_load_all_keeps_mappings_and_skips_empty_documents():
    assert yamlio.load_all("---\n---\nkind: A\n---\n# only a comment\n") == [{"kind": "A"}]
    with pytest.raises(yamlio.ManifestError, match=r"^svc.yaml: not valid YAML: line 1, column 5: "):
        yamlio.load_all("a: b: c\n", "svc.yaml")
