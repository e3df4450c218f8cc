"""The simulated cluster: N SimEngines on one clock, rows placed by a policy (policies.py).

Time advances in ticks (`tick_s`): every engine runs to the tick, then the policy acts: Dynamic
deals batches to the workers whose queue has drained (until their seats are spoken for); BatchGen calls `plan_migrations` on every
engine's load, as BalancePlugin does on each push, skipping workers in their cooldown after an
order, and carries the orders out (suspend at the yield point, KV over the network or recompute
by `prefer_transfer`, resume at the destination). Static needs no ticks: its workers never
interact, so each runs to the end alone.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import PlanError
from ..policy.balance import EngineLoad, Migration, plan_migrations
from .cost import CostModel
from .engine import Arrival, SimEngine
from .engine_config import EngineSimConfig
from .gc_pace import rare_collections
from .parallel import run_parallel
from .partitions import partitioned_engines, rows_as_sequences
from .policies import BatchGen, Dynamic, Policy, Static, deal
from .shard import EngineResult
from .workload import Workload

# BalancePlugin's defaults (cluster/plugin.py); tests/test_sim_cluster.py keeps them equal.
PLUGIN_COOLDOWN_S = 1.0


@dataclass(frozen=True, slots=True)
class ClusterSimConfig:
    workers: int
    tick_s: float = 1.0  # how often the policy looks (the plugin's pushes come every 0.2 s; see README)
    cooldown_s: float = PLUGIN_COOLDOWN_S
    # engines spread over this many processes (parallel.py: the same results, on several cores)
    processes: int = 1

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise PlanError(f"--workers must be >= 1, got {self.workers}")
        if self.processes < 1:
            raise PlanError(f"processes must be >= 1, got {self.processes}")
        if not self.tick_s > 0 or self.cooldown_s < 0:
            raise PlanError(f"tick_s must be > 0 and cooldown_s >= 0, got {self.tick_s}, {self.cooldown_s}")


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    workers: int
    bct_s: float
    busy_s: tuple[float, ...]  # per worker
    rows_done: int
    rows_failed: int
    migration_orders: int = 0
    migrated_coroutines: int = 0
    wall_s: float = 0.0  # how long simulating took
    timelines: tuple[tuple[tuple[float, float, int], ...], ...] = field(default=(), compare=False, repr=False)

    @property
    def gpu_hours(self) -> float:
        return self.workers * self.bct_s / 3600

    @property
    def utilization(self) -> float:
        return sum(self.busy_s) / (self.workers * self.bct_s) if self.bct_s > 0 else 0.0


def simulate(workload: Workload, cost: CostModel, engine: EngineSimConfig, policy: Policy,
             cluster: ClusterSimConfig, keep_timelines: bool = False) -> SimResult:
    """Run `workload` to the end under `policy`. Deterministic: no randomness, no wall clock in
    any decision (wall_s only reports how long it took)."""
    return simulate_all(workload, cost, engine, (policy,), cluster, keep_timelines)[0]


def simulate_all(workload: Workload, cost: CostModel, engine: EngineSimConfig, policies: tuple[Policy, ...],
                 cluster: ClusterSimConfig, keep_timelines: bool = False) -> tuple[SimResult, ...]:
    """simulate() of each policy; with cluster.processes > 1 all at once, over that many
    processes (parallel.py: the same results). A batchgen variant with its own admission order
    (length-aware) runs in a pass of its own, its engines configured so."""
    with rare_collections():
        return _simulate_all(workload, cost, engine, policies, cluster, keep_timelines)


def _simulate_all(workload: Workload, cost: CostModel, engine: EngineSimConfig, policies: tuple[Policy, ...],
                  cluster: ClusterSimConfig, keep_timelines: bool) -> tuple[SimResult, ...]:
    for policy in policies:
        if not isinstance(policy, (Static, Dynamic, BatchGen)):
            raise PlanError(f"unknown policy {policy!r}")
    if len({p.name for p in policies}) < len(policies):
        raise PlanError("simulate each policy once")
    variants = [p for p in policies if isinstance(p, BatchGen) and p.admission != engine.admission]
    if variants or len({type(p) for p in policies}) < len(policies):
        rest = tuple(p for p in policies if p not in variants)
        if len({type(p) for p in rest}) < len(rest):
            raise PlanError("simulate each policy kind once (besides batchgen variants)")
        done = {r.policy: r for r in (simulate_all(workload, cost, engine, rest, cluster, keep_timelines)
                                      if rest else ())}
        for p in variants:
            done[p.name] = simulate_all(workload, cost, replace(engine, admission=p.admission), (p,), cluster,
                                        keep_timelines)[0]
        return tuple(done[p.name] for p in policies)
    if cluster.processes < 2 or cluster.workers < 2:
        return tuple(_simulate_here(workload, cost, engine, p, cluster, keep_timelines) for p in policies)
    t0 = time.perf_counter()
    names = _names(cluster)
    kinds = tuple(_KINDS[type(p)] for p in policies)
    batchgen = next((p for p in policies if isinstance(p, BatchGen)), None)
    dynamic = next((p for p in policies if isinstance(p, Dynamic)), Dynamic())
    balancer = _Balancer(None, batchgen, cluster, names) if batchgen is not None else None
    per_kind, moved = run_parallel(workload, cost, engine, names, np.array_split(np.arange(workload.rows),
                                   cluster.workers), kinds, cluster.processes, cluster.tick_s, balancer,
                                   dynamic.batch_rows, keep_timelines)
    return tuple(_result(p, cluster, workload, per_kind[kind], balancer.orders if kind == "batchgen" and balancer
                         else 0, moved if kind == "batchgen" else 0, t0, keep_timelines)
                 for p, kind in zip(policies, kinds))


_KINDS = {Static: "static", Dynamic: "dynamic", BatchGen: "batchgen"}


def _names(cluster: ClusterSimConfig) -> list[str]:
    return [f"sim-worker-{i:04d}" for i in range(cluster.workers)]


def _simulate_here(workload: Workload, cost: CostModel, engine: EngineSimConfig, policy: Policy,
                   cluster: ClusterSimConfig, keep_timelines: bool) -> SimResult:
    t0 = time.perf_counter()
    orders = moved = 0
    names = _names(cluster)
    if isinstance(policy, Dynamic):
        batches: deque[np.ndarray] = deque(np.array_split(np.arange(workload.rows),
                                                          math.ceil(workload.rows / policy.batch_rows)))
        engines = [SimEngine(name, cost, engine) for name in names]
        _run_ticks(engines, cluster, lambda now: _deal(engines, batches, workload, now), lambda: bool(batches))
    else:
        engines = partitioned_engines(names, np.array_split(np.arange(workload.rows), cluster.workers), workload,
                                      cost, engine)
        if isinstance(policy, Static):
            for e in engines:
                e.sealed = True
                e.run_until(math.inf)
        else:
            balancer = _Balancer(engines, policy, cluster)
            _run_ticks(engines, cluster, balancer.tick, lambda: False)
            orders, moved = balancer.orders, balancer.moved
    per_engine = [(len(e.finished), max((t for _, t in e.finished), default=0.0), len(e.errors), e.busy_s,
                   tuple(e.timeline) if keep_timelines else ()) for e in engines]
    return _result(policy, cluster, workload, per_engine, orders, moved, t0, keep_timelines)


def _result(policy: Policy, cluster: ClusterSimConfig, workload: Workload, per_engine: list[EngineResult],
            orders: int, moved: int, t0: float, keep_timelines: bool) -> SimResult:
    done, failed = sum(r[0] for r in per_engine), sum(r[2] for r in per_engine)
    if done + failed != workload.rows:
        raise AssertionError(f"{policy.name}: {done} rows finished and {failed} failed of {workload.rows}")
    bct = max((r[1] for r in per_engine if r[0]), default=0.0)
    return SimResult(policy.name, cluster.workers, bct, tuple(min(r[3], bct) for r in per_engine), done, failed,
                     orders, moved, time.perf_counter() - t0, tuple(r[4] for r in per_engine) if keep_timelines else ())


def _run_ticks(engines: list[SimEngine], cluster: ClusterSimConfig, act: Callable[[float], None],
               pending: Callable[[], bool]) -> None:
    now = 0.0
    while True:
        act(now)
        if not pending() and not any(e.has_work for e in engines):
            return
        now += cluster.tick_s
        for e in engines:
            e.run_until(now)


def _deal(engines: list[SimEngine], batches: deque[np.ndarray], workload: Workload, now: float) -> None:
    if engines[0].sealed:
        return
    given = deal([e.occupancy() for e in engines], batches, engines[0].config.max_num_seqs)
    for e, mine in zip(engines, given):
        for batch in mine:
            for seq in rows_as_sequences(workload, batch):
                e.add(seq, now)
    if not batches:  # every row dealt: nothing more comes to any engine
        for e in engines:
            e.sealed = True


class _Balancer:
    """BalancePlugin's loop on the simulated clock. Every worker pushes its load once a tick; as
    in `handle_load`, each push plans over every fresh view not in cooldown with the real
    plan_migrations and carries out the orders whose source is the pusher, which puts source and
    destination in cooldown. The plan depends only on those views, so it is recomputed only after
    an order changed them (the same answer as planning on every push). `engines` is None when
    the engines live in other processes (parallel.py): `tick` then gets their loads and hands
    each order to `carry`."""

    def __init__(self, engines: list[SimEngine] | None, policy: BatchGen, cluster: ClusterSimConfig,
                 names: list[str] | None = None) -> None:
        self.engines = {e.name: e for e in engines} if engines is not None else {}
        self.names = [e.name for e in engines] if engines is not None else list(names or ())
        self.policy, self.cluster = policy, cluster
        self.cooldown_until = {name: 0.0 for name in self.names}
        self.orders = self.moved = 0

    def tick(self, now: float, loads: dict[str, EngineLoad] | None = None,
             carry: Callable[[Migration, float], None] | None = None) -> None:
        if not self.policy.balance.enabled:
            return
        if loads is None:
            loads = {name: e.load() for name, e in self.engines.items()}
        carry = carry or self._carry_out
        plan = None
        for pusher in self.names:
            if plan is None:
                fresh = [load for name, load in loads.items() if self.cooldown_until[name] <= now]
                # every partition was dealt at the start (Dask starts them all: tasks secede): none arriving
                plan = plan_migrations(fresh, self.policy.balance, arriving=False)
            mine = [o for o in plan if o.src == pusher]
            for order in mine:
                carry(order, now)
                self.orders += 1
                self.cooldown_until[order.src] = self.cooldown_until[order.dst] = now + self.cluster.cooldown_s
            if mine:
                plan = None

    def _carry_out(self, order: Migration, now: float) -> None:
        src, dst = self.engines[order.src], self.engines[order.dst]
        for seq, kv_tokens in src.suspend(order.seq_ids):
            dst.arrive(Arrival(max(now, src.now) + src.transfer_seconds(kv_tokens), seq, kv_tokens))
            self.moved += 1
