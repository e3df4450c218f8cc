"""The scheduler's waiting queue, indexed by remaining tokens, for fast load reports."""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from itertools import islice

from ..policy.balance import CoroutineInfo
from ..policy.length_prediction import LengthPredictor
from ..runtime.length_order import GroupOf, LengthOrderedQueue
from ..runtime.sequence import Sequence


class CountedRows:
    """Mixin over a waiting queue (the scheduler's deque, or its length-ordered queue), counting
    its rows by remaining tokens.

    A waiting row generates nothing and holds no KV, so what a load report says of it is fixed
    while it waits: each row's remaining tokens are taken once, when it joins, and the counts let
    a report find the rows with most remaining without sorting thousands (a big partition waits
    whole), with the same answer as sorting them all. A CoroutineInfo is made only for the rows
    a report first lists."""

    def _start_counts(self) -> None:
        self.counts: Counter[int] = Counter()
        self.info: dict[Sequence, int] = {}  # remaining tokens, as it joined
        self.reported = _Reported(self.info)  # a row's CoroutineInfo, made when a report first lists it
        self._top: tuple[int, list[CoroutineInfo]] | None = None  # the last report, until the queue changes
        self._remaining: int | None = None

    def _add(self, seq: Sequence) -> None:
        self._top = self._remaining = None
        remaining = self.info[seq] = seq.remaining_tokens
        self.counts[remaining] += 1

    def append(self, seq: Sequence) -> None:
        super().append(seq)  # type: ignore[misc]
        self._add(seq)

    def appendleft(self, seq: Sequence) -> None:
        super().appendleft(seq)  # type: ignore[misc]
        self._add(seq)

    def popleft(self) -> Sequence:
        seq = super().popleft()  # type: ignore[misc]
        self._drop(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        super().remove(seq)  # type: ignore[misc]
        self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        self._top = self._remaining = None
        key = self.info.pop(seq)
        self.reported.pop(seq, None)
        self.counts[key] -= 1
        if not self.counts[key]:
            del self.counts[key]

    @property
    def remaining_tokens(self) -> int:
        if self._remaining is None:
            self._remaining = sum(k * n for k, n in self.counts.items())
        return self._remaining

    def most_remaining(self, limit: int) -> list[CoroutineInfo]:
        """The report of sorted(self, key=remaining, reverse=True)[:limit], ties in queue order
        (the caller must not change the list)."""
        if self._top is not None and self._top[0] == limit:
            return self._top[1]
        top = self._most_remaining(limit)
        self._top = (limit, top)
        return top

    def _most_remaining(self, limit: int) -> list[CoroutineInfo]:
        info, reported = self.info, self.reported
        if len(self) <= limit:  # type: ignore[arg-type]
            picked = sorted(self, key=info.__getitem__, reverse=True)  # type: ignore[call-overload]
        elif len(self.counts) == 1:  # all alike (a partition not started): queue order
            return list(map(reported.__getitem__, islice(self, limit)))  # type: ignore[call-overload]
        else:
            keep, threshold = 0, 0
            for key in sorted(self.counts, reverse=True):
                threshold = key
                keep += self.counts[key]
                if keep >= limit:
                    break
            above = keep - self.counts[threshold]  # rows strictly above the threshold: all kept
            picked = []
            ties = limit - above
            seen_above = 0
            for seq in self:  # type: ignore[attr-defined]
                r = info[seq]
                if r > threshold:
                    picked.append(seq)
                    seen_above += 1
                elif r == threshold and ties:
                    picked.append(seq)
                    ties -= 1
                if not ties and seen_above == above:
                    break
            picked.sort(key=info.__getitem__, reverse=True)
        return list(map(reported.__getitem__, picked))


class WaitingQueue(CountedRows, deque):  # type: ignore[type-arg]
    """The scheduler's waiting deque (arrival order), counted."""

    def __init__(self, items: Iterable[Sequence] = ()) -> None:
        deque.__init__(self)
        self._start_counts()
        for item in items:
            self.append(item)


class LengthWaitingQueue(CountedRows, LengthOrderedQueue):
    """The scheduler's length-ordered queue ("length" admission), counted."""

    def __init__(self, predictor: LengthPredictor, group_of: GroupOf) -> None:
        LengthOrderedQueue.__init__(self, predictor, group_of)
        self._start_counts()


class _Reported(dict):  # type: ignore[type-arg]
    """seq -> its CoroutineInfo as a waiting row, made on its first look-up."""

    def __init__(self, remaining: dict[Sequence, int]) -> None:
        super().__init__()
        self.remaining = remaining

    def __missing__(self, seq: Sequence) -> CoroutineInfo:
        info = self[seq] = CoroutineInfo(int(seq.seq_id), self.remaining[seq], 0)
        return info
