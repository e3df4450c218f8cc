"""The simulated fleet over several processes gives the serial run's result exactly."""
from __future__ import annotations

import dataclasses

import pytest

from batchgen.errors import PlanError
from batchgen.sim.cluster import ClusterSimConfig, simulate, simulate_all
from batchgen.sim.cost import build_cost
from batchgen.sim.engine_config import EngineSimConfig
from batchgen.sim.policies import DEFAULT_POLICIES, BatchGen, Dynamic, Static
from batchgen.sim.profiles import load_profile
from batchgen.sim.shapes import load_shape
from batchgen.sim.workload import synthetic


def fields(result: object) -> dict:
    out = dataclasses.asdict(result)  # type: ignore[call-overload]
    out.pop("wall_s")
    return out


@pytest.mark.parametrize("policy", [BatchGen(), Static(), Dynamic()], ids=["batchgen", "static", "dynamic"])
def test_processes_change_nothing_but_the_wall_time(policy: object) -> None:
    cost = build_cost(load_profile("H200"), load_shape("qwen3-30b-a3b"))
    rows = synthetic("mixed", 1200, seed=3, order="grouped")  # skewed: the balancer moves coroutines
    serial = simulate(rows, cost, EngineSimConfig(), policy, ClusterSimConfig(5), keep_timelines=True)  # type: ignore[arg-type]
    spread = simulate(rows, cost, EngineSimConfig(), policy, ClusterSimConfig(5, processes=2),  # type: ignore[arg-type]
                      keep_timelines=True)
    assert fields(spread) == fields(serial)
    if isinstance(policy, BatchGen):
        assert serial.migrated_coroutines > 0 and serial.migration_orders > 0


def test_every_policy_at_once_is_each_alone() -> None:
    """run_plan's way: all policies in one set of processes, static's engines run while the
    children wait for the parent; each result is its serial run's."""
    cost = build_cost(load_profile("H200"), load_shape("qwen3-30b-a3b"))
    rows = synthetic("mixed", 1500, seed=4, order="grouped")
    together = simulate_all(rows, cost, EngineSimConfig(), DEFAULT_POLICIES, ClusterSimConfig(7, processes=3))
    alone = simulate_all(rows, cost, EngineSimConfig(), DEFAULT_POLICIES, ClusterSimConfig(7))
    assert [fields(r) for r in together] == [fields(r) for r in alone]
    assert [r.policy for r in together] == ["static", "dynamic", "batchgen"]


def test_processes_must_be_positive() -> None:
    with pytest.raises(PlanError, match="processes"):
        ClusterSimConfig(4, processes=0)
