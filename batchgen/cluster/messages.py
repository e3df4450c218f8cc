"""The messages between hosts (host.py) and the Transport they travel by; who sends which and
why a re-migration goes through the owner: docs/concepts/dask-plugin.md#the-migration-messages.
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
