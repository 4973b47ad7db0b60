"""Deterministic YAML output (no anchors, stable key order as built); manifests read with one-line errors."""
from __future__ import annotations

from typing import Any, Iterable

import yaml


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # noqa: ARG002 - yaml API
        return True


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    if "\n" in data:
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", data)


_Dumper.add_representer(str, _str_presenter)


def dump(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


def dump_all(objs: Iterable[Any]) -> str:
    return "".join("---\n" + dump(o) for o in objs)


class ManifestError(ValueError):
    """The text is not YAML, or a document in it is not a mapping; the message is one line."""


def load_all(text: str, source: str = "<input>") -> list[dict]:
    """The non-empty documents of a YAML stream, each a mapping; otherwise ManifestError naming where."""
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as e:
        raise ManifestError(f"{source}: not valid YAML: {_one_line(e)}") from None
    out = []
    for n, d in enumerate(docs, 1):
        if d is None:
            continue
        if not isinstance(d, dict):
            raise ManifestError(f"{source}: document {n} is not a mapping (a YAML {_kind(d)}); "
                                "expected a Kubernetes object such as `kind: EmbeddingService`")
        out.append(d)
    return out


def _one_line(e: yaml.YAMLError) -> str:
    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if not problem:
        return " ".join(str(e).split())
    out = f"{at(mark)}: {problem}" if mark is not None else problem
    if context:
        out += f" ({context}{' at ' + at(cmark) if cmark is not None else ''})"
    return " ".join(out.split())


def _kind(d: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(d), type(d).__name__)
