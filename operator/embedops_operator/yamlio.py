"""Deterministic YAML output (no anchors, stable key order as built)."""
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


def load_all(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]
