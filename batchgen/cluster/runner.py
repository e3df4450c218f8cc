"""EngineRunner: one engine and the one thread that owns it.

The engine (any CoroutineEngine: text or image) is not thread-safe, so nothing touches it but
the loop thread. Everyone else (tasks
adding rows, RPC handlers adopting migrated coroutines, migration orders) sends a command that
runs at the next inter-forward yield point, between two `step()` calls. All partitions on a
worker therefore run combined: each forward batches the coroutines of every partition.

Each coroutine in the engine carries a `RowRef`: which job and row it computes, and which
worker owns that job (None: this one). Finished rows go to `on_done` in batches, from the loop
thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..policy.balance import MAX_REPORTED, CoroutineInfo, reported_movable_rows
from ..policy.speed import SpeedMeter, at_capacity
from .spec import EngineSpec

if TYPE_CHECKING:
    from ..engine.protocol import CoroutineEngine, CoroutineOutput
    from .timeline import Timeline

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["MAX_REPORTED", "EngineRunner", "RowRef", "RunnerLoad"]
_SNAPSHOT_EVERY_S = 0.1


@dataclass(frozen=True, slots=True)
class RowRef:
    job_id: str
    row: int
    owner: str | None = None  # worker address of the owning task; None: this worker

    @property
    def is_local(self) -> bool:
        return self.owner is None


@dataclass(frozen=True, slots=True)
class RunnerLoad:
    ready: bool = False
    waiting: int = 0
    running: int = 0
    kv_used: float = 0.0
    remaining_tokens: int = 0
    tokens_per_s: float = 0.0
    generated_tokens: int = 0
    movable: tuple[CoroutineInfo, ...] = ()
    speed: float = 0.0  # peak tokens/s while saturated, slowly forgotten; 0: never saturated yet
    expert_hit_rate: float = 1.0  # routed experts found in device memory (1.0: all resident)
    kv_capacity_tokens: int = 0  # the KV pool's size and the batch's seats: the balancer counts
    max_num_seqs: int = 0  # its planned orders into them
    adopted: int = 0  # coroutines resumed here from other workers so far (in this snapshot)
    device: str = ""  # the engine's device class (Engine.device_class): equal classes, equal speed


Done = Callable[[list[tuple[RowRef, "CoroutineOutput"]]], None]
Request = tuple[RowRef, Any, Any]  # (ref, request, its params): a prompt and SamplingParams for text


class EngineRunner:
    """An engine on its own thread. `on_done(rows)` gets finished rows; `on_fail(exc, rows)` gets
    the rows that were in the engine when it could not load or crashed."""

    def __init__(self, spec: EngineSpec, on_done: Done,
                 on_fail: Callable[[BaseException, list[RowRef]], None], timeline: Timeline | None = None) -> None:
        """timeline: told when the engine loads and how many tokens each step generated."""
        self.spec = spec
        self._timeline = timeline
        self._on_done, self._on_fail = on_done, on_fail
        self._inbox: queue.SimpleQueue[tuple[Callable[[CoroutineEngine], Any], Future[Any]]] = queue.SimpleQueue()
        self._tickets: dict[int, RowRef] = {}
        self._progress_sent: dict[int, int] = {}  # progress of the last snapshot sent per held row
        self._load = RunnerLoad()
        self._closed = threading.Event()
        self._gate = threading.Lock()  # a command is either queued before close / failure, or refused
        self.failure: BaseException | None = None
        self._last_snap = 0.0
        self._adopted = 0
        self._meter = SpeedMeter(time.monotonic())
        self._thread = threading.Thread(target=self._run, name=f"batchgen-engine:{spec.model}", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------------
    def call(self, fn: Callable[[CoroutineEngine], T]) -> Future[T]:
        """Run fn(engine) on the loop thread at the next yield point."""
        fut: Future[T] = Future()
        with self._gate:
            if self.failure is None and not self._closed.is_set():
                self._inbox.put((fn, fut))
                return fut
        fut.set_exception(self.failure or RuntimeError("engine runner is closed"))
        return fut

    def submit(self, requests: list[Request]) -> Future[None]:
        return self.call(lambda engine: self._add(engine, requests))

    def adopt(self, items: list[tuple[RowRef, bytes]]) -> Future[list[RowRef]]:
        """Resume suspended coroutines here; -> the refs whose state could not be resumed."""
        return self.call(lambda engine: self._resume(engine, items))

    def suspend(self, seq_ids: list[int] | None = None, match: Callable[[RowRef], bool] | None = None,
                with_kv: bool | None = None) -> Future[list[tuple[RowRef, bytes]]]:
        """Suspend the given (or matching) unfinished coroutines and hand back their state."""
        return self.call(lambda engine: self._suspend(engine, seq_ids, match, with_kv))

    def move_out(self, seq_ids: list[int], match: Callable[[RowRef], bool] | None = None,
                 ) -> Future[list[tuple[RowRef, int, bytes]]]:
        """`suspend`, also giving each coroutine's progress: [(ref, progress, state)]."""
        return self.call(lambda engine: self._suspend_counted(engine, seq_ids, match, None))

    def progress(self) -> Future[list[tuple[RowRef, int, bytes]]]:
        """KV-less snapshots of the coroutines held for other workers that generated tokens since
        the last call (they stay here): [(ref, num_output, state)], for their owners to keep."""
        return self.call(self._progress)

    def cancel(self, match: Callable[[RowRef], bool]) -> Future[int]:
        return self.call(lambda engine: len(self._suspend(engine, None, match, False)))

    def close_if_idle(self) -> Future[bool]:
        """Stop the engine if it holds no coroutine: -> True when it stopped. Decided on the loop
        thread, so nothing can slip in between the check and the stop (later calls are refused)."""
        def stop(engine: CoroutineEngine) -> bool:
            if engine.has_unfinished() or self._tickets:
                return False
            with self._gate:
                self._closed.set()
            return True
        return self.call(stop)

    @property
    def is_closed(self) -> bool:
        return self._closed.is_set()

    @property
    def load(self) -> RunnerLoad:
        return self._load

    def close(self, timeout: float | None = 5.0) -> None:
        with self._gate:
            self._closed.set()
        self._thread.join(timeout)

    # -- loop thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        if self._timeline is not None:
            self._timeline.engine_loading()
        try:
            engine = self.spec.build()
        except BaseException as exc:  # noqa: BLE001 - a model that cannot load fails its jobs
            self._fail(exc)
            return
        if self._timeline is not None:
            self._timeline.engine_loaded()
        try:
            self._snapshot(engine, force=True)
            timeline = self._timeline
            while not self._closed.is_set():
                if self._drain(engine, block=not engine.has_unfinished()):
                    # rows added, adopted or moved out: report them before a step that may be long
                    # (a first prefill), else the balancer sees this engine as it was before
                    self._snapshot(engine, force=True)
                if engine.has_unfinished():
                    before = engine.work_done()
                    t0 = time.perf_counter()
                    try:
                        finished = engine.run_step()
                    except BaseException as exc:  # noqa: BLE001
                        self._fail(exc)
                        return
                    if timeline is not None:
                        timeline.stepped(time.perf_counter() - t0)
                        timeline.tokens(engine.work_done() - before)
                    self._finish(engine, finished)
                self._snapshot(engine)
            self._refuse_pending(RuntimeError("engine runner is closed"))
        finally:
            engine.close()  # expert reader threads and checkpoint files, if any

    def _refuse_pending(self, exc: BaseException) -> None:
        """Fail the commands queued before the close: callers take their rows elsewhere (a
        coroutine resumed into an engine that never steps again would be lost)."""
        while True:
            try:
                _, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            fut.set_exception(exc)

    def _fail(self, exc: BaseException) -> None:
        logger.exception("batchgen engine %s failed", self.spec.key, exc_info=exc)
        with self._gate:
            self.failure = exc
        self._refuse_pending(exc)
        refs, self._tickets = list(self._tickets.values()), {}
        self._on_fail(exc, refs)

    def _drain(self, engine: CoroutineEngine, block: bool) -> bool:
        """Run the queued commands (waiting a little for one when `block`); -> whether any ran."""
        t0 = time.perf_counter()
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            if block and self._timeline is not None:
                self._timeline.spent("idle", time.perf_counter() - t0)
            return False
        t1 = time.perf_counter()
        try:
            while True:
                fn, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(engine))
                    except BaseException as exc:  # noqa: BLE001 - the caller gets it
                        fut.set_exception(exc)
                if self._closed.is_set():
                    return True  # closed by that command (close_if_idle): the rest are refused, not run
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    return True
        finally:
            if self._timeline is not None:
                if block:
                    self._timeline.spent("idle", t1 - t0)
                self._timeline.spent("command", time.perf_counter() - t1)

    def _add(self, engine: CoroutineEngine, requests: list[Request]) -> None:
        done: list[tuple[RowRef, CoroutineOutput]] = []
        for ref, request, params in requests:
            try:
                seq_id = engine.add_request(request, params, index=ref.row)
            except Exception as exc:  # noqa: BLE001 - one odd row must not sink its partition
                done.append((ref, engine.error_output(ref.row, f"{type(exc).__name__}: {exc}")))
                continue
            self._tickets[seq_id] = ref
            if engine.is_finished(seq_id):
                del self._tickets[seq_id]
                done.append((ref, engine.pop_output(seq_id)))
        if self._timeline is not None:
            self._timeline.rows_queued()
        if done:
            self._on_done(done)

    def _resume(self, engine: CoroutineEngine, items: list[tuple[RowRef, bytes]]) -> list[RowRef]:
        rejected: list[RowRef] = []
        done: list[tuple[RowRef, CoroutineOutput]] = []
        for ref, state in items:
            try:
                seq_id = engine.resume(state)
            except Exception:  # noqa: BLE001 - StateError or a corrupt payload: the owner keeps it
                logger.exception("cannot resume coroutine %s", ref)
                rejected.append(ref)
                continue
            self._adopted += 1
            if engine.is_finished(seq_id):
                done.append((ref, engine.pop_output(seq_id)))
            else:
                self._tickets[seq_id] = ref
                if not ref.is_local:  # its owner already has this much
                    self._progress_sent[seq_id] = engine.progress(seq_id)
        if done:
            self._on_done(done)
        return rejected

    def _suspend(self, engine: CoroutineEngine, seq_ids: list[int] | None, match: Callable[[RowRef], bool] | None,
                 with_kv: bool | None) -> list[tuple[RowRef, bytes]]:
        return [(ref, state) for ref, _, state in self._suspend_counted(engine, seq_ids, match, with_kv)]

    def _suspend_counted(self, engine: CoroutineEngine, seq_ids: list[int] | None, match: Callable[[RowRef], bool] | None,
                         with_kv: bool | None) -> list[tuple[RowRef, int, bytes]]:
        chosen = [s for s in (seq_ids if seq_ids is not None else list(self._tickets))
                  if s in self._tickets and (match is None or match(self._tickets[s]))]
        out: list[tuple[RowRef, int, bytes]] = []
        for seq_id in chosen:
            if engine.is_finished(seq_id):
                continue
            ref = self._tickets.pop(seq_id)
            out.append((ref, engine.progress(seq_id), engine.suspend(seq_id, with_kv=with_kv)))
        return out

    def _progress(self, engine: CoroutineEngine) -> list[tuple[RowRef, int, bytes]]:
        sent = {s: n for s, n in self._progress_sent.items() if s in self._tickets}
        out: list[tuple[RowRef, int, bytes]] = []
        for seq_id, ref in self._tickets.items():
            if ref.is_local:
                continue
            num_output = engine.progress(seq_id)
            if engine.is_finished(seq_id) or num_output <= sent.get(seq_id, 0):
                continue
            out.append((ref, num_output, engine.snapshot(seq_id)))
            sent[seq_id] = num_output
        self._progress_sent = sent
        return out

    def _finish(self, engine: CoroutineEngine, finished: list[int]) -> None:
        done = [(self._tickets.pop(cid), engine.pop_output(cid)) for cid in finished if cid in self._tickets]
        if done:
            self._on_done(done)

    def _snapshot(self, engine: CoroutineEngine, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_snap < _SNAPSHOT_EVERY_S:
            return
        self._last_snap = now
        t0 = time.perf_counter()
        try:
            self._take_snapshot(engine, now)
        finally:
            if self._timeline is not None:
                self._timeline.spent("snapshot", time.perf_counter() - t0)

    def _take_snapshot(self, engine: CoroutineEngine, now: float) -> None:
        load = engine.load_report()
        done = engine.work_done()
        capacity = at_capacity(load.waiting, load.running, load.max_num_seqs, load.kv_used_fraction)
        self._meter.observe(now, done, load.waiting if capacity else 0)
        # own coroutines and those held for others (which re-migrate via their owner)
        tickets = self._tickets
        movable = [(cid, remaining, load.computed_by_id.get(cid, 0))
                   for cid, remaining in load.remaining_by_id.items() if cid in tickets]
        self._load = RunnerLoad(True, load.waiting, load.running, load.kv_used_fraction, load.remaining,
                                self._meter.tokens_per_s, done, reported_movable_rows(movable), self._meter.speed,
                                load.expert_hit_rate, load.kv_capacity_tokens, load.max_num_seqs, self._adopted,
                                load.device_class)
