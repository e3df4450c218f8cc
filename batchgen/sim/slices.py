"""A decode slice: k decode steps of one batch in closed form, decided by one `schedule()` call.

The engine (engine.py) computes a slice's step times at once (numpy over the batch) and writes
its effect into the batch's counters (batch.py) only when it closes: at its end, or at a tick where the
engine must act on its state (an order from the balancer, new rows), where it is cut after the
forward in flight. Until then the engine's load report is read off the slice's arrays at the
tick, equal to what closing it there would leave (tests/sim/test_sim_engine.py checks both).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from .step_clock import StepClock

# A slice's arrays: [n] int64, in the batch's (plan) order.
IntArray = np.ndarray


class DecodeSlice:
    """k >= 1 decode steps of a batch from `start` (its rows' seq ids and max_tokens): row i
    feeds one token a step until it stops after left[i] steps (it keeps its seat and blocks to
    the slice's end). clock.at(j): seconds from `start` to the end of step j."""

    __slots__ = ("ids", "max_tokens", "start", "generated", "c0", "out0", "left", "have", "left_sorted", "clock", "k",
                 "block_size", "_reported", "_need")

    def __init__(self, ids: IntArray, max_tokens: IntArray, start: float, generated: int, c0: IntArray,
                 out0: IntArray, left: IntArray, have: IntArray, left_sorted: IntArray, clock: StepClock, k: int,
                 block_size: int) -> None:
        self.ids, self.max_tokens, self.start, self.generated = ids, max_tokens, start, generated
        self.c0, self.out0, self.left, self.have, self.left_sorted = c0, out0, left, have, left_sorted
        self.clock, self.k, self.block_size = clock, k, block_size
        self._reported: _Sorted | None = None  # made on the first report
        self._need: tuple[int, IntArray] | None = None  # (steps, blocks_needed(steps)), the last asked

    @property
    def end(self) -> float:
        return self.start + self.clock.at(self.k)

    def ends_after(self, t: float) -> bool:
        """end > t, computing the clock only as far as t (a step takes time: past a step that
        ends after t, so does the slice)."""
        cum = self.clock.covers(t - self.start, self.k)
        if len(cum) < self.k and cum[-1] > t - self.start:
            return True
        return self.end > t

    def at(self, j: int) -> float:
        return self.start + self.clock.at(j)

    def position(self, t: float) -> int:
        """Steps done once the forward running at time t has completed (a forward is not cut)."""
        return min(self.k, int(self.clock.covers(t - self.start, self.k).searchsorted(t - self.start)) + 1)  # (cum past k is never read)

    def blocks_needed(self, steps: int) -> IntArray:
        """Blocks each row needs beyond those it holds after `steps` steps (0 where it has them)."""
        if self._need is None or self._need[0] != steps:
            need = np.minimum(self.left, steps)
            need += self.c0
            need += self.block_size - 1
            need //= self.block_size  # ceil((c0 + steps done) / block_size): the blocks it then holds
            need -= self.have
            self._need = (steps, np.maximum(need, 0, out=need))
        return self._need[1]

    def fit(self, free: int) -> None:
        """Cut k to the most steps whose blocks fit `free` blocks (step 1's, and with lookahead
        the whole slice's, came with the plan): a KV-bound slice ends where the pool runs out."""
        if int(self.blocks_needed(self.k).sum()) <= free:
            return
        lo, hi = 1, self.k  # need(1) is all 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if int(self.blocks_needed(mid).sum()) <= free else (lo, mid - 1)
        self.k = lo

    def finished_by(self, j: int) -> int:
        return int(self.left_sorted.searchsorted(j, side="right"))

    def report(self, j: int) -> tuple[int, int, int, Callable[[], np.ndarray]]:
        """What closing the slice after j steps would leave, without closing it: (rows still
        running, their remaining tokens (max_tokens minus those done), blocks the pool then
        lacks against now, a function giving [r, 3] (seq_id, remaining, num_computed) of the
        rows still running, in batch order: made only if the balancer reads them)."""
        if self._reported is None:
            self._reported = _Sorted(self)
        r = self._reported
        f = self.finished_by(j)
        alive = len(self.c0) - f
        remaining = int(r.remaining_suffix[f]) - alive * j
        # blocks a running row lacks after j steps: ceil((j - room) / block_size) when positive,
        # room = the tokens its blocks held beyond its context at the start
        lack = r.lack_at_0[f:] + j  # j + block_size - 1 - room: <= block_size - 1 where it lacks none
        np.maximum(lack, 0, out=lack)
        lack //= self.block_size
        taken = int(np.add.reduce(lack)) - int(r.have_prefix[f])
        return alive, remaining, taken, functools.partial(self._rows, j)

    def _rows(self, j: int) -> np.ndarray:
        alive = self.left > j
        return np.stack([self.ids[alive], self.max_tokens[alive] - self.out0[alive] - j, self.c0[alive] + j], axis=1)


class _Sorted:
    """A slice's rows sorted by the steps they have left, with the sums a report needs: the
    rows finished after j steps are a prefix of this order."""

    __slots__ = ("lack_at_0", "remaining_suffix", "have_prefix")

    def __init__(self, piece: DecodeSlice) -> None:
        order = np.argsort(piece.left, kind="stable")
        have = piece.have[order]
        self.lack_at_0 = piece.block_size - 1 - (have * piece.block_size - piece.c0[order])  # (minus room)
        rest = (piece.max_tokens - piece.out0)[order]
        self.remaining_suffix = np.concatenate([np.cumsum(rest[::-1])[::-1], [0]])
        self.have_prefix = np.concatenate([[0], np.cumsum(have)])
