"""The MoA expert stage on simulated GPUs: `place` decides, batchgen/sim's engine runs the rows.

Every (worker, model) the placement fills is one simulated engine (sim/engine.py: the runtime's
own Scheduler on simulated state, the roofline cost of that model's shapes on the GPU profile)
running the rows the placement gave it; a worker runs its models one after another, each paying
its load time, so its expert-stage time is the sum, and the stage ends with the slowest worker.
The placement sees what offline profiling gives (MOSAIC's input): each model's mean output
length (not each row's) and its seconds per token, measured on the simulator from a sample run
alone on one simulated GPU. Every figure here is simulated.

Not modelled: models sharing a GPU share its KV memory (each simulated engine gets the whole
pool); no migration between a model's replicas (the placement's split is what runs).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..policy.placement import Demand, ModelCost, Placement, PlacementError, Policy, WorkerSlot, place


@dataclass(frozen=True, slots=True)
class SimModel:
    """One proposer: model shapes (a shipped name or a directory), its workload, its load time."""

    shape: str
    workload: str  # batchgen.sim.workload.WORKLOADS name
    load_s: float = 30.0
    max_tokens: int | None = None  # cap the workload's outputs (e.g. a shorter reasoning budget)


@dataclass(frozen=True, slots=True)
class SimStage:
    placement: Placement
    makespan_s: float  # simulated
    worker_s: dict[str, float]


def simulate_expert_stage(models: Mapping[str, SimModel], rows_per_model: Mapping[str, int], workers: int,
                          profile: str = "H200", policies: tuple[Policy, ...] = ("ilp", "round_robin", "data_parallel"),
                          seed: int = 0, sample_rows: int = 256) -> dict[str, SimStage]:
    from ..sim.cluster import ClusterSimConfig, simulate
    from ..sim.cost import build_cost
    from ..sim.engine_config import EngineSimConfig
    from ..sim.policies import Static
    from ..sim.profiles import load_profile
    from ..sim.shapes import load_shape
    from ..sim.workload import Workload, synthetic

    missing = sorted(set(models) - set(rows_per_model))
    if missing or any(n < 0 for n in rows_per_model.values()):
        raise PlacementError(f"rows_per_model needs a count >= 0 for every model; missing {missing}, "
                             f"given {dict(rows_per_model)}")
    gpu = load_profile(profile)
    engine = EngineSimConfig()
    loads, costs, demand = {}, {}, {}
    for k, (name, m) in enumerate(sorted(models.items())):
        if rows_per_model[name] == 0:  # no rows routed to it: not placed, as in place()
            continue
        shape = load_shape(m.shape)
        cost = build_cost(gpu, shape)
        w = synthetic(m.workload, rows_per_model[name], seed=seed + k)
        if m.max_tokens is not None:
            out = np.minimum(w.output_len, m.max_tokens)
            w = Workload(w.name, w.prompt_len, out, np.minimum(w.max_tokens, m.max_tokens))
        loads[name] = (w, cost)
        sample = w.head(min(sample_rows, w.rows))
        alone = simulate(sample, cost, engine, Static(), ClusterSimConfig(1))
        costs[name] = ModelCost(alone.bct_s / max(1, sample.output_tokens), m.load_s, shape.weight_bytes)
        mean = float(w.output_len.mean())
        demand[name] = Demand(tuple(range(w.rows)), (mean,) * w.rows)
    slots = [WorkerSlot(f"gpu{i}", gpu.memory_bytes * getattr(gpu, "memory_utilization", 0.9))
             for i in range(workers)]
    out: dict[str, SimStage] = {}
    for policy in policies:
        try:
            p = place(demand, costs, slots, policy)
        except PlacementError:  # e.g. data_parallel where the models do not fit one GPU together
            continue
        worker_s = {s.name: 0.0 for s in slots}
        for worker, by_model in p.rows.items():
            for name, rows in by_model.items():
                w, cost = loads[name]
                part = w.take(np.asarray(rows, dtype=np.int64))
                worker_s[worker] += models[name].load_s + simulate(part, cost, engine, Static(),
                                                                   ClusterSimConfig(1)).bct_s
        out[policy] = SimStage(p, max(worker_s.values()), worker_s)
    return out
