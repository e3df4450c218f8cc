"""A simulated load report's movable coroutines, listed only when the balancer reads them.

`plan_migrations` reads the list of its sources only (a few engines a tick); every other report
it only asks whether there is one. Making hundreds of `CoroutineInfo` objects per engine per
tick, and pickling them to the parent process, had cost more than simulating the engines. So a
report keeps the rows as int arrays and builds `reported_movable(...)` (the runner's own choice
and order) on first read.
"""
from __future__ import annotations

import collections.abc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..policy.balance import MAX_REPORTED, CoroutineInfo, reported_movable


class ReportedMovable(collections.abc.Sequence):
    """reported_movable(waiting + running): `waiting` the waiting rows' top, already in report
    order, `running` [r, 3] int rows of (seq_id, remaining, num_computed) in batch order, or a
    function that makes them (r given: `count`)."""

    __slots__ = ("_waiting", "_running", "_count", "_items")

    def __init__(self, waiting: list[CoroutineInfo] | np.ndarray,
                 running: np.ndarray | Callable[[], np.ndarray], count: int | None = None) -> None:
        self._waiting, self._running = waiting, running
        self._count = len(running) if count is None else count  # type: ignore[arg-type]
        self._items: tuple[CoroutineInfo, ...] | None = None

    def __len__(self) -> int:
        return min(MAX_REPORTED, len(self._waiting) + self._count)

    def __getitem__(self, index: Any) -> Any:
        return self._infos()[index]

    def __iter__(self) -> Iterator[CoroutineInfo]:
        return iter(self._infos())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, collections.abc.Sequence) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ReportedMovable({self._infos()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return ReportedMovable, self.packed()

    def _running_rows(self) -> np.ndarray:
        if callable(self._running):
            self._running = self._running()
        return self._running

    def _infos(self) -> tuple[CoroutineInfo, ...]:
        if self._items is None:
            waiting = self._waiting if isinstance(self._waiting, list) else \
                [CoroutineInfo(*row) for row in self._waiting.tolist()]
            self._items = reported_movable(waiting + [CoroutineInfo(*row) for row in self._running_rows().tolist()])
        return self._items

    def packed(self) -> tuple[np.ndarray, np.ndarray]:
        """Both lists as int arrays [k, 3] (what crosses a pipe)."""
        waiting = self._waiting if not isinstance(self._waiting, list) else np.array(
            [(c.seq_id, c.remaining, c.num_computed) for c in self._waiting], dtype=np.int64).reshape(-1, 3)
        return waiting, self._running_rows()
