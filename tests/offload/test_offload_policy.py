"""The torch-free expert-tier policies: tier sizes, routing statistics, eviction choices."""
from __future__ import annotations

import subprocess
import sys

import pytest

from batchgen.policy.expert_eviction import (
    BudgetError,
    RoutingStats,
    layers_ahead,
    next_moe_layer,
    pick_victims,
    plan_tiers,
)

E_BYTES, TOTAL, WIDEST = 100, 24, 8  # 3 MoE layers of 8 experts, 100 bytes each


def test_budgets_become_tiers() -> None:
    assert plan_tiers(E_BYTES, TOTAL, WIDEST, None, None, device_is_host=True) is None
    assert plan_tiers(E_BYTES, TOTAL, WIDEST, 10_000, 10_000, device_is_host=False) is None  # everything fits
    device_only = plan_tiers(E_BYTES, TOTAL, WIDEST, 850, None, device_is_host=False)
    assert (device_only.device_slots, device_only.host_slots, device_only.from_disk) == (8, None, False)
    cpu_host_only = plan_tiers(E_BYTES, TOTAL, WIDEST, None, 1000, device_is_host=True)
    assert (cpu_host_only.device_slots, cpu_host_only.host_slots, cpu_host_only.shared) == (10, 10, True)
    with pytest.raises(BudgetError, match="expert_host_memory_bytes on an accelerator needs expert_memory_bytes too"):
        plan_tiers(E_BYTES, TOTAL, WIDEST, None, 1000, device_is_host=False)
    gpu_both = plan_tiers(E_BYTES, TOTAL, WIDEST, 900, 1000, device_is_host=False)
    assert (gpu_both.device_slots, gpu_both.host_slots, gpu_both.shared) == (9, 10, False)
    three = plan_tiers(E_BYTES, TOTAL, WIDEST, 800, 1200, device_is_host=True)
    assert (three.device_slots, three.host_slots, three.shared, three.from_disk) == (8, 12, False, True)
    with pytest.raises(BudgetError, match=r"expert_host_memory_bytes=799 cannot hold one MoE layer's 8 experts "
                                          r"\(at least 800 bytes; all routed experts take 2400\)"):
        plan_tiers(E_BYTES, TOTAL, WIDEST, None, 799, device_is_host=True)


def test_layers_ahead_counts_stages_until_a_layer_runs_again() -> None:
    # positions 0..3; the stage at 1 just ran: 2 is next, the current layer last
    assert [layers_ahead(p, 1, 4) for p in range(4)] == [3, 4, 1, 2]
    assert next_moe_layer(5, [1, 3, 5]) == 1 and next_moe_layer(1, [1, 3, 5]) == 3


def test_layer_order_evicts_the_layer_that_runs_furthest_ahead_lru_within() -> None:
    positions = {1: 0, 3: 1, 5: 2}
    residents = [(1, 0, 5), (1, 1, 2), (3, 0, 9), (5, 0, 1), (5, 1, 7)]
    # the stage of layer 3 runs now: 5 runs next, 1 after it, 3 itself last
    assert pick_victims(3, residents, 1, positions, "layer-order") == [(3, 0), (1, 1), (1, 0)]


def test_routing_eviction_keeps_a_hot_expert_over_a_cold_one_that_runs_sooner() -> None:
    positions = {1: 0, 3: 1, 5: 2}
    stats = RoutingStats(decay=0.5)
    for _ in range(6):
        stats.observe(5, 4, [0, 1])  # layer 5 needs experts 0 and 1 every time
        stats.observe(1, 4, [2])  # layer 1: mostly expert 2 ...
    stats.observe(1, 4, [0])  # ... expert 0 once
    residents = [(1, 0, 1), (5, 0, 1)]
    here = positions[3]  # layer 5 runs next (1 ahead), layer 1 after (2 ahead)
    assert pick_victims(1, residents, here, positions, "layer-order") == [(1, 0)]
    # after the layer-1 stage: layer 5 runs in 2 stages, layer 1 in 3; layer order evicts 1's expert
    # (runs last) either way; from layer 3's stage, routing weighs need per stage of distance
    assert pick_victims(1, [(1, 1, 1), (5, 0, 1)], positions[1], positions, "layer-order") == [(1, 1)]
    assert pick_victims(1, [(5, 0, 1), (1, 1, 1)], positions[1], positions, "routing", stats) == [(1, 1)]
    # a hot expert far ahead outlives a cold one close by under routing, not under layer order
    cold_near, hot_far = (5, 3, 1), (1, 2, 1)
    assert pick_victims(1, [cold_near, hot_far], here, positions, "layer-order") == [(1, 2)]
    assert pick_victims(1, [cold_near, hot_far], here, positions, "routing", stats) == [(5, 3)]
    with pytest.raises(BudgetError, match="need 3 expert slots but only 2 can be evicted"):
        pick_victims(3, [cold_near, hot_far], here, positions, "routing", stats)
    with pytest.raises(ValueError, match="unknown expert eviction"):
        pick_victims(1, [cold_near], here, positions, "random")


def test_routing_statistics_predict_what_a_layer_needs() -> None:
    stats = RoutingStats(decay=0.75)
    assert stats.predict(7) == []
    for _ in range(4):
        stats.observe(7, 6, [4, 1])
    stats.observe(7, 6, [4, 2])
    assert stats.predict(7) == [4, 1]  # two a stage, the most probable first
    assert stats.probability(7, 4) == pytest.approx(1 - 0.75 ** 5) and stats.probability(7, 5) == 0.0


def test_the_policy_module_imports_no_torch() -> None:
    code = "import sys, batchgen.policy.expert_eviction; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_auto_prefetch_reads_ahead_only_on_cuda() -> None:
    from batchgen.policy.expert_eviction import resolve_predictor

    assert resolve_predictor("auto", "cuda") == "router" and resolve_predictor("auto", "cpu") == "none"
    assert resolve_predictor("history", "cpu") == "history"
