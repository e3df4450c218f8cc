"""A simulated engine's running rows as arrays, and the scheduler's running loop over them in
closed form.

`Scheduler.schedule()` visits every running row each forward: one Python iteration per row, and
the step that follows writes each row's counters back. In a fleet of 128 engines of 256 rows
that was most of a simulation's time. So the simulated engine (engine.py) keeps its running rows'
counters here, in the scheduler's order (`Scheduler.running`), and writes them into the rows'
`Sequence` objects only where the runtime's code reads them: a row that finishes, an eviction,
a suspend, a report of the rows themselves (`sync`).

`plan_running` is `Scheduler._schedule_running` (runtime/policy.py) computed with numpy: the
row at position i gets what is left of the token budget after the rows before it, min(its
uncomputed tokens, that), while any is left; the pool is asked for sum(need) blocks, which fits
exactly when every one of the loop's allocations in turn does. When it does not, the loop
evicts the last running row until the rest fit (the "newest" policy), and `plan_running` says
where the batch then ends; decision.py evicts those rows with the scheduler's own `evict` (with
another policy it calls the real `schedule()` on synced rows). tests/sim/test_sim_batch.py holds
the two equal on random batches and pools.
"""
from __future__ import annotations

from itertools import chain

import numpy as np

from ..runtime.sequence import Sequence
from .blocks import NO_ID

IntArray = np.ndarray  # [n] int64, in the scheduler's order of its running rows

# the rows of `state`; the last three are the counters a Sequence holds (`sync`)
_FIELDS = ("ids", "prompt", "max_tokens", "stop_at", "computed", "out", "blocks")
IDS, PROMPT, MAX_TOKENS, STOP_AT, COMPUTED, OUT, BLOCKS = range(len(_FIELDS))
_COLUMNS = len(_FIELDS)


def _column(k: int) -> property:
    def get(self: RunningBatch) -> IntArray:
        return self.state[k]

    def put(self: RunningBatch, values: IntArray) -> None:
        state = self.state.copy()  # (a new array: what was read off the old one stays valid)
        state[k] = values
        self.state = state

    return property(get, put)


class RunningBatch:
    """The counters of an engine's running rows: `seqs[i]`'s context computed, tokens generated,
    prompt length, max_tokens, stop_at (where it really stops) and KV blocks held, as the rows
    of one [7, n] array (a row joining or leaving is one numpy call, not seven). While a row is
    here its Sequence's num_computed, output_ids and block_ids are stale until `sync`. The
    array is replaced, never written in place: a column read off it keeps its values (a load
    report lists the rows later, a decode slice reads its start). `seqs` is the batch's own
    list (never the scheduler's), changed in place."""

    __slots__ = ("seqs", "state")
    ids, prompt, max_tokens, stop_at, computed, out, blocks = (_column(k) for k in range(_COLUMNS))

    def __init__(self, seqs: list[Sequence]) -> None:
        self.seqs: list[Sequence] = []  # (a list of its own: `seqs` is copied in)
        self.state = np.zeros((_COLUMNS, 0), np.int64)
        self.extend(seqs)

    def __len__(self) -> int:
        return len(self.seqs)

    def extend(self, seqs: list[Sequence]) -> None:
        """Rows joining the batch (admitted, resumed), with their Sequence's current state."""
        if not seqs:
            return
        n = len(seqs)
        new = np.fromiter(chain.from_iterable([(int(s.seq_id), len(s.prompt_ids), s.params.max_tokens, s.params.stop_at,
                                                s.num_computed, len(s.output_ids), len(s.block_ids))
                                               for s in seqs]), np.int64, _COLUMNS * n).reshape(n, _COLUMNS)
        self.seqs.extend(seqs)
        self.state = np.concatenate([self.state, new.T], axis=1)

    def drop(self, rows: list[int]) -> None:
        """Drop the rows at `rows` (ascending positions: they left the scheduler's running list)."""
        if not rows:
            return
        mask = np.ones(len(self.seqs), bool)
        mask[rows] = False
        # `seqs` is this batch's own list, changed in place: a copy would touch every row's
        # Sequence (its reference count), scattered in memory, where deleting moves pointers only
        seqs = self.seqs
        for i in reversed(rows):
            del seqs[i]
        self.state = self.state.compress(mask, axis=1)

    def sync(self, rows: list[int] | None = None, finishing: bool = False) -> None:
        """Write the counters into the rows' Sequence objects (all, or those at `rows`), as the
        runtime's code reads them. Block ids are placeholders (blocks.py): only their number
        counts. `finishing`: the rows finish next, and their blocks are only counted as they
        are given back, so they get a `range` of that length instead of a list (a finishing
        reasoning row holds hundreds)."""
        seqs = self.seqs if rows is None else [self.seqs[i] for i in rows]
        state = self.state[COMPUTED:] if rows is None else self.state[COMPUTED:, rows]  # computed, out, blocks
        for seq, (computed, out, blocks) in zip(seqs, state.T.tolist()):
            seq.num_computed = computed
            if len(seq.output_ids) != out:
                seq.output_ids = range(out)  # type: ignore[assignment]
            if len(seq.block_ids) != blocks:
                seq.block_ids = range(blocks) if finishing else [NO_ID] * blocks  # type: ignore[assignment]

    def remaining(self) -> IntArray:
        """Sequence.remaining_tokens of each row."""
        return np.maximum(self.max_tokens - self.out, 0)

    def plan_running(self, budget: int, lookahead: int, block_size: int,
                     free: int) -> tuple[IntArray, IntArray, int, int]:
        """Scheduler._schedule_running under the "newest" eviction policy, on `free` blocks:
        (tokens each row feeds, 0 where it is not scheduled; blocks each scheduled row gets;
        how many rows are scheduled, a prefix of the batch; how many stay, a prefix too: the
        rows after them are evicted, the last first)."""
        state = self.state
        computed, out = state[COMPUTED], state[OUT]
        rows = len(self.seqs)
        uncomputed = state[PROMPT] + out - computed
        upto = np.cumsum(uncomputed)
        if not rows or int(upto[-1]) < budget:  # every row sees budget left and feeds all it has (most forwards)
            scheduled, n, whole = rows, uncomputed, None
        else:
            before = upto - uncomputed  # what the rows before it feed, at most
            scheduled = int(before.searchsorted(budget))  # rows that see budget left: a prefix (`before` grows)
            n = np.minimum(uncomputed, budget - before)
            np.maximum(n, 0, out=n)
            whole = n == uncomputed
        end = computed + n
        if lookahead > 1:  # a row that feeds all it has left also books its next decode steps
            later = state[MAX_TOKENS] - out - 1  # (tokens it may still feed after this one)
            np.minimum(np.maximum(later, 0, out=later), lookahead - 1, out=later)  # (np.clip: 3x slower)
            if whole is not None:
                later *= whole
            end += later
        end += block_size - 1
        need = end // block_size - state[BLOCKS]  # ceil(end / block_size) - held
        need[scheduled:] = 0
        np.maximum(need, 0, out=need)
        if int(need.sum()) <= free:  # every allocation of the loop in turn fits: nothing is evicted
            return n, need, scheduled, rows
        # Row i fits once the rows from e on are evicted (their blocks freed) when its need and
        # the earlier rows' add up to at most free + held[e:]. The loop evicts the last row
        # until it fits, so after row i the batch ends at the least such e yet (a row needing
        # none asks what the row before it asked: no change); it stops at the first row the
        # batch no longer reaches (a row that fits no e evicts itself).
        asked = np.cumsum(need[:scheduled])
        room = free + np.concatenate([np.cumsum(state[BLOCKS][::-1])[::-1], [0]])  # for e = 0 .. rows, falling
        fits_up_to = rows - np.searchsorted(room[::-1], asked, side="left")  # the last e that fits (-1: none)
        ends = np.minimum.accumulate(fits_up_to)
        cut = np.flatnonzero(np.arange(scheduled) >= ends)
        if len(cut):
            scheduled = keep = int(cut[0])
        else:
            keep = int(ends[-1]) if scheduled else rows
        n[scheduled:] = 0
        need[scheduled:] = 0
        return n, need, scheduled, keep
