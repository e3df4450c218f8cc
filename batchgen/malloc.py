"""Give glibc's heap back its reuse of large blocks where Dask's worker setup took it away.

Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_=65536 (so pandas workers hand freed
memory back to the OS). Setting that variable at all also switches off glibc's dynamic mmap
threshold, so every allocation over 128 KiB (activations, gathered KV: each forward makes
hundreds) becomes a fresh mmap whose pages fault in and are zeroed again, every step. Measured
here: one CPU engine in a Dask worker ran 1.34x slower than the same engine outside one. An
engine holds a model's worth of memory for its whole life, so keeping a few hundred MiB of heap
around is the better trade: large blocks up to 32 MiB come from the heap again, and the heap
keeps up to 256 MiB free at its top.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this setting on 64-bit
TRIM_THRESHOLD = 256 << 20
_done = threading.Event()


def restore_heap_reuse() -> bool:
    """When MALLOC_TRIM_THRESHOLD_ / MALLOC_MMAP_THRESHOLD_ pinned glibc's thresholds (as Dask
    does), raise them for this process; -> True when they were changed. Once per process; a
    no-op elsewhere (other platforms, musl, variables unset)."""
    if _done.is_set():
        return False
    _done.set()
    pinned = any(name in os.environ for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"))
    if not pinned or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if ok:
        logger.debug("batchgen: malloc mmap threshold %d, trim threshold %d", MMAP_THRESHOLD, TRIM_THRESHOLD)
    return ok
