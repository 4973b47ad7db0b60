"""JSON log lines, one object per record: the server's --json-output and the operator's --log-format json.

Shared by both programs (the operator image installs this package without the server's dependencies), so it
uses the standard library only, as sizing.py does (tests/unit/test_shared_modules.py holds both to that).
"""
from __future__ import annotations

import json
import logging
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "target": record.name, "message": record.getMessage()}
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
