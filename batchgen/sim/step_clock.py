"""A decode slice's clock: the seconds its steps take, computed only as far as they are read.

A slice with no row waiting for a seat runs until its last row finishes (engine.py), which can
be tens of thousands of steps, while most such slices are cut at the next tick (new rows, an
arriving coroutine) after a few dozen. So the step times are computed in chunks that double,
as far as a question about the slice needs them. A chunk continues the running sum from the
last one's total, so every value is the one a single `cumsum` over all steps would give.
"""
from __future__ import annotations

import numpy as np

from .cost import CostModel

FIRST_CHUNK = 256  # steps computed at least, at the first read (a slice rarely ends sooner)


class StepClock:
    """cum(j): seconds from a slice's start to the end of its step j (1-based), for a batch
    whose rows stop after `left_sorted` (ascending) more steps and start from contexts
    `c_sorted` (in that order); `extra_s` is added to the first step (swap-out copies)."""

    __slots__ = ("cost", "left_sorted", "c_suffix", "extra_s", "limit", "cum")

    def __init__(self, cost: CostModel, left_sorted: np.ndarray, c_sorted: np.ndarray, extra_s: float,
                 limit: int) -> None:
        self.cost, self.left_sorted, self.extra_s, self.limit = cost, left_sorted, extra_s, limit
        # context of the rows still running at a step: those not yet finished are a suffix
        self.c_suffix = np.concatenate([np.cumsum(c_sorted[::-1])[::-1], [0]])
        self.cum = np.empty(0, dtype=np.float64)

    def at(self, j: int) -> float:
        return float(self.upto(j, j)[j - 1])

    def covers(self, t: float, steps: int) -> np.ndarray:
        """cum up to the first step ending at or after t, or of the first `steps` steps if that
        comes first (at most the limit)."""
        cum = self.cum
        while len(cum) < min(steps, self.limit) and (not len(cum) or cum[-1] < t):
            cum = self.upto(max(1, 2 * len(cum)), steps)
        return cum

    def upto(self, steps: int, cap: int | None = None) -> np.ndarray:
        """cum of at least the first min(steps, limit) steps; a chunk grown past `steps` (it
        doubles) stops at `cap` steps (a slice cut short by its KV pool needs no more)."""
        if steps > len(self.cum):
            self._grow(steps, self.limit if cap is None else min(cap, self.limit))
        return self.cum

    def _grow(self, steps: int, limit: int) -> None:
        have = len(self.cum)
        end = min(limit, max(steps, 2 * have, FIRST_CHUNK))
        if end <= have:
            return
        j = np.arange(have, end)
        done_by = np.searchsorted(self.left_sorted, j, side="right")  # rows finished before step j
        active = len(self.left_sorted) - done_by
        kv = self.c_suffix[done_by] + active * (j + 1)  # context read at step j: c0 + j computed, 1 new
        dt = np.asarray(self.cost.step_seconds(active, active, kv, kv), dtype=np.float64)
        if have:  # the running sum goes on from the last total: the values of one cumsum
            cum = np.cumsum(np.concatenate([self.cum[-1:], dt]))[1:]
        else:
            dt[0] += self.extra_s
            cum = np.cumsum(dt)
        self.cum = np.concatenate([self.cum, cum])
