"""Python's cyclic garbage collector, run less often while a fleet is simulated.

A simulated fleet holds its workload's rows as `Sequence` objects (with their lists), most of
them from the start (a partition waits whole in its engine): 100k to millions of objects. At the
default thresholds (a young-generation pass every 700 allocations, older passes every 10 of
those) the collector walked them over and over: dynamic's 100k-row plan in one process took
12.2 s of CPU with them and 10.4 s without. The simulation makes few reference cycles (about a
thousand objects collected a run), and a pass every 100,000 allocations still collects them.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

YOUNG_THRESHOLD = 100_000  # allocations between young-generation passes (Python's default: 700)


@contextlib.contextmanager
def rare_collections() -> Iterator[None]:
    """Raise the young generation's threshold for the block (child processes forked inside
    inherit it), and restore the caller's thresholds after."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], YOUNG_THRESHOLD), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
