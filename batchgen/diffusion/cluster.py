"""Trajectories across Dask workers: one engine loop per worker, step-level combining, migration,
elastic degree.

    results = run_on_cluster(client, "path/to/pipeline", requests, policy="srwf", cost=cost)

The driver deals the requests out (steal.deal: the policy's order, each to the worker whose list
it lengthens least by the cost model); every worker runs one loop (cluster_elastic.py) that
admits its own list between steps while it has room (and once each request has arrived), so new
work joins running batches, and runs free at degree 1. A worker that runs dry registers as a
thief; a busy one hands it queued requests or trajectories (suspended at a step boundary,
resumed exactly) or, where the pure plan says a trajectory runs faster spread over both, the
two run lockstep rounds at degree > 1 (cluster_sync.py) until it no longer does.
Results come back as PNG bytes with their finish time.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from .cluster_elastic import elastic_loop, request_view
from ..policy.diffusion_cost import CostModel
from .output import ImageResult
from ..policy.diffusion_plan import ElasticOptions
from ..policy.diffusion_step import check_policy
from .request import ImageRequest
from ..policy.diffusion_steal import deal


def run_on_cluster(client: Any, model: str, requests: Sequence[ImageRequest], *, policy: str = "srwf",
                   max_running: int = 8, admit_per_step: int = 2, deadlines: Sequence[float | None] | None = None,
                   cost: CostModel | None = None, engine_options: dict | None = None,
                   elastic: bool | ElasticOptions = True, arrivals: Sequence[float] | None = None,
                   keep_arrays: bool = False, stats: list | None = None) -> list[ImageResult]:
    """Run `requests` on every worker of `client`; -> results in input order.

    elastic (default): the workers join one gloo world (once, sp_cluster.world_ranks) so that
    two of them can run a trajectory at degree 2 when `cost` (calibrate it: calibrate.py) says
    that pays; an ElasticOptions sets the knobs (max_running / admit_per_step otherwise).
    elastic=False: degree 1 only, no world (migration to idle workers still).
    arrivals: seconds after the start before each request may be admitted (default all at 0).
    stats: a list to extend with each worker loop's counters (steps, forwards, migrations,
    sync phases and their rounds, seconds in their exchanges...)."""
    from distributed import Queue

    check_policy(policy)
    n = len(requests)
    if arrivals is not None and len(arrivals) != n or deadlines is not None and len(deadlines) != n:
        raise ValueError(f"arrivals and deadlines need one entry per request ({n})")
    if isinstance(elastic, ElasticOptions):
        options = elastic
    else:
        options = ElasticOptions(max_running=max_running, admit_per_round=admit_per_step,
                                 max_degree=None if elastic else 1)
    world = options.max_degree != 1
    if world:
        from .sp_cluster import world_ranks

        ranks = world_ranks(client)
    else:
        ranks = {w: i for i, w in enumerate(sorted(client.scheduler_info()["workers"]))}
    cost = cost or CostModel()
    engine_options = engine_options or {}
    requests, deadlines, arrivals = list(requests), list(deadlines or [None] * n), list(arrivals or [0.0] * n)
    job = uuid.uuid4().hex[:8]
    by_rank = sorted(ranks, key=ranks.get)
    views, packs = client.submit(_views, model, engine_options, requests, arrivals, deadlines, workers=[by_rank[0]],
                                 pure=False).result()
    cost = cost.packing(packs)  # the deal and every loop price the forwards the workers will run
    start = time.time()
    lists = deal(views, [ranks[w] for w in by_rank], policy, start, cost)
    loops = [client.submit(elastic_loop, model, job, ranks[w], world, lists[ranks[w]], requests, deadlines, arrivals,
                           start, policy, options, cost, engine_options, keep_arrays, len(ranks), workers=[w],
                           allow_other_workers=False, pure=False, key=f"bg-diff-loop-{job}-{ranks[w]}")
             for w in by_rank]
    results = _collect(job, n, loops)
    Queue(f"bg-diff-done-{job}").put(True)
    got = client.gather(loops)
    if stats is not None:
        stats.extend(got)
    return results


def _views(model: str, engine_options: dict, requests: list[ImageRequest], arrivals: list[float],
           deadlines: list[float | None]) -> tuple[list[Any], bool]:
    """The policy's views of the requests, and whether the pipeline's forwards pack (on a
    worker: it has the pipeline)."""
    from .engine_spec import process_engine

    pipe = process_engine(model, engine_options).pipe
    return [request_view(pipe, i, r, a, d) for i, (r, a, d) in enumerate(zip(requests, arrivals, deadlines))], pipe.packs


def _collect(job: str, n: int, loops: list[Any]) -> list[ImageResult]:
    """The job's n results off its output Queue (lists of those finished together), in input
    order (a failed loop raises)."""
    from distributed import Queue

    done_queue = Queue(f"bg-diff-out-{job}")
    results: list[ImageResult | None] = [None] * n
    got = 0
    while got < n:
        # one round trip per look, none waiting in the scheduler; the driver's polling shares the
        # CPUs with the workers (finish times are the workers' own, so its delay costs nothing)
        batches = done_queue.get(batch=True)
        if not batches:
            for f in loops:
                if f.status == "error":
                    f.result()  # raises the worker's exception
            time.sleep(0.05)
            continue
        for res in (r for batch in batches for r in batch):
            results[res.index] = res
            got += 1
    return results  # type: ignore[return-value]
