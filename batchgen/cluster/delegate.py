"""Rows of a task on a worker that may not hold engines, run on one that may.

A partition task can land on any worker (Dask schedules the user's whole graph freely); on a
worker the engine rule (eligibility.py) does not admit, its host starts no engine and hands the
rows to an admitted worker's host instead, over the same owner/holder protocol migration uses
(messages.py): the task stays the owner, the rows go out by `batchgen_submit` (not started
yet: the request itself) or `batchgen_adopt` (a suspended state), and come back by
`batchgen_result`. A holder that leaves, bounces them or fails its engine gets them sent on to
another admitted worker; when none is left the task fails, naming the rule.
"""
from __future__ import annotations

import logging
import pickle
import threading
from collections.abc import Callable
from typing import Any

from ..errors import BatchgenError
from .eligibility import EngineWorkers, no_engine_worker_message
from .job import PartitionJob
from .messages import Transport

logger = logging.getLogger(__name__)

# Sends of one job's rows (first sends included) before it gives up: each resend follows a
# holder leaving, bouncing them or failing, so a job that reaches this has no good worker left.
MAX_SENDS_PER_JOB = 32


class Delegate:
    """holders() -> the addresses of the live workers that may hold engines (this one excluded)."""

    def __init__(self, transport: Transport, rule: EngineWorkers, holders: Callable[[], list[str]]) -> None:
        self.transport, self.rule, self.holders = transport, rule, holders
        self._requests: dict[str, list[tuple[Any, Any]]] = {}  # job id -> its rows' (prompt, params)
        self._sends: dict[str, int] = {}
        self._rows_sent: dict[str, int] = {}  # holder -> rows this host gave it (to spread them)
        self._lock = threading.Lock()

    def open(self, job: PartitionJob, requests: list[tuple[Any, Any]]) -> None:
        with self._lock:
            self._requests[job.job_id] = list(requests)
        self.send(job, [(row, b"") for row in range(len(requests))])

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._requests.pop(job_id, None)
            self._sends.pop(job_id, None)

    def send(self, job: PartitionJob, rows: list[tuple[int, bytes]], avoid: frozenset[str] = frozenset()) -> None:
        """Give `rows` ((row, suspended state or b"": not started)) to one admitted worker."""
        if not rows or job.is_done:
            return
        try:
            holder = self._pick(job.job_id, avoid)
        except BatchgenError as exc:
            job.fail(exc)
            return
        submit: list[list[Any]] = []
        adopt: list[list[Any]] = []
        with self._lock:
            requests = self._requests.get(job.job_id)
        if requests is None:  # the task ended meanwhile
            return
        for row, state in rows:
            if not job.moved(row, holder, state, 0):
                continue
            if state:
                adopt.append([job.job_id, row, state])
            else:
                submit.append([row, pickle.dumps(requests[row], protocol=pickle.HIGHEST_PROTOCOL)])
        sent = len(submit) + len(adopt)
        if not sent:
            return
        with self._lock:
            self._rows_sent[holder] = self._rows_sent.get(holder, 0) + sent
        owner, spec_msg = self.transport.address, job.spec.to_msg()

        def failed(exc: BaseException, items: list[tuple[int, bytes]]) -> None:
            logger.info("handing rows of job %s to %s failed (%s); trying another worker", job.job_id, holder, exc)
            kept = dict(job.take_back(rows=[row for row, _ in items]))
            self.send(job, [(row, kept.get(row, state)) for row, state in items], avoid | {holder})

        if submit:
            back = [(int(row), b"") for row, _ in submit]
            self.transport.send(holder, "batchgen_submit", {"owner": owner, "spec": spec_msg, "job_id": job.job_id,
                                                            "rows": submit},
                                on_error=lambda exc, b=back: failed(exc, b))
        if adopt:
            back = [(int(row), state) for _, row, state in adopt]
            self.transport.send(holder, "batchgen_adopt", {"owner": owner, "spec": spec_msg, "items": adopt},
                                on_error=lambda exc, b=back: failed(exc, b))

    def _pick(self, job_id: str, avoid: frozenset[str]) -> str:
        with self._lock:
            self._sends[job_id] = self._sends.get(job_id, 0) + 1
            if self._sends[job_id] > MAX_SENDS_PER_JOB:
                raise BatchgenError(f"job {job_id}: its rows were handed to workers that may run engines "
                                    f"{MAX_SENDS_PER_JOB} times and none kept them")
        mine = self.transport.address
        candidates = [h for h in self.holders() if h != mine]
        if not candidates:
            raise BatchgenError(no_engine_worker_message(self.rule))
        fresh = [h for h in candidates if h not in avoid] or candidates
        with self._lock:
            return min(fresh, key=lambda h: (self._rows_sent.get(h, 0), h))
