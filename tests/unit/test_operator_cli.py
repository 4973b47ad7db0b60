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


def test_the_operators_settings_come_from_its_variables_once_and_refuse_bad_values(monkeypatch):
    """The chart's variables fill OperatorSettings (comma lists, policy in any case); a bad one is one line naming
    the variable, exit 2, before anything renders or starts."""
    from embedops_operator.settings import OperatorSettings

    monkeypatch.setenv("EMBEDOPS_GATEWAY_NAMESPACES", "traefik, gateway,traefik")
    monkeypatch.setenv("EMBEDOPS_POD_UPGRADES", "roll")
    monkeypatch.setenv("EMBEDOPS_NAMESPACES", "")
    s = OperatorSettings()
    assert s.gateway_namespaces == ("gateway", "traefik") and s.pod_upgrades == "Roll" and s.namespaces == ()
    assert OperatorSettings(namespaces=["b", "a"]).namespaces == ("a", "b")  # what --namespace passes
    example = (REPO / "examples" / "cpu-ingestion.yaml").read_text()
    res = subprocess.run([sys.executable, "-m", "embedops_operator.cli", "render", "-f", "-"], input=example,
                         capture_output=True, text=True, cwd=REPO, timeout=60,
                         env={"PYTHONPATH": str(REPO / "operator"), "EMBEDOPS_MAX_CONCURRENT_UPGRADES": "none"})
    assert res.returncode == 2 and res.stdout == "" and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("embedops-operator: EMBEDOPS_MAX_CONCURRENT_UPGRADES: "), res.stderr


def test_no_operator_module_reads_its_options_from_the_environment():
    """Options reach the reconciler as an object (settings.py): only the runtime reads the pod's identity and
    the kubeconfig path, as client libraries do."""
    import re

    allowed = {"runtime/leader.py", "runtime/client.py"}
    for path in (REPO / "operator" / "embedops_operator").rglob("*.py"):
        rel = path.relative_to(REPO / "operator" / "embedops_operator").as_posix()
        if rel not in allowed:
            # (not LiteLLM's `os.environ/NAME` reference, which is text of its config)
            assert not re.search(r"os\.environ(?!/)|os\.getenv", path.read_text()), rel
