"""Engines of one device class count as equally fast, whatever rows they ran.

A measured speed (generated tokens/s at capacity) follows an engine's rows as much as its
hardware: engines of one GPU type that had run long-prompt rows measured 8x below those that had
run reasoning rows, and the balancer sent them almost nothing (simulated below). Classes compare
by their engines' median speed; engines that report no class keep the tolerance rule."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from batchgen.config import EngineConfig
from batchgen.engine import device_class
from batchgen.policy.balance import CoroutineInfo, EngineLoad, plan_migrations, relative_speeds
from batchgen.sim.cluster import ClusterSimConfig, simulate
from batchgen.sim.cost import build_cost
from batchgen.sim.engine_config import EngineSimConfig
from batchgen.sim.oblivious import oblivious_bct
from batchgen.sim.policies import BatchGen
from batchgen.sim.profiles import load_profile
from batchgen.sim.shapes import load_shape
from batchgen.sim.workload import synthetic


def engine(worker: str, rows: int, speed: float, device: str = "") -> EngineLoad:
    movable = tuple(CoroutineInfo(i, 1000, 0) for i in range(rows))
    return EngineLoad(worker, "m", True, rows, 0, 1000 * rows, 0.0, 0.0, movable, speed, device=device)


def test_speeds_within_a_class_are_equal_and_classes_compare_by_median() -> None:
    same = [engine("a", 8, 1000.0, "gpu-x"), engine("b", 0, 125.0, "gpu-x")]
    assert relative_speeds(same, 1.3) == [1.0, 1.0]
    # without classes the 8x gap reads as a slower device, and b gets far less than half
    unclassed = [dataclasses.replace(e, device="") for e in same]
    assert relative_speeds(unclassed, 1.3)[1] < 0.5
    assert sum(o.tokens for o in plan_migrations(same)) == 4000
    assert sum(o.tokens for o in plan_migrations(unclassed)) < 2000
    mixed = [engine("a", 0, 100.0, "slow"), engine("b", 0, 900.0, "slow"), engine("c", 0, 120.0, "slow"),
             engine("d", 0, 250.0, "fast"), engine("e", 0, 0.0, "fast")]  # e: not measured, its class is
    speeds = relative_speeds(mixed, 1.3)
    assert speeds[0] == speeds[1] == speeds[2] and speeds[3] == speeds[4]
    assert speeds[3] / speeds[0] == pytest.approx(250.0 / 120.0)  # medians: 120 (not 900) against 250
    assert relative_speeds([engine("a", 0, 0.0, "x"), engine("b", 0, 500.0, "y")], 1.3) == [1.0, 1.0]


def test_device_class_names_what_sets_the_pace() -> None:
    plain = EngineConfig.from_kwargs()
    cpu = device_class(torch.device("cpu"), torch.float32, plain)
    assert cpu.startswith("cpu ") and "float32" in cpu
    assert device_class(torch.device("cpu"), torch.bfloat16, plain) != cpu
    offloaded = EngineConfig.from_kwargs(expert_host_memory_bytes=1 << 30)
    assert device_class(torch.device("cpu"), torch.float32, offloaded) != cpu


def test_a_fleet_of_equal_gpus_balances_a_file_grouped_by_source() -> None:
    """8 simulated H200s, a mixture whose reasoning rows come first (static gives them to two
    workers): batchgen lands within 5% of the length-oblivious estimate (it was 1.20x of it when
    the summarization workers' low measured speed made them look like slow devices)."""
    cost = build_cost(load_profile("H200"), load_shape("qwen3-30b-a3b"))
    rows = synthetic("mixed", 4000, seed=0, order="grouped")
    result = simulate(rows, cost, EngineSimConfig(), BatchGen(), ClusterSimConfig(8))
    estimate = oblivious_bct(rows, cost, EngineSimConfig(), 8)
    assert result.bct_s <= 1.05 * estimate, (result.bct_s, estimate)
