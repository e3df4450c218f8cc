"""Trajectories across Dask workers: one engine loop per worker, step-level combining, migration.

    results = run_on_cluster(client, "path/to/pipeline", requests, policy="srwf")

The driver orders the requests with the job's policy (policy.priority) and puts them on a
distributed Queue; each worker's loop admits requests between steps while it has room, so new
work joins running batches. A worker that runs dry asks for work (the `steal` queue); a busy one
suspends its trajectory with the most remaining work at the next step boundary and hands the
bytes over (its `migrate-<worker>` queue); the thief resumes it exactly (Trajectory state).
Results come back as PNG bytes with their finish time.
"""
from __future__ import annotations

import io
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .cost import CostModel
from .plan import ElasticOptions
from .policy import TrajView, check_policy, priority
from .request import ImageRequest


@dataclass(slots=True)
class ImageResult:
    index: int
    png: bytes | None
    error: str | None
    finished_at: float       # time.time() on the worker
    worker: str              # the worker that decoded it
    migrated: bool = False
    degrees: tuple[int, ...] = ()   # elastic runs: the sequence-parallel degree of each step
    array: Any = None        # keep_arrays: [H, W, 3] float32 before quantisation


def run_on_cluster(client: Any, model: str, requests: Sequence[ImageRequest], *, policy: str = "srwf",
                   max_running: int = 8, admit_per_step: int = 2, deadlines: Sequence[float | None] | None = None,
                   migrate: bool = True, cost: CostModel | None = None, engine_options: dict | None = None,
                   elastic: bool | ElasticOptions = True, arrivals: Sequence[float] | None = None,
                   keep_arrays: bool = False, stats: list | None = None) -> list[ImageResult]:
    """Run `requests` on every worker of `client`; -> results in input order.

    elastic (default): the workers join one gloo world (once) and run the elastic loop
    (cluster_elastic.py): every step boundary, plan.plan_round decides admissions, migrations
    and each trajectory's sequence-parallel degree from `cost` (calibrate it: calibrate.py);
    an ElasticOptions sets its knobs (max_running / admit_per_step otherwise). elastic=False:
    free-running loops at degree 1 over distributed Queues, idle workers stealing (`migrate`).
    arrivals: seconds after the start before each request may be admitted (default all at 0).
    stats: a list to extend with each worker loop's counters (rounds, forwards, seconds in sync...)."""
    check_policy(policy)
    if elastic is not False:
        return _run_elastic(client, model, requests, policy, deadlines, arrivals, cost or CostModel(),
                            elastic if isinstance(elastic, ElasticOptions)
                            else ElasticOptions(max_running=max_running, admit_per_round=admit_per_step),
                            engine_options or {}, keep_arrays, stats)
    if arrivals is not None:
        raise ValueError("arrivals need the elastic loop (elastic=True)")
    from distributed import Queue

    job = uuid.uuid4().hex[:8]
    workers = sorted(client.scheduler_info()["workers"])
    cost = cost or CostModel()
    now = time.time()
    views = [TrajView(i, (), _tokens(r), 2 if r.uses_guidance else 1, r.num_inference_steps, float(i),
                      None if deadlines is None else deadlines[i]) for i, r in enumerate(requests)]
    todo = Queue(f"bg-diff-req-{job}")
    for v in priority(views, policy, now, cost):
        todo.put((v.tid, requests[v.tid], None if deadlines is None else deadlines[v.tid]))
    loops = [client.submit(worker_loop, model, job, w, policy, max_running, admit_per_step, migrate, cost,
                           engine_options or {},
                           workers=[w], allow_other_workers=False, pure=False, key=f"bg-diff-loop-{job}-{i}")
             for i, w in enumerate(workers)]
    results = _collect(job, len(requests), loops)
    Queue(f"bg-diff-done-{job}").put(True)
    got = client.gather(loops)
    if stats is not None:
        stats.extend(got)
    return results


def _run_elastic(client: Any, model: str, requests: Sequence[ImageRequest], policy: str,
                 deadlines: Sequence[float | None] | None, arrivals: Sequence[float] | None, cost: CostModel,
                 options: ElasticOptions, engine_options: dict, keep_arrays: bool, stats: list | None
                 ) -> list[ImageResult]:
    from .cluster_elastic import elastic_loop
    from .sp_cluster import world_ranks

    n = len(requests)
    if arrivals is not None and len(arrivals) != n or deadlines is not None and len(deadlines) != n:
        raise ValueError(f"arrivals and deadlines need one entry per request ({n})")
    job = uuid.uuid4().hex[:8]
    ranks = world_ranks(client)
    world = tuple(sorted(ranks.values()))
    requests = list(requests)
    loops = [client.submit(elastic_loop, model, job, world, requests, list(deadlines or [None] * n),
                           list(arrivals or [0.0] * n), policy, options, cost, engine_options, keep_arrays,
                           workers=[w], allow_other_workers=False, pure=False, key=f"bg-diff-elastic-{job}-{r}")
             for w, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    results = _collect(job, n, loops)
    got = client.gather(loops)
    if stats is not None:
        stats.extend(got)
    return results


def _collect(job: str, n: int, loops: list[Any] | None = None) -> list[ImageResult]:
    """The job's n results off its output Queue, in input order (a failed loop raises)."""
    from distributed import Queue

    done_queue = Queue(f"bg-diff-out-{job}")
    results: list[ImageResult | None] = [None] * n
    got = 0
    while got < n:
        res = _get(done_queue, 0.5)
        if res is None:
            for f in loops or []:
                if f.status == "error":
                    f.result()  # raises the worker's exception
            continue
        results[res.index] = res
        got += 1
    return results  # type: ignore[return-value]


def _tokens(r: ImageRequest) -> int:
    # policy ordering before a model is loaded: pixel area stands in for tokens
    return (r.height or 256) * (r.width or 256)


def worker_loop(model: str, job: str, me: str, policy: str, max_running: int, admit_per_step: int, migrate: bool,
                cost: CostModel, engine_options: dict) -> dict[str, int]:
    """One worker's engine loop for job `job` (a Dask task pinned to worker `me`)."""
    from distributed import Queue, secede

    from .frame import _engine

    secede()
    engine = _engine(model, {**engine_options, "policy": policy, "cost": cost})
    todo, out = Queue(f"bg-diff-req-{job}"), Queue(f"bg-diff-out-{job}")
    steal, inbox = Queue(f"bg-diff-steal-{job}"), Queue(f"bg-diff-migrate-{job}-{me}")
    done = Queue(f"bg-diff-done-{job}")
    index_of: dict[int, tuple[int, bool]] = {}  # engine tid -> (job index, arrived by migration)
    asked = False
    stats = {"steps": 0, "migrated_in": 0, "migrated_out": 0}
    queue_empty = False
    while True:
        admitted = 0
        # a few per step, so that every worker's loop gets a share of the queue
        while not queue_empty and len(index_of) < max_running and admitted < admit_per_step:
            admitted += 1
            item = _get(todo)
            if item is None:
                queue_empty = True
                break
            index, req, deadline = item
            index_of[engine.add_request(req, deadline=deadline)] = (index, False)
        if not index_of:
            if migrate:
                if not asked:
                    steal.put(me)
                    asked = True
                got = _get(inbox, 0.05)
                if got is not None:
                    index, deadline, data = got
                    index_of[engine.resume(data, deadline=deadline)] = (index, True)
                    stats["migrated_in"] += 1
                    asked = False
                    continue
            if done.qsize() > 0:
                return stats
            if not migrate:
                time.sleep(0.05)
            continue
        for o in engine.step():
            index, moved = index_of.pop(o.index)
            out.put(ImageResult(index, _png(o.image) if o.error is None else None, o.error, time.time(), me, moved))
        stats["steps"] += 1
        if migrate and len(index_of) >= 2 and queue_empty:
            thief = _get(steal)
            if thief is not None and thief != me:
                tid = max(index_of, key=lambda t: engine.trajectory(t).remaining_steps
                          if engine.trajectory(t).step > 0 else -1)
                index, _ = index_of.pop(tid)
                Queue(f"bg-diff-migrate-{job}-{thief}").put((index, None, engine.suspend(tid)))
                stats["migrated_out"] += 1


def _get(queue: Any, wait: float = 0.0) -> Any:
    """An item, or None when the queue is empty (after `wait` seconds). qsize first: a get that
    times out is logged by the scheduler as an error."""
    deadline = time.time() + wait
    while True:
        if queue.qsize() > 0:
            try:
                return queue.get(timeout=1.0)  # another worker may have taken it meanwhile
            except Exception:  # noqa: BLE001 - distributed's timeout
                return None
        if time.time() >= deadline:
            return None
        time.sleep(0.01)


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
