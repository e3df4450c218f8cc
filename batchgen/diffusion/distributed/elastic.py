"""Trajectories across Dask workers: one elastic loop per worker on the runtime's image engines,
step-level combining, migration, elastic degree.

    results = run_on_cluster(client, "path/to/pipeline", requests, policy="srwf", cost=cost)

The driver deals the requests out (policy.diffusion_steal.deal: the policy's order, each to the
worker whose list it lengthens least by the cost model); every worker runs one loop
(elastic_loop.py) on its engine for the pipeline (the one the cluster runtime keeps for that
spec, so `batchgen.diffuse` and this driver share it) that admits its own list between steps
while it has room (and once each request has arrived), so new work joins running batches, and
runs free at degree 1. A worker that runs dry asks another for work: it is handed queued
requests or trajectories (suspended at a step boundary, resumed exactly) or, where the pure plan
says a trajectory runs faster spread over both, the two run lockstep rounds at degree > 1
(elastic_sync.py) until it no longer does. The loops talk through the workers' mailboxes, worker
to worker. Results come back as PNG bytes (a video: one per frame) with their finish time.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from ...policy.diffusion_cost import CostModel
from ...policy.diffusion_plan import ElasticOptions
from ...policy.diffusion_steal import deal
from ...policy.diffusion_step import check_policy
from ..engine.output import ImageResult
from ..engine.request import ImageRequest
from .elastic_loop import Post, box_name, elastic_loop, request_view
from .on_worker import install_side, on_engine, this_side

ABORT_WAIT_S = 60.0  # how long a failed job waits for its other parts to see the abort


def run_on_cluster(client: Any, model: str, requests: Sequence[ImageRequest], *, policy: str = "srwf",
                   max_running: int = 8, admit_per_step: int = 2, deadlines: Sequence[float | None] | None = None,
                   cost: CostModel | None = None, engine_options: dict | None = None,
                   elastic: bool | ElasticOptions = True, arrivals: Sequence[float] | None = None,
                   keep_arrays: bool = False, stats: list | None = None) -> list[ImageResult]:
    """Run `requests` on every worker of `client`; -> results in input order.

    elastic (default): the workers join one gloo world (once, world.world_ranks) so that
    two of them can run a trajectory at degree 2 when `cost` (calibrate it: calibrate.py) says
    that pays; an ElasticOptions sets the knobs (max_running / admit_per_step otherwise).
    elastic=False: degree 1 only, no world (migration to idle workers still).
    arrivals: seconds after the start before each request may be admitted (default all at 0).
    stats: a list to extend with each worker loop's counters (steps, forwards, migrations,
    sync phases and their rounds, seconds in their exchanges...)."""
    from distributed import as_completed, wait

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
        from .world import world_ranks

        ranks = world_ranks(client)
    else:
        ranks = {w: i for i, w in enumerate(sorted(client.scheduler_info()["workers"]))}
    cost = cost or CostModel()
    engine_options = dict(engine_options or {})
    requests, deadlines, arrivals = list(requests), list(deadlines or [None] * n), list(arrivals or [0.0] * n)
    job = uuid.uuid4().hex[:8]
    by_rank = sorted(ranks, key=ranks.get)
    client.run(install_side, workers=by_rank)  # every part can be sent to before any part starts
    views, packs = client.submit(_views, model, engine_options, requests, arrivals, deadlines, workers=[by_rank[0]],
                                 pure=False).result()
    cost = cost.packing(packs)  # the deal and every loop price the forwards the workers will run
    start = time.time()
    lists = deal(views, [ranks[w] for w in by_rank], policy, start, cost)
    addresses = tuple(by_rank)
    loops = [client.submit(_part, model, engine_options, job, addresses, ranks[w], world, lists[ranks[w]], requests,
                           deadlines, arrivals, start, policy, options, cost, keep_arrays, workers=[w],
                           allow_other_workers=False, pure=False, key=f"bg-diff-loop-{job}-{ranks[w]}")
             for w in by_rank]
    try:
        for f in as_completed(loops):
            if f.status == "error":
                # the others would wait for results that never come: tell them, then raise its error
                client.run(_abort, job, len(by_rank), f"a part failed: {f.exception()!r}", workers=by_rank)
                # their boxes are dropped below: a part that has not read the abort by then waits
                # on a fresh empty box for ever and holds its engine (bounded: a part stuck in a
                # collective would never end)
                try:
                    wait(loops, timeout=ABORT_WAIT_S)
                except TimeoutError:
                    pass
                f.result()
        got = client.gather(loops)
    finally:
        client.run(_drop_box, job, len(by_rank), workers=by_rank)
    results: list[ImageResult | None] = [None] * n
    for _, part_results in got:
        for res in part_results:
            results[res.index] = res
    if stats is not None:
        stats.extend(part_stats for part_stats, _ in got)
    return results  # type: ignore[return-value]


def _views(model: str, engine_options: dict, requests: list[ImageRequest], arrivals: list[float],
           deadlines: list[float | None]) -> tuple[list[Any], bool]:
    """The policy's views of the requests, and whether the pipeline's forwards pack (on a
    worker: its engine has the pipeline)."""
    def views(engine: Any) -> tuple[list[Any], bool]:
        pipe = engine.pipe
        return [request_view(pipe, i, r, a, d) for i, (r, a, d) in enumerate(zip(requests, arrivals, deadlines))], \
            pipe.packs
    return on_engine(model, engine_options, views)


def _part(model: str, engine_options: dict, job: str, addresses: tuple[str, ...], me: int, world: bool,
          mine: Sequence[int], requests: Sequence[ImageRequest], deadlines: Sequence[float | None],
          arrivals: Sequence[float], start: float, policy: str, options: ElasticOptions, cost: CostModel,
          keep_arrays: bool) -> tuple[dict[str, Any], list[ImageResult]]:
    """A Dask task pinned to its worker: that worker's part of the job, run on its engine."""
    post = Post(this_side(), job, me, addresses)
    return on_engine(model, engine_options, lambda engine: elastic_loop(
        engine, post, world, mine, requests, deadlines, arrivals, start, policy, options, cost, keep_arrays),
        long=True)


def _abort(job: str, parts: int, why: str, dask_worker: Any) -> None:
    from ...cluster.worker import ensure_side

    side = ensure_side(dask_worker)
    for rank in range(parts):
        side.mailboxes.put(box_name(job, rank), ("abort", why))


def _drop_box(job: str, parts: int, dask_worker: Any) -> None:
    from ...cluster.worker import ensure_side

    side = ensure_side(dask_worker)
    for rank in range(parts):
        side.mailboxes.drop(box_name(job, rank))
