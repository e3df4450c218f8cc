"""ModelPool: several models in one job, each row on its model, on a cluster placed by `place`.

On Dask, `plan` turns the rows into per-model Demand (predicted tokens: each row's max_tokens
plus a share of its prompt), gets the workers and their memory from the scheduler, and calls
`place`; the scheduler plugin is told the replica set of every model (`pin`), so its balancing
moves a model's rows only between workers holding that model (never cold-starting it elsewhere).
`submit` sends rows in tasks to the worker the placement gave them (each (model, worker) group
in about TASKS_PER_GROUP tasks, or tasks of `rows_per_task` when given), strictly
restricted (a loosely restricted task can be stolen by an idle worker, which would then load a
model the placement did not put there). A task whose worker leaves the cluster is sent again to
another replica of its model (or, with none left, to the least loaded worker), and the rows that
worker held for others resume on their owners (cluster/host.py). Each task is
`cluster.generate.generate_rows`, which joins that worker's engine for the model, one engine
per (worker, model); a worker holds several when the placement puts several models there.
Outside Dask every model runs in this process (`cluster.worker.local_host`), all at once.

`results()` yields (key, RequestOutput) as tasks finish and keeps going while more rows are
submitted meanwhile (how the MoA aggregator stage starts before the proposers end). A task's
result is fetched as it finishes (fetching them later in batches saved driver CPU, but a result
whose worker died before the fetch is recomputed on that worker, for which a strictly
restricted task waits forever; with tasks sized by group there are few fetches anyway).

Task size: a task is a round trip (scheduler, worker thread, result) and its rows join the
engine together, so tiny tasks cost CPU and feed the engine in dribbles; one task per group
would return nothing until all of it is done (no streaming into the next MoA stage) and resend
everything if its worker left. About TASKS_PER_GROUP tasks per (model, worker), of at least
MIN_ROWS_PER_TASK rows, sit between the two.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Hashable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BatchgenError
from ..models.hub import is_hub_id
from ..outputs import RequestOutput
from ..policy.placement import Demand, ModelCost, Placement, Policy, WorkerSlot, place

if TYPE_CHECKING:
    from distributed import Client

    from ..cluster.spec import EngineSpec
    from ..models.info import ModelInfo
    from ..sampling_params import SamplingParams

LOCAL = "local"  # the worker name of this process, outside Dask
PREFILL_WEIGHT = 0.05  # a prompt token costs about this many generated tokens (batched prefill)
TASKS_PER_GROUP = 8  # tasks per (model, worker) group when rows_per_task is not given
MIN_ROWS_PER_TASK = 8
RESEND_CHECK_S = 1.0  # how often results() asks the scheduler which workers are alive (a round trip)


@dataclass(frozen=True, slots=True)
class Item:
    """One generation: `key` is the caller's (unique among items in flight)."""

    key: Hashable
    model: str
    prompt: Any  # text or token ids
    params: SamplingParams

    def predicted_tokens(self) -> float:
        prompt = len(self.prompt) if isinstance(self.prompt, (list, tuple)) else len(str(self.prompt)) / 4
        return float(self.params.max_tokens or 16) + PREFILL_WEIGHT * prompt


class ModelPool:
    def __init__(self, models: Mapping[str, str | Path], *, client: Client | None = None,
                 placement: Policy = "ilp", engine_options: Mapping[str, Any] | None = None,
                 costs: Mapping[str, ModelCost] | None = None, worker_memory: int | None = None,
                 rows_per_task: int | None = None, retries: int = 3, time_limit_s: float = 5.0) -> None:
        from ..cluster.spec import EngineSpec
        from ..config import EngineConfig
        from ..models import info as model_info  # torch: not at import (`import batchgen.moa` stays light)

        if not models:
            raise BatchgenError("no models given")
        self.specs: dict[str, EngineSpec] = {name: EngineSpec.make(path, engine_options)
                                             for name, path in models.items()}
        try:  # a bad value fails here once, not in every task on every worker
            EngineConfig.from_kwargs(**dict(engine_options or {}))
        except ValueError as exc:
            raise BatchgenError(f"engine_options: {exc}") from None
        self.infos: dict[str, ModelInfo] = {}
        for name, spec in self.specs.items():
            if not is_hub_id(spec.model) and not Path(spec.model, "config.json").is_file():
                raise BatchgenError(f"model {name!r}: {spec.model} is not a model directory (no config.json)")
            # what Engine() would refuse (architecture, weights, tokenizer), here and not in every task
            try:
                self.infos[name] = model_info.ModelInfo.load(spec.model, dict(spec.options).get("max_model_len"))
            except (BatchgenError, ValueError) as exc:
                raise BatchgenError(f"model {name!r} ({spec.model}): {exc}") from None
        self.client, self.policy = client, placement
        # scipy.optimize takes a second or two to import: not inside the first plan() (in this
        # process, one worker, greedy always meets the lower bound and no solver runs)
        if placement == "ilp" and client is not None:
            threading.Thread(target=_import_solver, name="batchgen-import-scipy", daemon=True).start()
        self.costs = dict(costs or {})
        self.worker_memory, self.retries = worker_memory, retries
        self.rows_per_task = None if rows_per_task is None else max(1, rows_per_task)
        self.time_limit_s = time_limit_s
        self._done: queue.SimpleQueue[tuple[list[Hashable], list[RequestOutput] | BaseException]] = queue.SimpleQueue()
        self._pending = 0  # tasks submitted and not yet taken from _done
        self._lock = threading.Lock()
        self._pinned: set[str] = set()
        self._submitted: dict[tuple[str, str], float] = {}  # (model, worker) -> predicted tokens sent
        self._local: ThreadPoolExecutor | None = None
        self._futures: dict[str, tuple[Any, str, str, list[Item]]] = {}  # key -> (future, model, worker, items)
        self._replaced: set[str] = set()
        self._replicas: dict[str, tuple[str, ...]] = {}  # model -> its placed workers
        self._last_check = 0.0
        self._started = time.monotonic()
        self.finished_s: dict[str, dict[str, float]] = {}  # worker -> model -> seconds to its last task's end

    # -- placement --------------------------------------------------------------------------------
    def cost(self, name: str) -> ModelCost:
        if name not in self.costs:
            from .costs import estimate_cost

            self.costs[name] = estimate_cost(self.specs[name].model)
        return self.costs[name]

    def workers(self) -> list[WorkerSlot]:
        if self.client is None:
            return [WorkerSlot(LOCAL)]
        info = self.client.scheduler_info(n_workers=-1)["workers"] if _takes_n_workers(self.client) \
            else self.client.scheduler_info()["workers"]
        from ..cluster.client import engine_workers

        allowed = engine_workers(self.client)  # None: any worker may hold engines
        if allowed is not None and not allowed:
            raise BatchgenError("no worker of this cluster may run a batchgen engine: none has the worker "
                                "resource or name the batchgen plugin requires (batchgen.worker-resource, "
                                "batchgen.engine-workers)")
        slots = []
        for addr, w in sorted(info.items()):
            if allowed is not None and addr not in allowed:  # replicas only where engines may start
                continue
            limit = self.worker_memory or w.get("memory_limit") or 0
            slots.append(WorkerSlot(addr, float(limit) if limit else float("inf")))
        if not slots:
            raise BatchgenError("the cluster has no workers")
        return slots

    def plan(self, items: Sequence[Item], policy: Policy | None = None, *, fresh: bool = True) -> Placement:
        """Place the models these items need (and their rows); pin the replica sets on Dask.
        fresh: a new job (finished_s counts from here); False: more models for the running one."""
        rows: dict[str, dict[Hashable, float]] = {}
        for item in items:
            if item.model not in self.specs:
                raise BatchgenError(f"model {item.model!r} is not one of this job's models: {sorted(self.specs)}")
            rows.setdefault(item.model, {})[item.key] = item.predicted_tokens()
        demand = {m: Demand.of(r) for m, r in rows.items()}
        if fresh:
            self._started = time.monotonic()
            self.finished_s = {}
        placement = place(demand, {m: self.cost(m) for m in demand}, self.workers(), policy or self.policy,
                          time_limit_s=self.time_limit_s)
        self._replicas.update(placement.replicas)
        if self.client is not None:
            for m, workers in placement.replicas.items():
                self._pin(m, list(workers))
        return placement

    def _pin(self, model: str, workers: list[str] | None) -> None:
        from .pinning import pin

        key = self.specs[model].key
        pin(self.client, key, workers)
        if workers is None:
            self._pinned.discard(key)
        else:
            self._pinned.add(key)

    # -- running ----------------------------------------------------------------------------------
    def submit(self, items: Sequence[Item], placement: Placement | None = None) -> None:
        """Send items to their models: to the worker `placement` planned for each, else to the
        model's least loaded replica (replicas: the placement's, else any worker)."""
        planned = placement.worker_of() if placement is not None else {}
        groups: dict[tuple[str, str], list[Item]] = {}
        for item in items:
            if item.model not in self.specs:
                raise BatchgenError(f"model {item.model!r} is not one of this job's models: {sorted(self.specs)}")
            worker = planned.get((item.model, item.key))
            if worker is None:
                worker = self._least_loaded(item.model, placement)
            groups.setdefault((item.model, worker), []).append(item)
            self._submitted[item.model, worker] = self._submitted.get((item.model, worker), 0.0) \
                + item.predicted_tokens()
        for (model, worker), group in groups.items():
            group.sort(key=lambda it: -it.predicted_tokens())
            # the longest rows first, so they start first wherever the tasks queue
            size = self.task_size(len(group))
            self._send(model, worker, [group[i:i + size] for i in range(0, len(group), size)])

    def task_size(self, rows: int) -> int:
        """Rows per task for a group of `rows` bound for one (model, worker)."""
        if self.rows_per_task is not None:
            return self.rows_per_task
        return max(MIN_ROWS_PER_TASK, -(-rows // TASKS_PER_GROUP))

    def _least_loaded(self, model: str, placement: Placement | None) -> str:
        replicas = list(placement.replicas.get(model, ())) if placement is not None else []
        if not replicas:
            replicas = [w.name for w in self.workers()]
        return min(replicas, key=lambda w: (self._submitted.get((model, w), 0.0), w))

    def _send(self, model: str, worker: str, tasks: list[list[Item]]) -> None:
        """One task per list of items, all to `worker` (on Dask: one client.map, one round trip
        to the scheduler for all of them rather than one per task)."""
        spec = self.specs[model]
        with self._lock:
            self._pending += len(tasks)
        if self.client is None:
            if self._local is None:
                self._local = ThreadPoolExecutor(max_workers=64, thread_name_prefix="batchgen-moa")
            futures = [self._local.submit(_run_local, spec, [(it.prompt, it.params) for it in items])
                       for items in tasks]
            keys = [str(id(f)) for f in futures]
        else:
            from ..cluster.generate import generate_rows

            futures = self.client.map(generate_rows, [[(it.prompt, it.params) for it in items] for items in tasks],
                                      spec=spec.to_msg(), workers=[worker],
                                      allow_other_workers=False, retries=self.retries, pure=False)
            keys = [f.key for f in futures]
        for key, fut, items in zip(keys, futures, tasks):
            self._futures[key] = (fut, model, worker, items)
            fut.add_done_callback(lambda f, keys=[it.key for it in items]: self._finished(keys, f))

    def _finished(self, keys: list[Hashable], fut: Any) -> None:
        key = getattr(fut, "key", str(id(fut)))
        with self._lock:
            if key in self._replaced:  # sent again elsewhere: the new task answers for these rows
                self._replaced.discard(key)
                self._pending -= 1
                return
            entry = self._futures.pop(key, None)
            if entry is not None:
                by_model = self.finished_s.setdefault(entry[2], {})
                by_model[entry[1]] = time.monotonic() - self._started
        try:
            exc = fut.exception()
            result: list[RequestOutput] | BaseException = exc if exc is not None else fut.result()
        except BaseException as exc:  # noqa: BLE001 - a cancelled future: its rows fail
            result = exc
        self._done.put((keys, result))

    def _resend_lost(self) -> None:
        """Send again the tasks whose worker left (a restricted task would wait for it forever)."""
        try:
            live = {w.name for w in self.workers()}
        except BatchgenError:  # no worker at the moment (one restarting): the tasks wait, as Dask's do
            return
        with self._lock:
            lost = [(k, v) for k, v in self._futures.items() if v[2] not in live and not v[0].done()]
        for key, (fut, model, _worker, items) in lost:
            replicas = [w for w in self._replicas.get(model, ()) if w in live]
            target = min(replicas or sorted(live), key=lambda w: (self._submitted.get((model, w), 0.0), w))
            if model in self._replicas and target not in self._replicas[model]:
                self._replicas[model] = (*[w for w in self._replicas[model] if w in live], target)
                self._pin(model, list(self._replicas[model]))
            with self._lock:
                self._replaced.add(key)
                self._futures.pop(key, None)
            self._send(model, target, [items])
            fut.cancel()

    def results(self) -> Iterator[tuple[Hashable, RequestOutput]]:
        """(key, output) as tasks finish, until nothing submitted is left (rows submitted while
        iterating are waited for too). A task that failed outright (its model cannot load)
        gives each of its rows an error output."""
        for outputs in self.results_by_task():
            yield from outputs

    def results_by_task(self) -> Iterator[list[tuple[Hashable, RequestOutput]]]:
        """results(), one finished task's rows at a time: a caller that submits follow-up rows
        (the MoA aggregator) sends them together, one task, rather than one task per row."""
        while True:
            with self._lock:
                if self._pending == 0:
                    return
            if self.client is not None and time.monotonic() - self._last_check > RESEND_CHECK_S:
                self._last_check = time.monotonic()
                self._resend_lost()
            try:
                keys, result = self._done.get(timeout=0.5)
            except queue.Empty:
                continue
            with self._lock:
                self._pending -= 1
            if isinstance(result, BaseException):
                message = f"{type(result).__name__}: {result}"
                yield [(key, RequestOutput(i, [], [], "", "error", message)) for i, key in enumerate(keys)]
                continue
            if len(result) != len(keys):
                raise RuntimeError(f"a batchgen task returned {len(result)} outputs for {len(keys)} rows")
            yield list(zip(keys, result))

    def close(self) -> None:
        """Unpin the models on the scheduler; cancel what is still running."""
        for fut, *_ in list(self._futures.values()):
            fut.cancel()
        self._submitted.clear()
        if self.client is not None:
            for name, spec in self.specs.items():
                if spec.key in self._pinned:
                    self._pin(name, None)
        if self._local is not None:
            self._local.shutdown(wait=False, cancel_futures=True)
            self._local = None

    def __enter__(self) -> ModelPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run_local(spec: EngineSpec, requests: list[tuple[Any, Any]]) -> list[RequestOutput]:
    from ..cluster.generate import run_requests

    return run_requests(spec, requests)


def _import_solver() -> None:
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:  # place() says so when it needs it
        pass


def _takes_n_workers(client: Client) -> bool:
    import inspect

    return "n_workers" in inspect.signature(client.scheduler_info).parameters
