"""Where each model runs and which rows each replica gets: MOSAIC's expert placement. Pure:
no torch, no Dask, no clock; state in, a Placement out.

A worker's expert-stage time is the sum over the models it holds of (load time + that model's
work there), a row's work being seconds per row + its predicted tokens x seconds per token
(both measured at the batch the engine reaches: see costs.profile_cost); the job's expert stage
ends with its slowest worker (the makespan). Models sharing a worker share its cores: each
runs slower by as much as the others take, so their work adds up (the sum), which is how the
makespan charges them. A forward also has a fixed cost (`seconds_per_step`) whatever its
batch: a replica runs max(its longest row, its tokens / max_batch) forwards, so splitting a
model whose rows do not fill two batches costs more forwards (small jobs stay on one replica). `place` minimizes that makespan:

- policy "ilp": a mixed-integer program (scipy.optimize.milp, HiGHS). Binaries x[m, w] (model m
  has a replica on worker w) and y[c, w] (chunk c of m's rows goes to w, y <= x); per worker
  sum_m mem[m] x[m, w] <= mem[w] and sum (load[m] x[m, w] + work[c] y[c, w] + step[m] s[m, w]) <= T,
  s[m, w] >= longest[c] y[c, w] and >= sum_c tokens[c] y[c, w] / max_batch[m] (continuous:
  the forwards m runs on w); minimize T.
  Each model's rows are dealt into at most `chunks_per_model` chunks of near-equal work
  (largest first), so small jobs are solved row by row (exact) and large ones stay a few
  thousand binaries. The replica cap bounds each model's replicas by its work over its load
  time (a replica that loads for longer than the work it takes over cannot pay for itself) and
  by its chunks. The solver runs under `time_limit_s`, and no longer than the most it could
  save (greedy makespan - a lower bound); it stops within `gap` (1%) of the optimum and is
  skipped when the greedy placement is within `gap` of the lower bound already;
  if it has no answer in time, or a worse one than the greedy placement, the greedy one is
  used, and `Placement.solver` / `note` say which.
- policy "round_robin": model i on worker i mod N (the next one with room), all its rows there.
- policy "data_parallel": every model on every worker, each model's rows dealt round-robin.

Why HiGHS through scipy: maintained, ships in scipy wheels (no solver binary to install), and
honours a time limit while returning its incumbent.
"""
from __future__ import annotations

import heapq
import math
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from .placement_types import (  # noqa: F401  (re-exported: the placement API is imported from here)
    GAP,
    POLICIES,
    Demand,
    ModelCost,
    Placement,
    PlacementError,
    Policy,
    WorkerSlot,
)


def place(demand: Mapping[str, Demand], costs: Mapping[str, ModelCost], workers: Sequence[WorkerSlot],
          policy: Policy = "ilp", *, time_limit_s: float = 5.0, chunks_per_model: int | None = None,
          max_replicas: Mapping[str, int] | None = None, gap: float = GAP) -> Placement:
    """Place the models of `demand` on `workers` and split their rows, minimizing the predicted
    expert-stage makespan (see the module docstring). Models with no rows are not placed.
    gap: the solver stops once its placement is proven within this fraction of the optimum
    (0: prove it optimal), and is not run at all when the greedy placement is already within
    it of a lower bound: profiled costs are not more exact than a percent, and the solve time
    is part of the stage; for the same reason, with gap > 0, it runs no longer than the most
    it could save (the greedy makespan less the lower bound), nor than `time_limit_s`. Raises PlacementError when a model fits no worker or the models
    cannot all be held."""
    if not (0.0 <= gap < 1.0):
        raise PlacementError(f"gap must be in [0, 1), got {gap!r}")
    if policy not in POLICIES:
        raise PlacementError(f"placement policy {policy!r} unknown; use one of {', '.join(POLICIES)}")
    # a plain {row: predicted tokens} per model is a Demand too
    demand = {m: d if isinstance(d, Demand) else Demand.of(d) if isinstance(d, Mapping) else d
              for m, d in demand.items()}
    _check(demand, costs, workers)
    models = sorted(m for m, d in demand.items() if d.rows)
    if policy == "round_robin":
        return _finish(policy, _round_robin(models, costs, workers), demand, costs, workers, policy)
    if policy == "data_parallel":
        return _data_parallel(models, demand, costs, workers)
    return _ilp(models, demand, costs, workers, time_limit_s,
                chunks_per_model or max(8, 4 * len(workers)), dict(max_replicas or {}), gap)


def _check(demand: Mapping[str, Demand], costs: Mapping[str, ModelCost], workers: Sequence[WorkerSlot]) -> None:
    if not workers:
        raise PlacementError("no workers to place models on")
    for kind, values, cls in (("workers", workers, WorkerSlot), ("demand", demand.values(), Demand),
                              ("costs", costs.values(), ModelCost)):
        wrong = [v for v in values if not isinstance(v, cls)]
        if wrong:
            raise PlacementError(f"{kind} must be {cls.__name__} values, got {wrong[0]!r}")
    names = [w.name for w in workers]
    if len(set(names)) != len(names):
        raise PlacementError(f"worker names must be unique, got {names}")
    for m, d in demand.items():
        if m not in costs:
            raise PlacementError(f"model {m!r} has demand but no ModelCost")
        if d.rows and len(set(d.rows)) != len(d.rows):
            raise PlacementError(f"model {m!r}: a row is routed to it twice")
        biggest = max(w.memory_bytes for w in workers)
        if d.rows and costs[m].memory_bytes > biggest:
            raise PlacementError(f"model {m!r} needs {costs[m].memory_bytes} bytes; the largest worker has "
                                 f"{biggest}: it fits no worker")


# -- rows onto replicas ----------------------------------------------------------------------------
def _chunks(d: Demand, n: int, cost: ModelCost) -> list[list[int]]:
    """Row indices dealt into at most n chunks of near-equal work (largest row first)."""
    order = sorted(range(len(d.rows)), key=lambda i: (-d.tokens[i], i))
    if len(order) <= n:
        return [[i] for i in order]
    chunks: list[list[int]] = [[] for _ in range(n)]
    heap = [(0.0, j) for j in range(n)]  # (work so far, chunk): the least loaded, lowest index on ties
    for i in order:
        work, k = heapq.heappop(heap)
        chunks[k].append(i)
        heapq.heappush(heap, (work + cost.row_s(d.tokens[i]), k))
    return chunks


@dataclass(frozen=True, slots=True)
class _Unit:
    """Rows of one model that go to a replica together (one row, or a chunk), with their sums,
    so that trial placements do not add up every row again."""

    idx: tuple[int, ...]  # row indices into the model's Demand
    work: float  # seconds of its rows (ModelCost.row_s)
    tokens: float  # their predicted tokens
    longest: float  # the largest row's


def _units(d: Demand, cost: ModelCost, groups: Sequence[Sequence[int]] | None = None) -> list[_Unit]:
    """Rows (or groups of row indices) as units, largest work first (the order _spread deals them)."""
    if groups is None:
        groups = [(i,) for i in range(len(d.rows))]
    units = [_Unit(tuple(g), sum(cost.row_s(d.tokens[i]) for i in g), sum(d.tokens[i] for i in g),
                   max(d.tokens[i] for i in g)) for g in groups if g]
    return sorted(units, key=lambda u: (-u.work, u.idx[:1]))


def _spread(units: list[_Unit], replicas: Sequence[str], base: dict[str, float]) -> dict[str, list[_Unit]]:
    """One model's units (largest first) onto its replicas, each to the replica that would finish
    first counting what it already has (`base`, updated)."""
    out: dict[str, list[_Unit]] = {w: [] for w in replicas}
    heap = [(base[w], w) for w in replicas]  # the replica that finishes first, by name on ties
    heapq.heapify(heap)
    for unit in units:
        t, w = heapq.heappop(heap)
        out[w].append(unit)
        heapq.heappush(heap, (t + unit.work, w))
    for t, w in heap:
        base[w] = t
    return out


Groups = dict[str, dict[str, list[_Unit]]]  # model -> worker -> its units there


def _deal(replicas: dict[str, list[str]], demand: Mapping[str, Demand], costs: Mapping[str, ModelCost],
          workers: Sequence[WorkerSlot], units: dict[str, list[_Unit]] | None = None) -> Groups:
    """Every model's rows (or `units`) spread onto its replicas, the heaviest model first, each
    replica charged its load first."""
    base = {w.name: 0.0 for w in workers}
    order = sorted(replicas, key=lambda m: -costs[m].work_s(demand[m]))
    for m in order:
        for w in replicas[m]:
            base[w] += costs[m].load_s
    return {m: _spread((units or {}).get(m) or _units(demand[m], costs[m]), replicas[m], base) for m in order}


def _times(groups: Groups, costs: Mapping[str, ModelCost], workers: Sequence[WorkerSlot]) -> dict[str, float]:
    """Predicted seconds per worker: per model it holds rows of, load + work + forwards."""
    worker_s = {w.name: 0.0 for w in workers}
    for m, by_worker in groups.items():
        cost = costs[m]
        for w, us in by_worker.items():
            if not us:
                continue
            worker_s[w] += (cost.load_s + sum(u.work for u in us)
                            + cost.steps_s_of(max(u.longest for u in us), sum(u.tokens for u in us)))
    return worker_s


def _finish(policy: str, replicas: dict[str, list[str]], demand: Mapping[str, Demand],
            costs: Mapping[str, ModelCost], workers: Sequence[WorkerSlot], solver: str,
            assign: dict[str, dict[str, list[int]]] | None = None, units: dict[str, list[_Unit]] | None = None,
            **extra: object) -> Placement:
    """Build the Placement: rows (or `units`, from _units) spread onto replicas unless `assign`
    gives each worker's row indices; replicas left without rows are dropped (and not charged
    their load)."""
    if assign is None:
        groups = _deal(replicas, demand, costs, workers, units)
    else:
        groups = {m: {w: _units(demand[m], costs[m], [idx]) for w, idx in by_worker.items()}
                  for m, by_worker in assign.items()}
    worker_s = _times(groups, costs, workers)
    rows: dict[str, dict[str, tuple[Hashable, ...]]] = {w.name: {} for w in workers}
    used: dict[str, list[str]] = {}
    for m, by_worker in groups.items():
        for w, us in by_worker.items():
            if us:
                rows[w][m] = tuple(demand[m].rows[i] for u in us for i in u.idx)
                used.setdefault(m, []).append(w)
    position = {w.name: i for i, w in enumerate(workers)}
    reps = {m: tuple(sorted(ws, key=position.__getitem__)) for m, ws in used.items()}
    return Placement(policy, reps, rows, worker_s, solver=solver, **extra)  # type: ignore[arg-type]


def _fits(mem: dict[str, float], w: WorkerSlot, need: int) -> bool:
    return mem[w.name] + need <= w.memory_bytes


def _round_robin(models: list[str], costs: Mapping[str, ModelCost], workers: Sequence[WorkerSlot]) -> dict[str, list[str]]:
    mem = {w.name: 0.0 for w in workers}
    replicas: dict[str, list[str]] = {}
    for i, m in enumerate(models):
        for k in range(len(workers)):
            w = workers[(i + k) % len(workers)]
            if _fits(mem, w, costs[m].memory_bytes):
                mem[w.name] += costs[m].memory_bytes
                replicas[m] = [w.name]
                break
        else:
            raise PlacementError(f"round_robin: no worker has room left for model {m!r} "
                                 f"({costs[m].memory_bytes} bytes) after the models before it")
    return replicas


def _data_parallel(models: list[str], demand: Mapping[str, Demand], costs: Mapping[str, ModelCost],
                   workers: Sequence[WorkerSlot]) -> Placement:
    need = sum(costs[m].memory_bytes for m in models)
    small = [w.name for w in workers if w.memory_bytes < need]
    if small:
        raise PlacementError(f"data_parallel puts every model on every worker ({need} bytes); "
                             f"workers {small} have less memory")
    names = [w.name for w in workers]
    assign = {m: {w: list(range(k, len(demand[m].rows), len(names))) for k, w in enumerate(names)} for m in models}
    return _finish("data_parallel", {m: names for m in models}, demand, costs, workers, "data_parallel", assign)


# -- greedy ----------------------------------------------------------------------------------------
def _greedy(models: list[str], demand: Mapping[str, Demand], costs: Mapping[str, ModelCost],
            workers: Sequence[WorkerSlot], caps: dict[str, int], chunks: dict[str, list[list[int]]]) -> Placement | None:
    """Largest model first onto the worker that finishes it first, then replicas added one at a
    time (on the bottleneck's models) while they lower the predicted makespan. Trials are
    judged on chunks; the answer spreads single rows. None when first-fit packing leaves a
    model without room (the program may still find a packing)."""
    work = {m: costs[m].work_s(demand[m]) for m in models}
    mem = {w.name: 0.0 for w in workers}
    replicas: dict[str, list[str]] = {}
    load = {w.name: 0.0 for w in workers}
    for m in sorted(models, key=lambda m: (-work[m], m)):
        fit = [w for w in workers if _fits(mem, w, costs[m].memory_bytes)]
        if not fit:
            return None
        w = min(fit, key=lambda w: (load[w.name] + costs[m].load_s + work[m], w.name))
        replicas[m] = [w.name]
        mem[w.name] += costs[m].memory_bytes
        load[w.name] += costs[m].load_s + work[m]
    units = {m: _units(demand[m], costs[m], chunks[m]) for m in models}  # summed once for every trial
    best = _deal(replicas, demand, costs, workers, units)
    best_s = _times(best, costs, workers)
    while True:
        bottleneck = max(best_s, key=best_s.__getitem__)
        trial_best: tuple[Groups, dict[str, float], str, str] | None = None
        for m in [m for m, by_worker in best.items() if by_worker.get(bottleneck)]:
            if len(replicas[m]) >= caps[m]:
                continue
            for w in workers:
                if w.name in replicas[m] or not _fits(mem, w, costs[m].memory_bytes):
                    continue
                trial = _deal({**replicas, m: replicas[m] + [w.name]}, demand, costs, workers, units)
                trial_s = _times(trial, costs, workers)
                if max(trial_s.values()) < max((trial_best[1] if trial_best else best_s).values()) - 1e-12:
                    trial_best = (trial, trial_s, m, w.name)
        if trial_best is None:
            final = _finish("ilp", replicas, demand, costs, workers, "greedy")
            chunked = _finish("ilp", replicas, demand, costs, workers, "greedy", units=units)
            return final if final.makespan_s <= chunked.makespan_s else chunked
        best, best_s, m, w_name = trial_best
        replicas = {**replicas, m: replicas[m] + [w_name]}
        mem[w_name] += costs[m].memory_bytes


# -- the mixed-integer program ---------------------------------------------------------------------
def _caps(models: list[str], demand: Mapping[str, Demand], costs: Mapping[str, ModelCost], n_workers: int,
          chunks: dict[str, list[list[int]]], given: dict[str, int], bound_s: float = math.inf) -> dict[str, int]:
    """Most replicas per model. Load time against work: the workers' total time, n * T, holds
    all the work plus every replica's load, so with T no worse than `bound_s` (a placement in
    hand) model m can have at most (n * bound - work - the other models' one load each) / load[m]
    replicas: a cap that never cuts off a better placement. Also at most one per chunk, and the
    caller's `max_replicas`."""
    total = sum(costs[m].work_s(demand[m]) for m in models)
    loads = sum(costs[m].load_s for m in models)
    caps: dict[str, int] = {}
    for m in models:
        cap = min(n_workers, len(chunks[m]), given.get(m, n_workers))
        if costs[m].load_s > 0 and math.isfinite(bound_s):
            room = n_workers * bound_s - total - (loads - costs[m].load_s)
            cap = min(cap, math.floor(room / costs[m].load_s + 1e-9))
        caps[m] = max(1, cap)
    return caps


def _lower_bound(models: list[str], demand: Mapping[str, Demand], costs: Mapping[str, ModelCost],
                 n_workers: int) -> float:
    """No placement beats this: the workers share all the work and at least one load per
    model; and some worker loads each model and runs its largest row."""
    spread = sum(costs[m].work_s(demand[m]) + costs[m].load_s + costs[m].steps_s(demand[m].tokens)
                 for m in models) / n_workers  # replicas' forwards add up to at least one replica's
    single = max(costs[m].load_s + costs[m].row_s(max(demand[m].tokens)) + costs[m].steps_s([max(demand[m].tokens)])
                 for m in models)
    return max(spread, single)


def _ilp(models: list[str], demand: Mapping[str, Demand], costs: Mapping[str, ModelCost],
         workers: Sequence[WorkerSlot], time_limit_s: float, per_model: int, given: dict[str, int],
         gap: float) -> Placement:
    start = time.perf_counter()
    chunks = {m: _chunks(demand[m], per_model, costs[m]) for m in models}
    if not models:
        return _finish("ilp", {}, demand, costs, workers, "ilp", optimal=True)
    greedy = _greedy(models, demand, costs, workers, _caps(models, demand, costs, len(workers), chunks, given),
                     chunks)
    bound = _lower_bound(models, demand, costs, len(workers))
    if greedy is not None and greedy.makespan_s <= bound * (1.0 + gap) + 1e-12:
        return _replace(greedy, time.perf_counter() - start,
                        f"within {100 * (greedy.makespan_s / bound - 1) if bound else 0:.2g}% of a lower bound: "
                        "no solver needed", optimal=greedy.makespan_s <= bound + 1e-12)

    if greedy is not None and gap > 0:  # solving longer than the most it could save only adds to the stage
        time_limit_s = min(time_limit_s, greedy.makespan_s - bound)
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    caps = _caps(models, demand, costs, len(workers), chunks, given,
                 greedy.makespan_s if greedy is not None else math.inf)
    W = len(workers)
    # variable layout: x[m, w] | y[c, w] for every chunk c | T
    xi = {(m, w): i * W + w for i, m in enumerate(models) for w in range(W)}
    flat = [(m, c) for m in models for c in chunks[m]]
    y0 = len(models) * W
    stepped = [m for m in models if costs[m].seconds_per_step > 0]
    s0 = y0 + len(flat) * W  # s[m, w]: forwards model m runs on w (continuous), for stepped models
    si = {(m, w): s0 + i * W + w for i, m in enumerate(stepped) for w in range(W)}
    t = s0 + len(stepped) * W
    n = t + 1
    work = [sum(costs[m].row_s(demand[m].tokens[i]) for i in c) for m, c in flat]
    rows: list[tuple[dict[int, float], float, float]] = []
    for k, (m, _) in enumerate(flat):
        rows.append(({y0 + k * W + w: 1.0 for w in range(W)}, 1.0, 1.0))  # each chunk somewhere
        for w in range(W):
            rows.append(({y0 + k * W + w: 1.0, xi[m, w]: -1.0}, -np.inf, 0.0))  # only on a replica
            if (m, w) in si:  # s >= the chunk's longest row wherever the chunk goes
                rows.append(({y0 + k * W + w: max(demand[m].tokens[i] for i in flat[k][1]), si[m, w]: -1.0},
                             -np.inf, 0.0))
    for m in stepped:  # s >= the tokens there / max_batch
        for w in range(W):
            coefs = {y0 + k * W + w: sum(demand[m].tokens[i] for i in c) / costs[m].max_batch
                     for k, (mm, c) in enumerate(flat) if mm == m}
            coefs[si[m, w]] = -1.0
            rows.append((coefs, -np.inf, 0.0))
    for m in models:
        rows.append(({xi[m, w]: 1.0 for w in range(W)}, 1.0, float(caps[m])))
    for w, slot in enumerate(workers):
        if math.isfinite(slot.memory_bytes):
            rows.append(({xi[m, w]: float(costs[m].memory_bytes) for m in models}, -np.inf, float(slot.memory_bytes)))
        time_row = {xi[m, w]: costs[m].load_s for m in models}
        time_row.update({y0 + k * W + w: work[k] for k in range(len(flat))})
        time_row.update({si[m, w]: costs[m].seconds_per_step for m in stepped})
        time_row[t] = -1.0
        rows.append((time_row, -np.inf, 0.0))
    lo, hi = np.empty(len(rows)), np.empty(len(rows))
    ri: list[int] = []
    ci: list[int] = []
    vals: list[float] = []
    for r, (coefs, low, high) in enumerate(rows):
        ri += [r] * len(coefs)
        ci += coefs.keys()
        vals += coefs.values()
        lo[r], hi[r] = low, high
    A = coo_array((vals, (ri, ci)), shape=(len(rows), n))
    c = np.zeros(n)
    c[t] = 1.0
    integrality = np.ones(n)
    integrality[s0:] = 0
    ub = np.ones(n)
    ub[s0:] = np.inf
    res = milp(c, constraints=LinearConstraint(A.tocsr(), lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(n), ub), options={"time_limit": max(0.01, time_limit_s), "disp": False,
                                                              "mip_rel_gap": max(gap, 1e-9)})
    solve_s = time.perf_counter() - start
    if res.x is None:
        if res.status == 2:  # proven infeasible: memory
            raise PlacementError("the models cannot all be held: no assignment fits every worker's memory "
                                 f"(models {[(m, costs[m].memory_bytes) for m in models]}, "
                                 f"workers {[(w.name, w.memory_bytes) for w in workers]})")
        if greedy is None:
            raise PlacementError(f"no placement found: the solver gave none in {time_limit_s:g} s "
                                 f"({res.message}) and greedy packing could not fit the models in memory")
        return _replace(greedy, solve_s, f"solver gave no answer in {time_limit_s:g} s ({res.message})")
    assign: dict[str, dict[str, list[int]]] = {m: {} for m in models}
    for k, (m, chunk) in enumerate(flat):
        w = int(np.argmax(res.x[y0 + k * W: y0 + (k + 1) * W]))
        assign[m].setdefault(workers[w].name, []).extend(chunk)
    solver = "ilp" if res.status == 0 else "ilp-incumbent"  # 0: optimal within `gap`
    found = _finish("ilp", {}, demand, costs, workers, solver, assign, solve_s=solve_s,
                    optimal=res.status == 0 and gap == 0)
    if greedy is not None and found.makespan_s > greedy.makespan_s + 1e-12:
        return _replace(greedy, solve_s, f"solver's best after {time_limit_s:g} s was worse than greedy")
    return found


def _replace(p: Placement, solve_s: float, note: str, optimal: bool = False) -> Placement:
    return Placement(p.policy, p.replicas, p.rows, p.worker_s, solver="greedy", solve_s=solve_s, note=note,
                     optimal=optimal)


__all__ = ["Demand", "ModelCost", "Placement", "PlacementError", "Policy", "POLICIES", "WorkerSlot", "place"]
