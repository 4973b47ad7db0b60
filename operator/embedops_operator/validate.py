"""Offline validation against the generated CRD schema: defaults, enums, bounds and the CEL rules.

Mirrors what the API server does (default, then validate) closely enough for `render` to refuse a manifest
the cluster would refuse, with the same messages, and for unit tests to check every CEL rule.
The API server stays the authority; integration tests check the same messages against it.
"""
from __future__ import annotations

import copy
import re
from functools import lru_cache
from typing import Any

from . import spec


@lru_cache(maxsize=1)
def _schema() -> dict:
    return spec.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(value: Any, schema: dict) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(value[key], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(v, schema["items"]) for v in value]
    return value


@lru_cache(maxsize=256)
def _program(expr: str):
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(expr))


def _cel(expr: str, value: Any) -> Any:
    import celpy

    return _program(expr).evaluate({"self": celpy.json_to_cel(value)})


def _check(value: Any, schema: dict, path: str, errors: list[str]) -> None:
    typ = schema.get("type")
    if typ == "object" and not isinstance(value, dict):
        errors.append(f"{path}: must be an object")
        return
    if typ == "array" and not isinstance(value, list):
        errors.append(f"{path}: must be a list")
        return
    if typ == "string" and not isinstance(value, str):
        errors.append(f"{path}: must be a string")
        return
    if typ == "integer" and (not isinstance(value, int) or isinstance(value, bool)):
        errors.append(f"{path}: must be an integer")
        return
    if typ == "boolean" and not isinstance(value, bool):
        errors.append(f"{path}: must be a boolean")
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: Unsupported value: {value!r}: supported values: "
                      + ", ".join(repr(e) for e in schema["enum"]))
    if "minimum" in schema and isinstance(value, (int, float)) and value < schema["minimum"]:
        errors.append(f"{path}: should be greater than or equal to {schema['minimum']}")
    if "maximum" in schema and isinstance(value, (int, float)) and value > schema["maximum"]:
        errors.append(f"{path}: should be less than or equal to {schema['maximum']}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{path}: should be at least {schema['minLength']} chars long")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: should match '{schema['pattern']}'")
    if isinstance(value, list) and "minItems" in schema and len(value) < schema["minItems"]:
        errors.append(f"{path}: should have at least {schema['minItems']} items")
    if isinstance(value, list) and schema.get("x-kubernetes-list-type") == "set":
        seen = set()
        for i, v in enumerate(value):
            key = repr(v)
            if key in seen:
                errors.append(f"{path}[{i}]: Duplicate value: {v!r}")
            seen.add(key)
    if isinstance(value, dict):
        for req in schema.get("required", []):
            if req not in value:
                errors.append(f"{path}.{req}: Required value")
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                _check(value[key], sub, f"{path}.{key}", errors)
        if isinstance(schema.get("additionalProperties"), dict):
            for key, v in value.items():
                _check(v, schema["additionalProperties"], f"{path}[{key}]", errors)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            _check(v, schema["items"], f"{path}[{i}]", errors)
    for rule in schema.get("x-kubernetes-validations", []):
        try:
            ok = bool(_cel(rule["rule"], value))
        except Exception as exc:  # noqa: BLE001 - a CEL runtime error is a validation failure too
            errors.append(f"{path}: rule {rule['rule']!r} could not be evaluated: {exc}")
            continue
        if not ok:
            message = rule.get("message", f"failed rule: {rule['rule']}")
            if "messageExpression" in rule:
                try:
                    message = str(_cel(rule["messageExpression"], value))
                except Exception:  # noqa: BLE001
                    pass
            errors.append(f"{path}{rule.get('fieldPath', '')}: Invalid value: {message}")


def validate(resource: dict) -> list[str]:
    """Errors the API server would report for this EmbeddingService (empty when valid)."""
    obj = apply_defaults(copy.deepcopy(resource), _schema())
    errors: list[str] = []
    _check(obj.get("spec"), _schema()["properties"]["spec"], "spec", errors)
    return errors


def defaulted(resource: dict) -> dict:
    return apply_defaults(copy.deepcopy(resource), _schema())
