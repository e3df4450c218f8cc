"""The scheduler's waiting deque, indexed by remaining tokens, for fast load reports."""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from itertools import islice

from ..runtime.sequence import Sequence


def _remaining(seq: Sequence) -> int:
    return seq.remaining_tokens


class WaitingQueue(deque):  # type: ignore[type-arg]
    """The scheduler's waiting deque, counting its rows by remaining tokens.

    A waiting row generates nothing, so its remaining count is fixed while it waits; the counts
    let a load report find the rows with most remaining without sorting thousands (a big
    partition waits whole), with the same answer as sorting them all."""

    def __init__(self, items: Iterable[Sequence] = ()) -> None:
        super().__init__()
        self.counts: Counter[int] = Counter()
        for item in items:
            self.append(item)

    def append(self, seq: Sequence) -> None:
        super().append(seq)
        self.counts[_remaining(seq)] += 1

    def appendleft(self, seq: Sequence) -> None:
        super().appendleft(seq)
        self.counts[_remaining(seq)] += 1

    def popleft(self) -> Sequence:
        seq = super().popleft()
        self._drop(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        super().remove(seq)
        self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        key = _remaining(seq)
        self.counts[key] -= 1
        if not self.counts[key]:
            del self.counts[key]

    @property
    def remaining_tokens(self) -> int:
        return sum(k * n for k, n in self.counts.items())

    def most_remaining(self, limit: int) -> list[Sequence]:
        """sorted(self, key=remaining, reverse=True)[:limit], ties in queue order."""
        if len(self) <= limit:
            return sorted(self, key=_remaining, reverse=True)
        if len(self.counts) == 1:  # all alike (a partition not started): queue order
            return list(islice(self, limit))
        keep, threshold = 0, 0
        for key in sorted(self.counts, reverse=True):
            threshold = key
            keep += self.counts[key]
            if keep >= limit:
                break
        above = keep - self.counts[threshold]  # rows strictly above the threshold: all kept
        picked: list[Sequence] = []
        ties = limit - above
        seen_above = 0
        for seq in self:
            r = _remaining(seq)
            if r > threshold:
                picked.append(seq)
                seen_above += 1
            elif r == threshold and ties:
                picked.append(seq)
                ties -= 1
            if not ties and seen_above == above:
                break
        return sorted(picked, key=_remaining, reverse=True)
