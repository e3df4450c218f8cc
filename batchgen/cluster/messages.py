"""The messages between hosts (host.py) and the Transport they travel by.

Migration is these messages between hosts (worker.py has the RPC handlers):

    owner --adopt(states)--> holder          holder resumes the coroutines
    holder --result(outputs)--> owner        the row is done; the owner drops the kept state
    holder --bounce(states)--> owner         the holder gives rows back (closing, cannot resume)
    holder --progress(states)--> owner       KV-less snapshots of the rows' progress (`push_progress`)
    holder --forward(states, dst)--> owner   re-migration: the holder is told to pass rows on; the
                                             owner records the new holder, then adopts them to it
    owner --cancel(rows)--> holder           the owning task failed or ended: drop its rows
    owner --submit(requests)--> holder       rows of a task on a worker that may hold no engine
                                             (delegate.py): run them there, results as above

The owner keeps each moved row's suspended state until its result arrives, replacing it with the
holder's newer snapshots; when the holder leaves the cluster the owner resumes the row itself
from the newest state it has (`recover`). A re-migration goes through the owner (two hops, not
one) so that the owner always knows a row's holder before that holder has it: a direct
holder-to-holder hand-off could die with the new holder before the owner heard of it. All
sends go through a `Transport`; outside Dask there is none and nothing ever migrates.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol

from .runner import RowRef


class Transport(Protocol):
    address: str

    def send(self, address: str, op: str, msg: dict[str, Any],
             on_error: Callable[[BaseException], None] | None = None) -> None:
        """Fire-and-forget RPC `op(**msg)` to `address`; thread-safe; on_error runs on failure."""
        ...


def by_owner(items: list[tuple[RowRef, list[Any]]]) -> dict[str, dict[str, list[list[Any]]]]:
    """[(ref, fields)] of rows held for other workers -> {owner: {job_id: [[row, *fields]]}}, the
    shape of the result / forward / progress messages."""
    grouped: dict[str, dict[str, list[list[Any]]]] = defaultdict(lambda: defaultdict(list))
    for ref, fields in items:
        grouped[ref.owner][ref.job_id].append([ref.row, *fields])  # type: ignore[index]
    return {owner: dict(jobs) for owner, jobs in grouped.items()}
