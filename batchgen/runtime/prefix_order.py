"""Admission order for batch jobs: rows that share a prefix run together, while it is cached.

A batch job knows its rows ahead of time (BatchLLM, BlendServe reorder them globally); a stream
of millions cannot be sorted whole, so this sorts what waits. Waiting rows are admitted in
*epochs*: when the current epoch is used up, every row that arrived since is sorted by its
chain of block hashes (prefix-trie order: rows sharing k leading blocks are adjacent) and becomes
the next epoch. A row therefore waits at most for the rest of the current epoch and its own,
and each shared prefix is computed about once per epoch however its rows were interleaved.
Epochs alternate ascending and descending, so the group admitted last in one epoch is the
first of the next, while it is still cached.

Rows put back at the head (preempted, put off for a prefix being computed) go first, in order,
as in the plain deque. The queue offers the deque operations the scheduler and engine use.
No torch.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator

from .sequence import Sequence


class PrefixOrderedQueue:
    def __init__(self, key: Callable[[Sequence], Hashable]) -> None:
        self._key = key
        self._front: deque[Sequence] = deque()  # put back at the head
        self._epoch: deque[Sequence] = deque()  # sorted
        self._arrivals: list[Sequence] = []  # the next epoch, arrival order
        self._descending = False
        self.epochs = 0

    def append(self, seq: Sequence) -> None:
        self._arrivals.append(seq)

    def appendleft(self, seq: Sequence) -> None:
        self._front.appendleft(seq)

    def _next_epoch(self) -> None:
        if self._front or self._epoch or not self._arrivals:
            return
        # sorted() is stable with reverse=True too: rows with equal keys keep arrival order
        self._epoch = deque(sorted(self._arrivals, key=self._key, reverse=self._descending))
        self._arrivals = []
        self._descending = not self._descending
        self.epochs += 1

    def __getitem__(self, index: int) -> Sequence:
        if index != 0:
            raise IndexError("PrefixOrderedQueue gives its head only ([0])")
        self._next_epoch()
        if self._front:
            return self._front[0]
        if self._epoch:
            return self._epoch[0]
        raise IndexError("waiting queue is empty")

    def popleft(self) -> Sequence:
        head = self[0]
        (self._front if self._front else self._epoch).popleft()
        return head

    def remove(self, seq: Sequence) -> None:
        for part in (self._front, self._epoch, self._arrivals):
            if seq in part:  # Sequence compares by identity
                part.remove(seq)
                return
        raise ValueError("sequence is not waiting")

    def __contains__(self, seq: object) -> bool:
        return seq in self._front or seq in self._epoch or seq in self._arrivals

    def __len__(self) -> int:
        return len(self._front) + len(self._epoch) + len(self._arrivals)

    def __bool__(self) -> bool:
        return bool(self._front or self._epoch or self._arrivals)

    def __iter__(self) -> Iterator[Sequence]:
        """In admission order (as far as it is decided: arrivals are not sorted yet)."""
        yield from self._front
        yield from self._epoch
        yield from self._arrivals

    def keep(self, wanted: Callable[[Sequence], bool]) -> None:
        """Drop the rows `wanted` refuses, asked in admission order (as __iter__ gives them)."""
        self._front = deque(s for s in self._front if wanted(s))
        self._epoch = deque(s for s in self._epoch if wanted(s))
        self._arrivals = [s for s in self._arrivals if wanted(s)]
