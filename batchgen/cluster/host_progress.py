"""A holder's progress checkpoints: KV-less snapshots of the rows it runs for other workers,
sent to their owners at most once an interval, so that an owner whose holder vanishes resumes
them from their last progress instead of from the start (Host.recover)."""
from __future__ import annotations

import threading
import time

from . import messages
from .engines import EngineSet
from .host_report import HostCounters
from .messages import Transport
from .runner import RowRef

# How often a holder sends owners the progress of their rows (at most; on the load push).
PROGRESS_EVERY_S = 1.0


class ProgressSender:
    """Sends the progress of `engines`' foreign rows over `transport`; counts them in
    `counters` under `lock` (the host's)."""

    def __init__(self, transport: Transport, engines: EngineSet, counters: HostCounters,
                 lock: threading.RLock) -> None:
        self.transport, self.engines, self.counters, self.lock = transport, engines, counters, lock
        self.last = 0.0  # monotonic time of the last push

    def push(self, every: float = PROGRESS_EVERY_S) -> None:
        """Ask every live engine for its rows that made progress, unless the last push was
        under `every` seconds ago (cheap to call on every load push); they go out when ready."""
        now = time.monotonic()
        with self.lock:
            if now - self.last < every:
                return
            self.last = now
        for runner in self.engines.live():
            runner.progress().add_done_callback(lambda f: None if f.exception() else self._send(f.result()))

    def _send(self, items: list[tuple[RowRef, int, bytes]]) -> None:
        if not items:
            return
        by_owner = messages.by_owner([(ref, [num_output, state]) for ref, num_output, state in items])
        with self.lock:
            self.counters.progress_sent += len(items)
        for owner, jobs in by_owner.items():
            self.transport.send(owner, "batchgen_progress", {"holder": self.transport.address, "jobs": jobs})
