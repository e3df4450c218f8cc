"""The worker side: one Host per Dask worker, its RPC handlers, and the load pusher. Why an
extension and not an actor: docs/concepts/dask-plugin.md#why-a-worker-extension-and-not-an-actor.
Handlers run on the worker's event loop and only queue commands for the engine's thread (runner.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import pickle
import threading
from typing import TYPE_CHECKING, Any

from distributed import WorkerPlugin

from ..policy.balance import Migration
from .eligibility import EngineWorkers
from .host import Host
from .mailbox import Mailboxes
from .spec import EngineSpec

if TYPE_CHECKING:
    from collections.abc import Callable

    from distributed import Worker

logger = logging.getLogger(__name__)

EXTENSION = "batchgen"
WORKER_PLUGIN = "batchgen-worker"
HANDLERS = ("batchgen_adopt", "batchgen_result", "batchgen_bounce", "batchgen_progress", "batchgen_forward",
            "batchgen_cancel", "batchgen_mail", "batchgen_submit")
_create_lock = threading.Lock()


class WorkerTransport:
    """Host -> other workers, through the worker's connection pool on its event loop."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.address: str = worker.address

    def send(self, address: str, op: str, msg: dict[str, Any],
             on_error: Callable[[BaseException], None] | None = None) -> None:
        async def go() -> None:
            try:
                await getattr(self.worker.rpc(address), op)(**msg)
            except Exception as exc:  # noqa: BLE001 - a peer that left; the caller decides
                if on_error is not None:
                    on_error(exc)
                else:
                    logger.info("batchgen %s to %s failed: %s", op, address, exc)

        self.worker.loop.add_callback(go)


class WorkerSide:
    """Per-worker batchgen state, stored as `worker.extensions["batchgen"]`."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.transport = WorkerTransport(worker)
        self.host = Host(self.transport)
        self.mailboxes = Mailboxes()
        self.epoch = -1
        self.live: set[str] | None = None
        self._pusher: asyncio.Task[None] | None = None
        self._closed = False
        self.engine_workers: list[str] | None = None  # live workers that may hold engines, as last told

    def restrict(self, rule: EngineWorkers) -> None:
        """Apply the cluster's engine rule: outside it this worker's host starts no engine and
        hands its tasks' rows to workers inside it."""
        w = self.worker
        if rule.admits(w.address, w.name, dict(w.state.total_resources)) or self.host.delegate is not None:
            return
        self.host.hold_no_engines(rule, self.holders)

    def holders(self) -> list[str]:
        """Live workers that may hold engines: as the last load reply said, else asked now (a
        task thread, before this worker's first push came back)."""
        if self.engine_workers is None:
            from distributed.utils import sync

            try:
                self.engine_workers = list(sync(self.worker.loop, self.worker.scheduler.batchgen_engine_workers))
            except RuntimeError:  # on the event loop itself: the next load reply tells
                return []
        return list(self.engine_workers)

    def install(self) -> None:
        self.worker.handlers.update({"batchgen_adopt": self.adopt, "batchgen_result": self.result,
                                     "batchgen_bounce": self.bounce, "batchgen_progress": self.progress,
                                     "batchgen_forward": self.forward, "batchgen_cancel": self.cancel,
                                     "batchgen_mail": self.mail, "batchgen_submit": self.submit})
        self.worker.extensions[EXTENSION] = self

    # -- RPC handlers -----------------------------------------------------------------------------
    def adopt(self, owner: str, spec: dict[str, Any], items: list[list[Any]]) -> None:
        """Hold coroutines for another worker's task: `items` are [job_id, row, state bytes].

        Results go back to `owner` by `batchgen_result`; rows that cannot run here go back by
        `batchgen_bounce`.
        """
        self.host.adopt(owner, EngineSpec.from_msg(spec), [(str(j), int(r), bytes(s)) for j, r, s in items])

    def submit(self, owner: str, spec: dict[str, Any], job_id: str, rows: list[list[Any]]) -> None:
        """Run not-started rows of a task on `owner`, a worker that may hold no engine: `rows`
        are [row, pickled (prompt, params)]; results go back by `batchgen_result`."""
        decoded = [(int(row), *pickle.loads(blob)) for row, blob in rows]
        self.host.receive_submit(owner, EngineSpec.from_msg(spec), str(job_id), decoded)

    def result(self, jobs: dict[str, list[list[Any]]]) -> None:
        """Outputs of this worker's rows that ran elsewhere: {job_id: [[row, pickled RequestOutput]]}."""
        self.host.receive_results(jobs)

    def bounce(self, jobs: dict[str, list[list[Any]]]) -> None:
        """Rows handed back by their holder: {job_id: [[row, fresh state bytes or None]]}; resume here."""
        self.host.receive_bounce(jobs)

    def progress(self, holder: str, jobs: dict[str, list[list[Any]]]) -> None:
        """Newer states of this worker's rows held by `holder`: {job_id: [[row, output tokens,
        KV-less state bytes]]}; kept in place of older ones, for recovery if the holder leaves."""
        self.host.receive_progress(holder, {j: [[int(r), int(n), bytes(s)] for r, n, s in items]
                                            for j, items in jobs.items()})

    def forward(self, holder: str, dst: str, spec: dict[str, Any], jobs: dict[str, list[list[Any]]]) -> None:
        """Rows of this worker's tasks that `holder` was ordered to pass on to `dst`:
        {job_id: [[row, output tokens, state bytes]]}; this worker records `dst` as their holder
        and sends them there (or resumes them itself when it is `dst`)."""
        self.host.receive_forward(holder, dst, EngineSpec.from_msg(spec),
                                  {j: [[int(r), int(n), bytes(s)] for r, n, s in items] for j, items in jobs.items()})

    def cancel(self, owner: str, job_id: str, rows: list[int]) -> None:
        """The task of `owner` that owned `job_id` ended: drop its coroutines held here."""
        self.host.receive_cancel(owner, str(job_id), [int(r) for r in rows])

    def mail(self, box: str, msg: Any) -> None:
        """A message for a job's part running here (mailbox.py)."""
        self.mailboxes.put(box, msg)

    def send_mail(self, address: str, box: str, msg: Any) -> None:
        """Any thread: `msg` into `box` on the worker at `address` (this one: no RPC). A peer that
        left is logged; the job's own protocol notices the silence."""
        if address == self.worker.address:
            self.mailboxes.put(box, msg)
        else:
            self.transport.send(address, "batchgen_mail", {"box": box, "msg": msg})

    # -- talking to the scheduler plugin ----------------------------------------------------------
    def start_pushing(self, interval: float) -> None:
        if self._pusher is None:
            self._pusher = asyncio.get_running_loop().create_task(self._push_loop(interval))

    async def _push_loop(self, interval: float) -> None:
        while not self._closed:
            await asyncio.sleep(interval)
            self.host.push_progress()
            try:
                reply = await self.worker.scheduler.batchgen_load(
                    worker=self.worker.address, report=self.host.report(), epoch=self.epoch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - scheduler restarting or plugin gone: keep going
                logger.debug("batchgen load push failed: %s", exc)
                continue
            self.apply(reply)

    def apply(self, reply: dict[str, Any]) -> None:
        """Carry out the plugin's reply: migration orders, and the live worker set when it changed."""
        if reply.get("engine_workers") is not None:
            self.engine_workers = list(reply["engine_workers"])
        if reply.get("workers") is not None:
            self.epoch = int(reply["epoch"])
            self.live = set(reply["workers"])
            self.host.drop_orphans(self.live)
        if self.live is not None:
            self.host.recover(self.live)
        for order in reply.get("orders", ()):
            self.host.execute(Migration(**{**order, "seq_ids": tuple(order["seq_ids"])}))

    async def aclose(self, detach: bool = True) -> None:
        """Stop pushing, remove the handlers, detach the host (running tasks finish without balancing).
        detach: also drop it from worker.extensions (not while Worker.close iterates them)."""
        if self._closed:
            return
        self._closed = True
        if self._pusher is not None:
            self._pusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pusher
        for name in HANDLERS:
            if getattr(self.worker.handlers.get(name), "__self__", None) is self:
                del self.worker.handlers[name]
        if detach and self.worker.extensions.get(EXTENSION) is self:
            del self.worker.extensions[EXTENSION]
        await asyncio.to_thread(self.host.close)

    async def close(self) -> None:
        # Worker.close calls each extension's close() while iterating worker.extensions: deleting
        # this entry there raised "dictionary changed size during iteration" (and the nanny killed it)
        await self.aclose(detach=False)


def ensure_side(worker: Worker) -> WorkerSide:
    """This worker's WorkerSide, created (and its handlers installed) on first use."""
    with _create_lock:
        side = worker.extensions.get(EXTENSION)
        if side is None:
            side = WorkerSide(worker)
            side.install()
        return side


async def start_engine(spec: dict[str, Any], dask_worker: Worker) -> bool:
    """`Client.run` target (a coroutine: `run(wait=False)` needs one): start this worker's engine
    for `spec` unless running; -> whether this worker runs batchgen (its side is installed).
    Returns at once: the engine loads on its own thread."""
    side = dask_worker.extensions.get(EXTENSION)
    if side is None or side.host.delegate is not None:
        return False
    side.host.prestart(EngineSpec.from_msg(spec))
    return True


async def release_engines(dask_worker: Worker, model: str | None = None) -> int:
    """`Client.run` target: stop this worker's idle engines (of `model`, an EngineSpec key).
    Async, and the waiting on a thread: the worker's event loop keeps serving meanwhile."""
    side = dask_worker.extensions.get(EXTENSION)
    return await asyncio.to_thread(side.host.release_idle, model) if side is not None else 0


@functools.cache
def local_host() -> Host:
    """The process-wide host for calls outside any Dask worker (engines cached per spec)."""
    return Host(None)


@dataclasses.dataclass
class BatchgenWorkerPlugin(WorkerPlugin):
    """Installs the worker side on every worker (now and later) and pushes its load."""

    push_interval: float = 0.2
    name: str = WORKER_PLUGIN
    engine_workers: dict[str, Any] | None = None  # EngineWorkers.to_msg(); None: any worker

    async def setup(self, worker: Worker) -> None:
        side = ensure_side(worker)
        side.restrict(EngineWorkers.from_msg(self.engine_workers))
        side.start_pushing(self.push_interval)
        if side.host.delegate is None:  # a worker that may hold no engine never needs torch
            warm_imports()  # torch imported before the first task needs it

    async def teardown(self, worker: Worker) -> None:
        side = worker.extensions.get(EXTENSION)
        if side is not None:
            await side.aclose()


_warmed = threading.Event()


def warm_imports() -> None:
    """Import torch and the engine on a daemon thread, once per process."""
    if _warmed.is_set():
        return
    _warmed.set()

    def go() -> None:
        try:
            import batchgen.engine  # noqa: F401 - torch, the models and the runtime
        except Exception as exc:  # noqa: BLE001 - the first task reports a real import error
            logger.debug("batchgen import warm-up failed: %s", exc)

    threading.Thread(target=go, name="batchgen-warm-imports", daemon=True).start()
