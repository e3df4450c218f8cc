"""Host: a worker's (or a plain process's) engines, the jobs of its tasks, and migration (sending rows:
host_migration.py).

One Host per Dask worker (`worker.extensions["batchgen"]`) or, outside Dask, one per process.
It keeps one EngineRunner per EngineSpec, so every partition that needs the same model on this
worker joins one engine. Rows migrate between hosts by the messages that messages.py lists (and
worker.py's RPC handlers deliver here). On a worker that may not hold engines (a mixed
cluster: eligibility.py) a Delegate hands its tasks' rows to a worker that may (delegate.py).
"""
from __future__ import annotations

import dataclasses
import logging
import pickle
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..errors import BatchgenError
from ..outputs import RequestOutput
from . import messages
from .cancelled_jobs import CancelledJobs
from .dask_task import current_task_group
from .delegate import Delegate
from .eligibility import EngineWorkers
from .engines import EngineSet
from .host_migration import SendsRows
from .host_progress import PROGRESS_EVERY_S, ProgressSender
from .host_report import GroupRows, HostCounters, load_report
from .job import PartitionJob
from .messages import Transport
from .runner import EngineRunner, Request, RowRef, RunnerLoad
from .spec import EngineSpec
from .timeline import Timeline

logger = logging.getLogger(__name__)




class Host(SendsRows):
    def __init__(self, transport: Transport | None = None) -> None:
        self.transport = transport
        self.counters = HostCounters()
        self.timeline = Timeline()  # a job's fixed costs here: task start, engine load, first/last token
        self.engines = EngineSet(self._on_done, self._on_fail, self.timeline)
        self._jobs: dict[str, PartitionJob] = {}
        self._lock = threading.RLock()
        self._closed = False
        self.peak_jobs = 0  # most partitions waiting here at once (seceded tasks)
        # job id -> rows handed to the engine thread and not yet in its engine: the load report
        # does not show them, so the balancer must not read this worker as idle meanwhile
        self._submitting: dict[str, int] = {}
        self._progress = ProgressSender(transport, self.engines, self.counters, self._lock) \
            if transport is not None else None
        self._cancelled = CancelledJobs()  # (owner, job_id) of jobs whose coroutines are refused here
        self._live: set[str] | None = None  # live workers as last told (drop_orphans); None: not known
        self.delegate: Delegate | None = None  # set: this host may hold no engine (eligibility.py)
        self.group_rows = GroupRows()  # row counts per Dask task group, for the dashboard

    @property
    def address(self) -> str | None:
        return self.transport.address if self.transport is not None else None

    def hold_no_engines(self, rule: EngineWorkers, holders: Callable[[], list[str]]) -> None:
        """From now on start no engine: this worker is outside `rule`. Its tasks' rows go to the
        workers `holders()` names (live ones the rule admits); coroutines sent here go back."""
        if self.transport is None:
            raise BatchgenError("a host without a transport cannot hand rows to other workers")
        self.engines.refuse(f"this worker may not run batchgen engines: they run only on workers with "
                            f"{rule.describe()}")
        self.delegate = Delegate(self.transport, rule, holders)

    # -- engines ----------------------------------------------------------------------------------
    def runner(self, spec: EngineSpec) -> EngineRunner:
        """The engine for `spec`, started on first use (a closed host only serves running jobs)."""
        return self.engines.get(spec)

    def prestart(self, spec: EngineSpec) -> None:
        """Start `spec`'s engine now, ahead of its tasks (prestart.py); nothing once closed."""
        with self._lock:
            if self._closed:
                return
        try:
            self.engines.get(spec)
        except BatchgenError:  # closed meanwhile
            pass

    def loads(self) -> dict[str, RunnerLoad]:
        return self.engines.loads()

    def release_idle(self, model: str | None = None, timeout: float = 10.0) -> int:
        """Stop the engines (of `model`, an EngineSpec key, or all) that hold no coroutine and
        serve no task here, freeing their memory; -> how many stopped. A later task or migrated
        coroutine starts the engine again."""
        with self._lock:
            busy = {job.spec for job in self._jobs.values()}
        return self.engines.release_idle(busy, model, timeout)

    # -- a task's partition -----------------------------------------------------------------------
    def open_job(self, spec: EngineSpec, requests: list[tuple[Any, Any]]) -> PartitionJob:
        """Queue (prompt, params) rows in this host's engine for `spec`; -> the job to wait on."""
        job = PartitionJob(spec, len(requests))
        job.group = current_task_group()
        with self._lock:
            if self._closed:
                raise BatchgenError("this batchgen host is closed (worker plugin removed or worker closing)")
            if job.group is not None:
                self.group_rows.opened(job.group, len(requests))
            self._jobs[job.job_id] = job
            self.peak_jobs = max(self.peak_jobs, len(self._jobs))
            if self.delegate is None:
                self._submitting[job.job_id] = len(requests)
            else:
                self.counters.delegated += len(requests)
        self.timeline.task_opened()
        if self.delegate is not None:
            self.delegate.open(job, requests)
            return job
        batch: list[Request] = [(RowRef(job.job_id, i), p, sp) for i, (p, sp) in enumerate(requests)]
        fut = self.engines.call(spec, lambda runner: runner.submit(batch))
        fut.add_done_callback(lambda f: self._submitted(job, f))
        return job

    def _submitted(self, job: PartitionJob, fut: Future[Any]) -> None:
        with self._lock:
            self._submitting.pop(job.job_id, None)
        if fut.exception() is not None:
            job.fail(fut.exception())

    def close_job(self, job: PartitionJob) -> None:
        """Forget the job; any of its coroutines still here (duplicates, a failed job) are dropped."""
        with self._lock:
            known = self._jobs.pop(job.job_id, None) is not None
            last = self._closed and not self._jobs
        if known:
            self.timeline.task_closed()
        if self.delegate is not None:
            self.delegate.forget(job.job_id)
        runner = self.engines.peek(job.spec)
        if runner is not None:
            runner.cancel(lambda ref: ref.is_local and ref.job_id == job.job_id)
        self._cancel_remote(job)
        if last:
            self.engines.stop_all()

    def _cancel_remote(self, job: PartitionJob) -> None:
        """Tell the holders of a closed job's unfinished moved rows to drop them (a failed task:
        Dask reruns it, and those coroutines would only compute rows nobody waits for)."""
        if self.transport is None:
            return
        by_holder: dict[str, list[int]] = defaultdict(list)
        for row, holder in job.holders().items():
            by_holder[holder].append(row)
        for holder, rows in by_holder.items():
            self.transport.send(holder, "batchgen_cancel", {"owner": self.transport.address, "job_id": job.job_id,
                                                            "rows": rows})

    def _on_done(self, done: list[tuple[RowRef, RequestOutput]]) -> None:
        for ref, out in done:
            if ref.owner is None:
                self._deliver(ref.job_id, ref.row, out)
        remote = messages.by_owner([(ref, [pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)])
                            for ref, out in done if ref.owner is not None])
        for owner, jobs in remote.items():
            with self._lock:
                self.counters.returned += sum(len(items) for items in jobs.values())
            if self.transport is not None:
                self.transport.send(owner, "batchgen_result", {"jobs": jobs})

    def _deliver(self, job_id: str, row: int, out: RequestOutput) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is not None and job.deliver(row, out):
            with self._lock:
                self.counters.rows_done += 1
                self.counters.generated_tokens += out.num_generated_tokens
                if job.group is not None:  # (error: text and image outputs alike)
                    self.group_rows.finished(job.group, getattr(out, "error", None) is not None)

    def _on_fail(self, spec: EngineSpec, exc: BaseException, refs: list[RowRef]) -> None:
        """The engine could not load or crashed: its jobs fail (Dask retries them); rows held for
        other workers go back to their owners, who resume them from the states they kept."""
        with self._lock:
            jobs = [j for j in self._jobs.values() if j.spec == spec]
        for job in jobs:
            job.fail(exc)
        by_owner: dict[str, list[RowRef]] = defaultdict(list)
        for ref in refs:
            if ref.owner is not None:
                by_owner[ref.owner].append(ref)
        for owner, owned in by_owner.items():
            self._bounce(owner, owned)

    # -- rows held for other workers' tasks, and recovery (sending rows: host_migration.py) --------
    def receive_cancel(self, owner: str, job_id: str, rows: list[int]) -> None:
        """The task owning `job_id` on `owner` ended: drop its coroutines held here."""
        with self._lock:
            self._cancelled.add(owner, job_id)
        for runner in self.engines.live():
            fut = runner.cancel(lambda ref: ref.owner == owner and ref.job_id == job_id)
            fut.add_done_callback(lambda f: self._count_cancelled(f.result()) if not f.exception() else None)

    def _count_cancelled(self, n: int) -> None:
        with self._lock:
            self.counters.cancelled += n

    def recover(self, live: set[str]) -> int:
        """Resume here every moved row whose holder is no longer in the cluster (cheap; call often)."""
        with self._lock:
            jobs = list(self._jobs.values())
        n = 0
        for job in jobs:
            back = job.take_back(live=live)
            if back:
                n += len(back)
                logger.warning("resuming %d rows of job %s here: their holder left", len(back), job.job_id)
                self._resume_states(job, back)
        with self._lock:
            self.counters.recovered += n
        return n

    def drop_orphans(self, live: set[str]) -> None:
        """Stop coroutines held for tasks on workers that left: Dask reruns those tasks elsewhere."""
        with self._lock:
            self._live = set(live)
        for runner in self.engines.live():
            runner.cancel(lambda ref: ref.owner is not None and ref.owner not in live)

    def _resume_here(self, job_id: str, rows: list[int], fresh: dict[int, bytes]) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            return
        kept = dict(job.take_back(rows=rows))
        self._resume_states(job, [(row, fresh.get(row, state)) for row, state in kept.items()])

    def _resume_states(self, job: PartitionJob, states: list[tuple[int, bytes]]) -> None:
        if self.delegate is not None:  # no engine here: on to another worker that may hold one
            self.delegate.send(job, states)
            return
        fut = self.engines.call(job.spec, lambda runner: runner.adopt(
            [(RowRef(job.job_id, row), state) for row, state in states]))

        def check(f: Any) -> None:
            exc = f.exception()
            if exc is None and f.result():
                exc = BatchgenError(f"job {job.job_id}: cannot resume rows {[r.row for r in f.result()]} "
                                    "from their suspended state")
            if exc is not None:
                job.fail(exc)
        fut.add_done_callback(check)

    # -- migration: holder side (called by the RPC handlers) --------------------------------------
    def adopt(self, owner: str, spec: EngineSpec, items: list[tuple[str, int, bytes]]) -> None:
        with self._lock:
            items = [item for item in items if (owner, item[0]) not in self._cancelled]
        refs = [(RowRef(job_id, row, owner), state) for job_id, row, state in items]
        if not refs:
            return
        with self._lock:
            closed = self._closed or self.delegate is not None
            if not closed:
                self.counters.migrated_in += len(refs)
        if closed:
            self._bounce(owner, [ref for ref, _ in refs], dict(refs))
            return
        fut = self.engines.call(spec, lambda runner: runner.adopt(refs))

        def rejected(f: Any) -> None:
            bad = f.result() if not f.exception() else [ref for ref, _ in refs]
            if bad:
                self._bounce(owner, bad)
        fut.add_done_callback(rejected)

    def receive_submit(self, owner: str, spec: EngineSpec, job_id: str, rows: list[tuple[int, Any, Any]]) -> None:
        """Run not-started rows (row, prompt, params) of `owner`'s task, whose worker may hold no
        engine; results go back as for adopted rows, rows that cannot run here are bounced."""
        refs = [RowRef(job_id, row, owner) for row, _, _ in rows]
        with self._lock:
            refused = self._closed or self.delegate is not None or (owner, job_id) in self._cancelled
            if not refused:
                self.counters.submitted_in += len(rows)
        if refused:
            if (owner, job_id) not in self._cancelled:
                self._bounce(owner, refs)
            return
        batch: list[Request] = [(ref, prompt, params) for ref, (_, prompt, params) in zip(refs, rows)]
        fut = self.engines.call(spec, lambda runner: runner.submit(batch))
        fut.add_done_callback(lambda f: self._bounce(owner, refs) if f.exception() is not None else None)

    def _bounce(self, owner: str, refs: list[RowRef], states: dict[RowRef, bytes] | None = None) -> None:
        if self.transport is None:
            return
        jobs: dict[str, list[list[Any]]] = defaultdict(list)
        for ref in refs:
            jobs[ref.job_id].append([ref.row, (states or {}).get(ref)])
        self.transport.send(owner, "batchgen_bounce", {"jobs": dict(jobs)})

    def push_progress(self, every: float = PROGRESS_EVERY_S) -> None:
        """Send each owner KV-less snapshots of its rows held here that made progress (at most
        every `every` seconds; cheap to call on every load push): host_progress.py."""
        with self._lock:
            if self._closed:
                return
        if self._progress is not None:
            self._progress.push(every)

    def receive_progress(self, holder: str, jobs: dict[str, list[list[Any]]]) -> None:
        n = 0
        for job_id, items in jobs.items():
            with self._lock:
                job = self._jobs.get(job_id)
            if job is not None:
                n += sum(job.progress(int(row), holder, int(num_output), state) for row, num_output, state in items)
        with self._lock:
            self.counters.refreshed += n

    def receive_results(self, jobs: dict[str, list[list[Any]]]) -> None:
        for job_id, items in jobs.items():
            for row, blob in items:
                self._deliver(job_id, int(row), pickle.loads(blob))

    def receive_bounce(self, jobs: dict[str, list[list[Any]]]) -> None:
        for job_id, items in jobs.items():
            fresh = {int(row): state for row, state in items if state is not None}
            self._resume_here(job_id, [int(row) for row, _ in items], fresh)

    # -- reporting and shutdown -------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """This host's load for the scheduler plugin: per engine, plus counters."""
        engines = {key: load_report(load) for key, load in self.loads().items()}
        with self._lock:
            counters = dataclasses.asdict(self.counters)
            jobs = len(self._jobs)
            submitting = sum(self._submitting.values())
            job_rows = self.group_rows.as_dict()
        return {"engines": engines, "counters": counters, "jobs": jobs, "submitting_rows": submitting,
                "job_rows": job_rows,
                "peak_jobs": self.peak_jobs,
                "timeline": self.timeline.as_dict()}

    def close(self) -> None:
        """Detach: take no new jobs or coroutines; hand foreign coroutines back to their owners
        (with their progress); resume here this host's rows held elsewhere (their results can no
        longer arrive); let running jobs finish, then stop the engines.

        Tasks are not failed: when the worker is going away Dask reruns them elsewhere, and when
        only the plugin is removed they complete here without balancing.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._jobs.values())
        self.engines.close()
        for runner in self.engines.live():
            if self.transport is not None:
                try:
                    items = runner.suspend(match=lambda ref: not ref.is_local, with_kv=False).result(timeout=30)
                except Exception:  # noqa: BLE001 - owners still hold the states they sent
                    items = []
                by_owner: dict[str, list[tuple[RowRef, bytes]]] = defaultdict(list)
                for ref, state in items:
                    by_owner[ref.owner].append((ref, state))  # type: ignore[index]
                for owner, pairs in by_owner.items():
                    self._bounce(owner, [r for r, _ in pairs], dict(pairs))
        for job in jobs:
            back = job.take_back(live=set())
            if back:
                self._resume_states(job, back)
        with self._lock:
            idle = not self._jobs
        if idle:
            self.engines.stop_all()
