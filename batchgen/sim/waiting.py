"""The scheduler's waiting deque, indexed by remaining tokens, for fast load reports."""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from itertools import islice

from ..cluster.balance import CoroutineInfo
from ..runtime.sequence import Sequence


class WaitingQueue(deque):  # type: ignore[type-arg]
    """The scheduler's waiting deque, counting its rows by remaining tokens.

    A waiting row generates nothing and holds no KV, so what a load report says of it is fixed
    while it waits: each row's CoroutineInfo is made once, when it joins, and the counts let a
    report find the rows with most remaining without sorting thousands (a big partition waits
    whole), with the same answer as sorting them all."""

    def __init__(self, items: Iterable[Sequence] = ()) -> None:
        super().__init__()
        self.counts: Counter[int] = Counter()
        self.info: dict[Sequence, CoroutineInfo] = {}
        for item in items:
            self.append(item)

    def _add(self, seq: Sequence) -> None:
        info = self.info[seq] = CoroutineInfo(int(seq.seq_id), seq.remaining_tokens, 0)
        self.counts[info.remaining] += 1

    def append(self, seq: Sequence) -> None:
        super().append(seq)
        self._add(seq)

    def appendleft(self, seq: Sequence) -> None:
        super().appendleft(seq)
        self._add(seq)

    def popleft(self) -> Sequence:
        seq = super().popleft()
        self._drop(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        super().remove(seq)
        self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        key = self.info.pop(seq).remaining
        self.counts[key] -= 1
        if not self.counts[key]:
            del self.counts[key]

    @property
    def remaining_tokens(self) -> int:
        return sum(k * n for k, n in self.counts.items())

    def most_remaining(self, limit: int) -> list[CoroutineInfo]:
        """The report of sorted(self, key=remaining, reverse=True)[:limit], ties in queue order."""
        info = self.info
        if len(self) <= limit:
            return sorted((info[s] for s in self), key=_remaining, reverse=True)
        if len(self.counts) == 1:  # all alike (a partition not started): queue order
            return [info[s] for s in islice(self, limit)]
        keep, threshold = 0, 0
        for key in sorted(self.counts, reverse=True):
            threshold = key
            keep += self.counts[key]
            if keep >= limit:
                break
        above = keep - self.counts[threshold]  # rows strictly above the threshold: all kept
        picked: list[CoroutineInfo] = []
        ties = limit - above
        seen_above = 0
        for seq in self:
            c = info[seq]
            if c.remaining > threshold:
                picked.append(c)
                seen_above += 1
            elif c.remaining == threshold and ties:
                picked.append(c)
                ties -= 1
            if not ties and seen_above == above:
                break
        return sorted(picked, key=_remaining, reverse=True)


def _remaining(c: CoroutineInfo) -> int:
    return c.remaining
