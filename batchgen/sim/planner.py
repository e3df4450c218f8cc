"""`batchgen plan`'s engine: every policy on one workload, the ideal bound, a worker sweep."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .cluster import ClusterSimConfig, SimResult, simulate_all
from .cost import CostModel
from .engine_config import EngineSimConfig
from .policies import DEFAULT_POLICIES, Policy
from .workload import Workload


@dataclass(frozen=True, slots=True)
class IdealBound:
    """No placement beats either term: the work spread perfectly over all workers, each at its
    full-batch rate, and the longest row run alone (a row cannot be split). Rows that cannot fit
    one worker's KV pool fail under every policy and are left out of both terms."""

    work_s: float  # total work / workers
    longest_row_s: float

    @property
    def bct_s(self) -> float:
        return max(self.work_s, self.longest_row_s)


def decode_seconds_per_token(cost: CostModel, seats: int, capacity: int, ctx: np.ndarray) -> np.ndarray:
    """phi(ctx): seconds per generated token of a decode step whose rows read `ctx` context
    tokens on average, scaled up until it fills the seats or the KV pool: B = min(seats, pool / ctx)
    rows (seats: max_num_seqs, or the job's rows if fewer). Both cost models satisfy
    s(lam * x) <= lam * s(x) for lam >= 1 (fixed terms, terms linear in the step, experts touched
    concave through 0), so any real decode step of b rows at mean context ctx costs at least
    b * phi(ctx). (A calibrated profile's measured expert traffic is interpolated from its
    points and assumed to grow no faster than its tokens.)"""
    batch = np.minimum(float(seats), capacity / np.maximum(ctx, 1.0))
    kv = batch * ctx
    return np.asarray(cost.step_seconds(batch, batch, kv, kv), dtype=np.float64) / batch


def _lower_convex_hull_at(x: np.ndarray, y: np.ndarray, at: float) -> float:
    """The lower convex envelope of the points (x, y) (x ascending) evaluated at `at` in [x0, x-1]."""
    left, right = x <= at, x >= at
    xl, yl, xr, yr = x[left][:, None], y[left][:, None], x[right][None, :], y[right][None, :]
    span = np.where(xr > xl, xr - xl, 1.0)
    value = np.where(xr > xl, yl + (yr - yl) * (at - xl) / span, np.minimum(yl, yr))
    return float(value.min())


def ideal_bound(workload: Workload, cost: CostModel, engine: EngineSimConfig, workers: int) -> IdealBound:
    capacity = cost.kv_capacity_tokens // engine.block_size * engine.block_size
    p, o = workload.prompt_len.astype(np.float64), workload.output_len.astype(np.float64)
    fits = p + o <= capacity  # a row past the pool errors under every policy
    p, o = p[fits], o[fits]
    if not len(p):
        return IdealBound(0.0, 0.0)
    ctx = float((o * (p + o / 2)).sum() / o.sum())  # mean context a generated token attends to
    # Decode: a step's per-token cost is at least phi(its mean context) (decode_seconds_per_token),
    # phi is not convex where the pool binds (a step mixing short and long rows amortizes the
    # weights and experts over more rows), so the bound is its lower convex envelope at the mean
    # context of all generated tokens (Jensen over the steps, weighted by their rows).
    grid = np.unique(np.concatenate([np.geomspace(max(1.0, float(p.min())), max(float((p + o).max()), 2.0), 384),
                                     [ctx]]))
    seats = min(engine.max_num_seqs, len(p))  # a step holds no more rows than the job has
    decode_s = o.sum() * _lower_convex_hull_at(grid, decode_seconds_per_token(cost, seats, capacity, grid), ctx)
    # prefill tokens ride along the full decode batch: their cost is what they add to its step
    batch = max(1, min(seats, int(capacity // max(ctx, 1.0))))
    kv = batch * ctx
    step = float(cost.step_seconds(batch, batch, kv, kv))
    chunk = max(1, engine.max_num_batched_tokens - batch)
    mean_p = float(p.mean())
    added = float(cost.step_seconds(batch + chunk, batch + 1, kv + chunk, kv + chunk * (mean_p / 2))) - step
    prefill_s = p.sum() * max(added, 0.0) / chunk
    # the longest row alone: its prefill, then decode steps of one sequence at a growing context
    alone = cost.step_seconds(p, 1, p, p * (p + 1) / 2) + o * cost.step_seconds(1, 1, p + o / 2, p + o / 2)
    return IdealBound(float(decode_s + prefill_s) / workers, float(np.max(alone)))


@dataclass(frozen=True, slots=True)
class PlanReport:
    workers: int
    results: tuple[SimResult, ...]
    ideal: IdealBound

    def by_name(self, name: str) -> SimResult:
        return next(r for r in self.results if r.policy == name)

    def to_json(self) -> dict[str, Any]:
        return {"policies": {r.policy: {"bct_s": r.bct_s, "gpu_hours": r.gpu_hours, "utilization": r.utilization}
                             for r in self.results},
                "ideal_bct_s": self.ideal.bct_s}


def default_tick(ideal: IdealBound) -> float:
    """How often the simulated plugin looks. The real one plans on every push (0.2 s) and keeps a
    worker out for its 1 s cooldown after an order, so a tick of 1 s with one push per worker is
    its cadence. Jobs past ~8 minutes get at most ~500 ticks, so a plan stays minutes to compute:
    the balancer then acts less often than the plugin would (see README: on 1M rows, 500 ticks
    instead of 1000 moved the simulated BCT by 0.05%)."""
    return float(max(1.0, ideal.bct_s / 500))


def run_plan(workload: Workload, cost: CostModel, engine: EngineSimConfig, cluster: ClusterSimConfig,
             policies: tuple[Policy, ...] = DEFAULT_POLICIES, keep_timelines: bool = False,
             tick_s: float | None = None) -> PlanReport:
    """Every policy on `workload`, with the ideal bound. tick_s: how often the simulated
    plugin looks (None: `default_tick` for the job; the cluster's own tick_s is not used)."""
    ideal = ideal_bound(workload, cost, engine, cluster.workers)
    cluster = replace(cluster, tick_s=default_tick(ideal) if tick_s is None else tick_s)
    results = simulate_all(workload, cost, engine, policies, cluster, keep_timelines)
    return PlanReport(cluster.workers, results, ideal)


def format_report(report: PlanReport, title: str) -> str:
    lines = [f"{title}  [simulated]", f"{'policy':12} {'BCT':>12} {'GPU-hours':>10} {'utilization':>12} {'moved':>8}"]
    for r in report.results:
        lines.append(f"{r.policy:12} {_duration(r.bct_s):>12} {r.gpu_hours:10.2f} {r.utilization:12.1%} "
                     f"{r.migrated_coroutines:8d}")
    i = report.ideal
    lines.append(f"{'ideal':12} {_duration(i.bct_s):>12} {report.workers * i.bct_s / 3600:10.2f}   "
                 f"(work / workers {_duration(i.work_s)}, longest row alone {_duration(i.longest_row_s)})")
    names = {r.policy for r in report.results}
    if "batchgen" in names and report.by_name("batchgen").bct_s > 0 and i.bct_s > 0:
        b = report.by_name("batchgen").bct_s
        parts = [f"{report.by_name(n).bct_s / b:.2f}x over {n}" for n in ("static", "dynamic") if n in names]
        lines.append(f"batchgen speedup: {', '.join(parts) or '-'}; batchgen / ideal {b / i.bct_s:.3f}")
    if "length-aware" in names and i.bct_s > 0:
        la = report.by_name("length-aware").bct_s
        against = f"; length-aware / batchgen {la / report.by_name('batchgen').bct_s:.3f}" if "batchgen" in names else ""
        lines.append(f"length-aware / ideal {la / i.bct_s:.3f}{against}")
    warning = failed_rows_warning(report)
    if warning:
        lines.append(warning)
    return "\n".join(lines)


def failed_rows_warning(report: PlanReport) -> str:
    """'' when every row finished; else how many rows each policy failed (a row too long for one
    worker's KV pool errors, as the runtime's would, and the rest of the job goes on)."""
    failed = max(r.rows_failed for r in report.results)
    if not failed:
        return ""
    per = ", ".join(f"{r.policy} {r.rows_failed}" for r in report.results)
    return (f"warning: rows that could never fit one worker's KV pool count as failed ({per}); "
            "the ideal bound leaves them out")


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"
