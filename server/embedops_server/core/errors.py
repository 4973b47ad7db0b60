"""Engine error types. The router maps each `kind` to TEI's error_type and HTTP status."""
from __future__ import annotations

EMPTY, VALIDATION, TOKENIZER, OVERLOADED, BACKEND, UNHEALTHY = (
    "Empty", "Validation", "Tokenizer", "Overloaded", "Backend", "Unhealthy",
)


class EngineError(Exception):
    def __init__(self, kind: str, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after = retry_after
