"""Sending a host's rows elsewhere: carrying out the balancer's orders, forwarding rows held for
other workers back through their owners, and taking rows back when a send fails.

A mixin of Host (host.py), which holds the state these methods share with the rest of the host
under one lock: the job table, the transport and the counters. Receiving (`adopt`) and recovery
stay in Host.
"""
from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from ..policy.balance import Migration
from . import messages
from .engines import EngineSet
from .host_report import HostCounters
from .job import PartitionJob
from .messages import Transport
from .runner import RowRef
from .spec import EngineSpec

logger = logging.getLogger(__name__)


class SendsRows:
    transport: Transport | None
    counters: HostCounters
    engines: EngineSet
    _jobs: dict[str, PartitionJob]
    _lock: threading.RLock
    _live: set[str] | None

    if TYPE_CHECKING:  # Host's, used here
        @property
        def address(self) -> str | None: ...

        def adopt(self, owner: str, spec: EngineSpec, items: list[tuple[str, int, bytes]]) -> None: ...

        def _resume_here(self, job_id: str, rows: list[int], fresh: dict[int, bytes]) -> None: ...

        def _resume_states(self, job: PartitionJob, states: list[tuple[int, bytes]]) -> None: ...

    def execute(self, order: Migration) -> None:
        """Carry out a scheduler order: suspend the coroutines, keep their state, send them."""
        runner = self.engines.for_key(order.model)
        if runner is None or self.transport is None:
            return
        fut = runner.move_out(list(order.seq_ids))
        fut.add_done_callback(lambda f: self._moved_out(order, runner.spec, f.result()) if not f.exception() else None)

    def _moved_out(self, order: Migration, spec: EngineSpec, items: list[tuple[RowRef, int, bytes]]) -> None:
        """Own rows go straight to `order.dst`; rows held for others go to their owners to forward."""
        self._send_moved(order.dst, spec, [item for item in items if item[0].is_local])
        foreign = [item for item in items if not item[0].is_local]
        if foreign:
            self._forward(order.dst, spec, foreign)

    def _send_moved(self, dst: str, spec: EngineSpec, items: list[tuple[RowRef, int, bytes]]) -> None:
        sent: list[list[Any]] = []
        for ref, num_output, state in items:
            with self._lock:
                job = self._jobs.get(ref.job_id)
            if job is None or not job.moved(ref.row, dst, state, num_output):
                continue  # the task ended meanwhile: nobody waits for this row
            sent.append([ref.job_id, ref.row, state])
        if not sent or self.transport is None:
            return
        with self._lock:
            self.counters.migrated_out += len(sent)
        msg = {"owner": self.transport.address, "spec": spec.to_msg(), "items": sent}
        self.transport.send(dst, "batchgen_adopt", msg, on_error=lambda exc: self._take_back_rows(dst, sent, exc))

    def _forward(self, dst: str, spec: EngineSpec, items: list[tuple[RowRef, int, bytes]]) -> None:
        if self.transport is None:
            return
        by_owner = messages.by_owner([(ref, [num_output, state]) for ref, num_output, state in items])
        with self._lock:
            self.counters.forwarded += len(items)
        for owner, jobs in by_owner.items():
            back = [(job_id, row, state) for job_id, rows in jobs.items() for row, _, state in rows]
            # Undelivered, the owner still thinks the rows are here: keep running them (an owner
            # that has really left is noticed by `drop_orphans`, which then drops them).
            self.transport.send(owner, "batchgen_forward", {"holder": self.transport.address, "dst": dst,
                                                            "spec": spec.to_msg(), "jobs": jobs},
                                on_error=lambda exc, o=owner, b=back: self._forward_failed(o, spec, b))

    def _forward_failed(self, owner: str, spec: EngineSpec, items: list[tuple[str, int, bytes]]) -> None:
        with self._lock:
            gone = self._live is not None and owner not in self._live
        if not gone:  # keep running them; an owner that leaves later is caught by drop_orphans
            self.adopt(owner, spec, items)

    def receive_forward(self, holder: str, dst: str, spec: EngineSpec, jobs: dict[str, list[list[Any]]]) -> None:
        """The holder of some of this host's rows passed them back, to go on to `dst` (or to be
        resumed here when `dst` is this worker). Rows this host no longer thinks `holder` holds
        (already recovered here, or finished) are dropped: they run, or ran, elsewhere."""
        for job_id, items in jobs.items():
            with self._lock:
                job = self._jobs.get(job_id)
            if job is None or job.is_done:
                continue
            held = job.holders()
            mine = [(int(row), int(n), state) for row, n, state in items if held.get(int(row)) == holder]
            if not mine:
                continue
            if dst == self.address:
                job.take_back(rows=[row for row, _, _ in mine])
                self._resume_states(job, [(row, state) for row, _, state in mine])
                continue
            self._send_moved(dst, spec, [(RowRef(job_id, row), n, state) for row, n, state in mine])

    def _take_back_rows(self, holder: str, sent: list[list[Any]], exc: BaseException) -> None:
        logger.warning("migration to %s failed (%s); resuming %d rows here", holder, exc, len(sent))
        by_job: dict[str, list[int]] = defaultdict(list)
        for job_id, row, _ in sent:
            by_job[job_id].append(row)
        for job_id, rows in by_job.items():
            self._resume_here(job_id, rows, {})
        with self._lock:
            self.counters.recovered += len(sent)
