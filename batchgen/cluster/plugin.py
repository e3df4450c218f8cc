"""The scheduler side: a global view of every worker's engines and the balancing decisions.

Workers push `Host.report()` every `push_interval` to the `batchgen_load` handler this plugin
installs in `start()`; the reply carries the migration orders for that worker (from the pure
policy in balance.py) and, when it changed, the set of live workers, from which owners learn
that a holder of their coroutines is gone. `start()` also registers the worker plugin, so
`Client.register_plugin(BalancePlugin())` is the whole setup; `close()` undoes both. It also
puts batchgen's per-worker figures on the scheduler's Prometheus endpoint (prometheus.py) and
a `batchgen` page on its dashboard (dashboard.py).
With an engine rule (eligibility.py) only the workers it admits are cold-start destinations,
and every worker learns which those are (`engine_workers` in the reply).
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from distributed import SchedulerPlugin
from distributed.protocol.pickle import dumps

from ..policy.balance import BalanceConfig, CoroutineInfo, EngineLoad, Migration, plan_migrations
from . import dashboard, prometheus
from .eligibility import EngineWorkers
from .worker import WORKER_PLUGIN, BatchgenWorkerPlugin

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)

PLUGIN_NAME = "batchgen-balance"
SCHEDULER_HANDLERS = ("batchgen_load", "batchgen_metrics", "batchgen_engine_workers")


@dataclass(slots=True)
class WorkerView:
    """The last report of one worker, and when it came.

    An order shows in later reports only: the source stops listing the coroutines it sent, the
    destination counts them as adopted. Until both have (or `settle_until` passes: the rows may
    have finished before they moved), the two workers' reports describe the cluster before the
    order, and planning on them would order the same move again.
    """

    report: dict[str, Any]
    received: float
    cooldown_until: float = 0.0
    leaving: dict[str, set[int]] = field(default_factory=dict)  # model -> seq ids ordered out, still listed
    arriving: dict[str, int] = field(default_factory=dict)  # model -> adopted count its report must pass
    settle_until: float = 0.0
    behind_since: float | None = None  # when its report first showed fewer jobs than its seceded tasks

    def settled(self, now: float) -> bool:
        return self.cooldown_until <= now and (not (self.leaving or self.arriving) or now >= self.settle_until)

    def observe(self, report: dict[str, Any]) -> None:
        """Take a new report; forget the orders it shows carried out."""
        self.report = report
        engines = report.get("engines", {})
        for model in list(self.leaving):
            listed = {int(c[0]) for c in engines.get(model, {}).get("movable", ())}
            self.leaving[model] &= listed
            if not self.leaving[model]:
                del self.leaving[model]
        for model, before in list(self.arriving.items()):
            if int(engines.get(model, {}).get("adopted", 0)) > before:
                del self.arriving[model]


@dataclass(slots=True)
class PluginCounters:
    orders: int = 0
    ordered_coroutines: int = 0
    ordered_tokens: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    # counters of workers that left, so totals do not shrink when one dies
    departed: dict[str, int] = field(default_factory=dict)


class BalancePlugin(SchedulerPlugin):
    """Global load view + split / combine / migrate decisions for batchgen engines."""

    name = PLUGIN_NAME

    def __init__(self, config: BalanceConfig | None = None, push_interval: float = 0.2,
                 cooldown: float = 1.0, stale_after: float = 5.0, engine_workers: EngineWorkers | None = None) -> None:
        """engine_workers: which workers may hold engines (default: any)."""
        self.config = config or BalanceConfig()
        self.engine_rule = engine_workers or EngineWorkers()
        self.push_interval, self.cooldown, self.stale_after = push_interval, cooldown, stale_after
        self.scheduler: Scheduler | None = None
        self.views: dict[str, WorkerView] = {}
        self.counters = PluginCounters()
        self.epoch = 0
        self.log: list[tuple[float, Migration]] = []  # recent orders, for debugging
        # model key -> the only workers that may start its engine (a placement's replicas, set by
        # batchgen.moa); other models may cold-start anywhere
        self.pinned: dict[str, frozenset[str]] = {}
        self._collector: prometheus.BatchgenCollector | None = None
        self.page: dashboard.PageRegistration | None = None  # the dashboard page, while registered
        # orders whose rows the source still lists, with its migrated_out count when ordered: an
        # order whose rows all finished at the source before it could send them brings nothing,
        # so its destination must not wait (up to stale_after) for an adoption that never comes
        self._unsent: list[tuple[Migration, int]] = []

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update({"batchgen_load": self.handle_load, "batchgen_metrics": self.metrics,
                                   "batchgen_engine_workers": self.engine_workers})
        collector = prometheus.BatchgenCollector(self.metrics)
        if prometheus.register(collector):
            self._collector = collector
        self.page = dashboard.register(scheduler, self)
        rule = self.engine_rule.to_msg() if self.engine_rule.is_restricted else None
        plugin = BatchgenWorkerPlugin(push_interval=self.push_interval, engine_workers=rule)
        await scheduler.register_worker_plugin(None, dumps(plugin), name=WORKER_PLUGIN, idempotent=False)

    async def close(self) -> None:
        scheduler = self.scheduler
        if scheduler is None:
            return
        self.scheduler = None
        if self._collector is not None:
            prometheus.unregister(self._collector)
            self._collector = None
        if self.page is not None:
            dashboard.unregister(self.page)
            self.page = None
        # Workers first: their load pushes stop before the handler they call goes away (the other
        # order makes the scheduler log a "No handler batchgen_load" error per push in between).
        if WORKER_PLUGIN in scheduler.worker_plugins:
            try:
                await scheduler.unregister_worker_plugin(None, WORKER_PLUGIN)
            except Exception as exc:  # noqa: BLE001 - scheduler shutting down: workers go too
                logger.debug("unregistering %s failed: %s", WORKER_PLUGIN, exc)
        for name in SCHEDULER_HANDLERS:
            handler = scheduler.handlers.get(name)
            if handler is not None and getattr(handler, "__self__", None) is self:
                del scheduler.handlers[name]

    def add_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        self.epoch += 1

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        self.epoch += 1
        view = self.views.pop(worker, None)
        if view is not None:
            for name, value in view.report.get("counters", {}).items():
                self.counters.departed[name] = self.counters.departed.get(name, 0) + int(value)

    # -- RPC handlers -----------------------------------------------------------------------------
    def handle_load(self, worker: str, report: dict[str, Any], epoch: int) -> dict[str, Any]:
        """A worker's load push. -> {"orders": migrations it must carry out, "epoch": n,
        "workers": live worker addresses (only when `epoch` is not the current one)}."""
        now = time.monotonic()
        view = self.views.get(worker)
        if view is None:
            view = self.views[worker] = WorkerView(report, now)
        view.received = now
        view.observe(report)
        self._forget_unsent(worker, report)
        orders = [o for o in self._plan(now) if o.src == worker]
        for order in orders:
            self._record(order, now)
        reply: dict[str, Any] = {"orders": [asdict(o) for o in orders], "epoch": self.epoch, "workers": None}
        if epoch != self.epoch and self.scheduler is not None:
            reply["workers"] = list(self.scheduler.workers)
            reply["engine_workers"] = self.engine_workers()
        return reply

    def engine_workers(self) -> list[str]:
        """The live workers that may hold engines (all of them without a rule)."""
        if self.scheduler is None:
            return []
        return [addr for addr, ws in self.scheduler.workers.items() if self.admits(addr)]

    def admits(self, worker: str) -> bool:
        if not self.engine_rule.is_restricted:
            return True
        ws = self.scheduler.workers.get(worker) if self.scheduler is not None else None
        return ws is not None and self.engine_rule.admits(worker, ws.name, ws.resources)

    def metrics(self) -> dict[str, Any]:
        """Per-worker engine load and counters, and cluster totals (see cluster.metrics)."""
        workers: dict[str, dict[str, Any]] = {}
        totals: dict[str, float] = dict(self.counters.departed)
        for addr, view in sorted(self.views.items()):
            engines = view.report.get("engines", {})
            counters = view.report.get("counters", {})
            for name, value in counters.items():
                totals[name] = totals.get(name, 0) + value
            workers[addr] = {
                "coroutines": sum(e["waiting"] + e["running"] for e in engines.values()),
                "waiting": sum(e["waiting"] for e in engines.values()),
                "running": sum(e["running"] for e in engines.values()),
                "remaining_tokens": sum(e["remaining_tokens"] for e in engines.values()),
                "kv_used": max((e["kv_used"] for e in engines.values()), default=0.0),
                "tokens_per_s": sum(e["tokens_per_s"] for e in engines.values()),
                "speed": sum(e.get("speed", 0.0) for e in engines.values()),
                "expert_hit_rate": min((e.get("expert_hit_rate", 1.0) for e in engines.values()), default=1.0),
                "jobs": view.report.get("jobs", 0),
                "peak_jobs": view.report.get("peak_jobs", 0),
                "age_s": time.monotonic() - view.received,
                "timeline": view.report.get("timeline"),  # wall-clock times of the last busy period
                **counters,
            }
        totals["tokens_per_s"] = sum(w["tokens_per_s"] for w in workers.values())
        return {"workers": workers, "totals": totals, "orders": self.counters.orders,
                "ordered_coroutines": self.counters.ordered_coroutines,
                "migrations": int(totals.get("migrated_out", 0)), "by_reason": dict(self.counters.by_reason),
                "config": asdict(self.config), "engine_workers": self.engine_rule.to_msg()}

    # -- planning ---------------------------------------------------------------------------------
    def _plan(self, now: float) -> list[Migration]:
        if not self.config.enabled:
            return []
        loads, arriving = self._loads(now), self._tasks_arriving()
        if not self.pinned:
            return plan_migrations(loads, self.config, arriving=arriving)
        # A placed model (batchgen.moa) had its rows split by the placement: only not-started rows
        # move between its replicas (running ones would ping-pong between workers whose other
        # models' load the per-model view does not see).
        free = [x for x in loads if x.model not in self.pinned]
        placed = [x for x in loads if x.model in self.pinned]
        return (plan_migrations(free, self.config, arriving=arriving)
                + plan_migrations(placed, replace(self.config, migrate=False), arriving=arriving))

    def _tasks_arriving(self) -> bool:
        """Are tasks queued, or assigned to a worker and not yet running or seceded?"""
        s = self.scheduler
        if s is None:
            return False
        return bool(s.queued) or bool(s.unrunnable) or any(
            len(ws.processing) > len(ws.long_running) for ws in s.workers.values())

    def _report_behind(self, worker: str, view: WorkerView, now: float) -> bool:
        """Does the worker's last report leave out rows it already holds: a task that seceded
        (handed its rows to the host) which the report does not count among its jobs yet, or rows
        handed to the engine thread and not yet in the engine? Then the report understates its
        work, and a split planned on it sends rows to a worker whose own partition is just
        arriving (seen at most job starts, then moved back). Bounded by `stale_after`, since a
        seceded task that is not batchgen's never shows as a job."""
        ws = self.scheduler.workers.get(worker) if self.scheduler is not None else None
        seceded = len(ws.long_running) if ws is not None else 0
        if seceded <= int(view.report.get("jobs", 0)) and not view.report.get("submitting_rows", 0):
            view.behind_since = None
            return False
        if view.behind_since is None:
            view.behind_since = now
        return now - view.behind_since < self.stale_after

    def _loads(self, now: float) -> list[EngineLoad]:
        fresh = {w: v for w, v in self.views.items() if now - v.received < self.stale_after and v.settled(now)
                 and not self._report_behind(w, v, now)}
        models = {m for v in fresh.values() for m in v.report.get("engines", {})}
        loads: list[EngineLoad] = []
        for worker, view in fresh.items():
            if not self.admits(worker):  # holds no engine, takes no coroutine (eligibility.py)
                continue
            engines = view.report.get("engines", {})
            for model in models:
                e = engines.get(model)
                if e is None:  # this worker could run it after loading the model, unless pinned elsewhere
                    if model not in self.pinned or worker in self.pinned[model]:
                        loads.append(EngineLoad(worker, model, ready=False))
                    continue
                loads.append(EngineLoad(
                    worker, model, bool(e["ready"]), int(e["waiting"]), int(e["running"]),
                    int(e["remaining_tokens"]), float(e["kv_used"]), float(e["tokens_per_s"]),
                    tuple(CoroutineInfo(int(s), int(r), int(c)) for s, r, c in e["movable"]),
                    float(e.get("speed", 0.0)), int(e.get("kv_capacity_tokens", 0)),
                    int(e.get("max_num_seqs", 0)), str(e.get("device", ""))))
        return loads

    def _forget_unsent(self, worker: str, report: dict[str, Any]) -> None:
        """On a report from an order's source that no longer lists its rows: if the source sent
        nothing since (its migrated_out count unchanged), the rows finished there first, and the
        destination stops waiting for them."""
        keep: list[tuple[Migration, int]] = []
        for order, sent_before in self._unsent:
            if order.src != worker:
                keep.append((order, sent_before))
                continue
            listed = {int(c[0]) for c in report.get("engines", {}).get(order.model, {}).get("movable", ())}
            if listed & set(order.seq_ids):
                keep.append((order, sent_before))
                continue
            dst = self.views.get(order.dst)
            if _migrated_out(report) == sent_before and dst is not None:
                dst.arriving.pop(order.model, None)
        self._unsent = keep

    def _record(self, order: Migration, now: float) -> None:
        c = self.counters
        c.orders += 1
        c.ordered_coroutines += len(order.seq_ids)
        c.ordered_tokens += order.tokens
        c.by_reason[order.reason] = c.by_reason.get(order.reason, 0) + len(order.seq_ids)
        for w in (order.src, order.dst):
            if w in self.views:
                self.views[w].cooldown_until = now + self.cooldown
                self.views[w].settle_until = now + self.stale_after
        src, dst = self.views.get(order.src), self.views.get(order.dst)
        if src is not None:
            src.leaving.setdefault(order.model, set()).update(order.seq_ids)
        if dst is not None:
            dst.arriving[order.model] = int(dst.report.get("engines", {}).get(order.model, {}).get("adopted", 0))
        if src is not None:
            self._unsent.append((order, _migrated_out(src.report)))
            del self._unsent[:-100]
        self.log.append((now, order))
        del self.log[:-100]
        logger.info("batchgen %s: %d coroutines (%d tokens) %s -> %s", order.reason, len(order.seq_ids),
                    order.tokens, order.src, order.dst)


def _migrated_out(report: dict[str, Any]) -> int:
    return int(report.get("counters", {}).get("migrated_out", 0))
