"""Hand the C heap's free pages back to the kernel once the model is loaded (glibc's malloc_trim).

Loading leaves much of the heap free but resident: ONNX Runtime packs each int8 MatMul's weights into MLAS's
layout and frees the originals, and glibc keeps the freed pages, which a replica's RSS and its pod's memory
limit then carry for its whole life. bge-m3 int8 (0.54 GB graph): the session held 828 MiB resident, 563 after
malloc_trim (docs/server.md#memory). glibc returns only the heap's top by itself; malloc_trim(0) also releases
free pages in the middle (madvise), in a few milliseconds once, at start.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("embedops.server")


def resident_bytes() -> int | None:
    """This process's resident set (Linux), None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def release_free_memory() -> int | None:
    """malloc_trim(0): the bytes the resident set shrank by, or None where the C library has no malloc_trim
    (musl, macOS) or the resident set cannot be read."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return None
    before = resident_bytes()
    trim(0)
    after = resident_bytes()
    if before is None or after is None:
        return None
    return before - after
