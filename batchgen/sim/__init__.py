"""Cluster simulator: simulated engines and a simulated cluster that run the real policies.

    from batchgen.sim import plan
    report = plan(rows=100_000, workers=128, profile="H200", model="qwen3-30b-a3b")

The engines call runtime/policy.py (Scheduler.schedule, eviction, prefer_transfer) and the
cluster calls policy/balance.py (plan_migrations) on simulated state; a cost model (cost.py)
built from a GPU profile and a model's config.json, or fitted on this machine (calibrate.py),
turns each forward into seconds. Nothing here imports torch or Dask, except calibrate.py, which
runs the real engine. Every figure it prints is simulated.
"""
from __future__ import annotations

from pathlib import Path

from .cluster import ClusterSimConfig, SimResult, simulate
from .cost import ExpertTiers, build_cost
from .engine_config import EngineSimConfig
from .planner import PlanReport, run_plan
from .policies import BatchGen, Dynamic, Static
from .profiles import load_profile
from .shapes import load_shape
from .workload import Workload, load_lengths, synthetic

__all__ = ["BatchGen", "ClusterSimConfig", "Dynamic", "EngineSimConfig", "ExpertTiers", "PlanReport", "SimResult",
           "Static", "Workload", "build_cost", "load_lengths", "load_profile", "load_shape", "plan", "run_plan",
           "simulate", "synthetic"]


def plan(*, rows: int | None = None, workers: int, profile: str, model: str | None = "qwen3-30b-a3b",
         workload: str = "reasoning", lengths: str | Path | None = None, seed: int = 0,
         expert_memory_bytes: int | None = None, engine: EngineSimConfig | None = None) -> PlanReport:
    """The Python face of `batchgen plan`: the cost model from `profile` (a shipped GPU profile
    such as "H200", or a calibrated profile file) and `model`'s shapes, the workload (`workload`
    synthetic rows, or the rows of a `lengths` file, the first `rows` of them), every policy run
    on `workers` simulated workers (planner.run_plan)."""
    prof = load_profile(profile)
    shape = load_shape(model) if model is not None and prof.kind == "gpu" else None
    cost = build_cost(prof, shape, ExpertTiers(expert_memory_bytes))
    if lengths is not None:
        w = load_lengths(Path(lengths), Path(model) if model else None, workload, seed)
        w = w.head(rows) if rows else w
    else:
        w = synthetic(workload, rows or 0, seed)
    return run_plan(w, cost, engine or EngineSimConfig(), ClusterSimConfig(workers))
