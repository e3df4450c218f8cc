"""diffusion/policy.py and cost.py: torch-free decisions, no model."""
from __future__ import annotations

import subprocess
import sys

import pytest

from batchgen.diffusion.cost import CostModel
from batchgen.diffusion.policy import TrajView, best_degree, plan_step, priority

COST = CostModel(fixed=1e-3, per_token=1e-5, per_attn=1e-7, per_comm_token=2e-6, comm_fixed=2e-3)


def _v(tid, remaining, tokens=16, rows=1, arrival=0.0, deadline=None, key=None):
    return TrajView(tid, key or ((4, 8, 8), rows == 2), tokens, rows, remaining, arrival, deadline)


def test_policy_modules_import_no_torch():
    code = "import sys; import batchgen.diffusion.policy, batchgen.diffusion.cost; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fcfs_srwf_deadline_orders():
    views = [_v(0, 40, arrival=0.0), _v(1, 5, arrival=1.0), _v(2, 20, arrival=2.0, deadline=3.0),
             _v(3, 30, arrival=3.0, deadline=0.02)]
    assert [v.tid for v in priority(views, "fcfs", 0.0, COST)] == [0, 1, 2, 3]
    assert [v.tid for v in priority(views, "srwf", 0.0, COST)] == [1, 2, 3, 0]
    # 2 can still meet its deadline (slack first); 3 cannot (30 steps of ~1.2 ms > 0.02 s): after those without one
    assert [v.tid for v in priority(views, "deadline", 0.0, COST)] == [2, 0, 1, 3]
    with pytest.raises(ValueError, match="unknown diffusion policy 'lifo'"):
        priority(views, "lifo", 0.0, COST)


def test_plan_groups_by_key_within_budget():
    views = [_v(0, 9, rows=2), _v(1, 3), _v(2, 4, rows=2), _v(3, 2, tokens=64, key=((4, 16, 16), False)), _v(4, 1)]
    groups = plan_step(views, "srwf", 0.0, COST, max_rows=5)
    # srwf order 4,3,1,2,0 -> rows 1+1+1+2 = 5: tid 0 waits; one group per key
    assert sorted(map(sorted, groups)) == [[1, 4], [2], [3]]
    # fcfs under a 64-token budget: 0 (32) + 1 (16) + 4 (16); 2 and 3 would pass it
    assert plan_step(views, "fcfs", 0.0, COST, max_rows=64, max_tokens=64) == [[0], [1, 4]]


def test_plan_never_starves_a_large_single():
    # one trajectory bigger than the budget still runs alone
    assert plan_step([_v(0, 3, tokens=1024)], "fcfs", 0.0, COST, max_rows=1, max_tokens=10) == [[0]]


def test_best_degree_small_stays_large_spreads():
    assert best_degree(16, COST, free=4) == 1
    assert best_degree(4096, COST, free=4) == 4
    assert best_degree(4096, COST, free=4, max_degree=2) == 2


def test_cost_model_round_trip_and_fit(tmp_path):
    from batchgen.diffusion.calibrate import fit

    COST.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == COST
    truth = CostModel(fixed=2e-3, per_token=3e-6, per_attn=1e-8)
    samples = [(r * n, n, truth.step_time(r * n, n)) for r in (1, 2, 4) for n in (16, 64, 256)]
    got = fit(samples)
    assert got.fixed == pytest.approx(2e-3, rel=1e-6) and got.per_attn == pytest.approx(1e-8, rel=1e-6)
