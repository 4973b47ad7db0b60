"""The bench's one log function: timestamped lines on stderr (tables and JSON go to stdout)."""
from __future__ import annotations

import sys
import time


def log(*a) -> None:
    print(time.strftime("[%H:%M:%S]"), *a, file=sys.stderr, flush=True)
