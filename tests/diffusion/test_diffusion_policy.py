"""policy/diffusion_step.py and diffusion_cost.py: torch-free decisions, no model."""
from __future__ import annotations

import subprocess
import sys

import pytest

from batchgen.policy.diffusion_cost import CostModel
from batchgen.policy.diffusion_step import TrajView, best_degree, plan_step, priority

COST = CostModel(fixed=1e-3, per_token=1e-5, per_attn=1e-7, per_comm_token=2e-6, comm_fixed=2e-3)


def _v(tid, remaining, tokens=16, rows=1, arrival=0.0, deadline=None, key=None):
    return TrajView(tid, key or ((4, 8, 8), rows == 2), tokens, rows, remaining, arrival, deadline)


def test_policy_modules_import_no_torch():
    code = ("import sys; import batchgen.policy.diffusion_step, batchgen.policy.diffusion_cost, batchgen.policy.diffusion_plan, "
            "batchgen.policy.diffusion_steal; assert 'torch' not in sys.modules")
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
    from batchgen.diffusion.distributed.calibrate import fit

    COST.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == COST
    truth = CostModel(fixed=2e-3, per_token=3e-6, per_attn=1e-8)
    samples = [(r * n, n, truth.step_time(r * n, n)) for r in (1, 2, 4) for n in (16, 64, 256)]
    got = fit(samples)
    assert got.fixed == pytest.approx(2e-3, rel=1e-6) and got.per_attn == pytest.approx(1e-8, rel=1e-6)


# ---- plan.plan_round: admissions, groups, degrees (pure) ----------------------------------------
# step time = 1 ms per image token / degree, + 20 ms per forward at degree > 1 (no fixed cost):
# a 64-token image takes 64 ms alone, 52 ms at degree 2; a 16-token one 16 ms.
SP_COST = CostModel(fixed=0.0, per_token=1e-3, per_attn=0.0, per_comm_token=0.0, comm_fixed=0.02)
BIG, SMALL = ((4, 16, 16),), ((4, 8, 8),)


def _placed(tid, group, remaining=10, tokens=64, key=BIG, rows=1):
    from batchgen.policy.diffusion_plan import Placed

    return Placed(TrajView(tid, key, tokens, rows, remaining, float(tid)), tuple(group))


def _state(running=(), waiting=(), ranks=(0, 1), degrees=(1, 2)):
    from batchgen.policy.diffusion_plan import ClusterState

    return ClusterState(tuple(ranks), tuple(running), tuple(waiting), 0.0, tuple(degrees))


def test_plan_spreads_a_large_image_over_an_idle_worker_and_not_over_a_busy_one():
    from batchgen.policy.diffusion_plan import plan_round

    alone = plan_round(_state([_placed(0, [0])]), "fcfs", SP_COST)
    assert alone.groups == {0: (0, 1)} and alone.est_round_s == pytest.approx(0.052)
    assert "(0,) -> (0, 1)" in alone.reasons[0]
    # worker 1 busy with a small image: degree 2 would make its round 68 ms > 64 ms at degree 1
    busy = plan_round(_state([_placed(0, [0, 1]), _placed(1, [1], tokens=16, key=SMALL)]), "fcfs", SP_COST)
    assert busy.groups == {0: (0,), 1: (1,)}
    assert [f.ranks for f in busy.forwards] == [(0,), (1,)]
    # the degree 2 -> 1 switch hands the trajectory to the member whose round it shortens
    assert "(0, 1) -> (0,)" in busy.reasons[0]


def test_plan_spreads_two_nearly_equal_stragglers_though_each_move_alone_barely_shortens_the_round():
    from batchgen.policy.diffusion_plan import plan_round

    # 64 ms and 62 ms alone on workers 0 and 1, workers 2 and 3 idle: spreading either alone
    # shortens the round by 2 ms (< the 5% switch gain), spreading both takes it to 52 ms
    running = [_placed(0, [0]), _placed(1, [1], tokens=62)]
    plan = plan_round(_state(running, ranks=(0, 1, 2, 3), degrees=(1, 2)), "fcfs", SP_COST)
    assert sorted(map(len, plan.groups.values())) == [2, 2] and set(plan.groups[0]) & set(plan.groups[1]) == set()
    assert plan.est_round_s == pytest.approx(0.052)


def test_plan_keeps_degree_1_where_the_all_to_all_costs_more_than_it_saves():
    from batchgen.policy.diffusion_plan import plan_round

    slow_comm = CostModel(fixed=0.0, per_token=1e-3, per_attn=0.0, per_comm_token=2e-3, comm_fixed=0.0)
    assert slow_comm.step_time(64, 64, 2) > slow_comm.step_time(64, 64, 1)
    assert plan_round(_state([_placed(0, [0])]), "fcfs", slow_comm).groups == {0: (0,)}
    # the model's heads allow degree 1 only: never spread
    assert plan_round(_state([_placed(0, [0])], degrees=(1,)), "fcfs", SP_COST).groups == {0: (0,)}


def test_plan_admits_in_policy_order_onto_the_shorter_round_within_slots():
    from batchgen.policy.diffusion_plan import ElasticOptions, plan_round

    waiting = [_v(5, 40, tokens=16, key=SMALL), _v(6, 2, tokens=16, key=SMALL), _v(7, 9, tokens=64, key=BIG)]
    plan = plan_round(_state([_placed(0, [0])], waiting), "srwf", SP_COST, ElasticOptions(max_running=2))
    # srwf: 6 (2 steps), 7, 5; 6 goes to the idle worker 1, 7 (64 ms) next to it rather than onto
    # worker 0's 64 ms; worker 1 is then full, so 5 joins worker 0
    assert plan.admit == {1: (6, 7), 0: (5,)}
    assert plan.groups == {0: (0,), 5: (0,), 6: (1,), 7: (1,)}
    assert sum(len(f.tids) for f in plan.forwards) == 4
    one = plan_round(_state([_placed(0, [0])], waiting), "fcfs", SP_COST, ElasticOptions(max_running=1))
    assert one.admit == {1: (5,)}


def test_plan_migrates_to_balance_and_orders_forwards_alike_for_every_member():
    from batchgen.policy.diffusion_plan import ElasticOptions, Forward, plan_round

    running = [_placed(i, [0], tokens=16, key=SMALL) for i in range(4)]
    plan = plan_round(_state(running), "fcfs", SP_COST)
    on = [sum(g[0] == r for g in plan.groups.values()) for r in (0, 1)]
    assert on == [2, 2] and plan.est_round_s == pytest.approx(0.032)
    assert len(plan.reasons) == 2
    # two large ones spread over both workers (one shared 84 ms forward + a small one's 16 ms) are
    # better one per worker (80 ms): no single move shows it, the search from degree 1 does
    two = plan_round(_state([_placed(0, [0, 1]), _placed(1, [0, 1]), _placed(2, [0], tokens=16, key=SMALL)]),
                     "fcfs", SP_COST)
    assert sorted(two.groups.values()) == [(0,), (0,), (1,)] and two.est_round_s == pytest.approx(0.08)
    # spread trajectories of one shape share a forward, after the degree-1 forwards
    shared = plan_round(_state([_placed(0, [0, 1]), _placed(1, [0, 1])]), "fcfs",
                        CostModel(fixed=0.05, per_token=1e-3, per_attn=0.0, per_comm_token=0.0, comm_fixed=0.0))
    assert shared.forwards == (Forward((0, 1), (0, 1)),)
    mixed = plan_round(_state([_placed(0, [0, 1]), _placed(2, [0], tokens=16, key=SMALL, remaining=1),
                               _placed(3, [1], tokens=16, key=SMALL, remaining=1)]), "fcfs", SP_COST)
    assert [len(f.ranks) for f in mixed.forwards] == sorted(len(f.ranks) for f in mixed.forwards)
    with pytest.raises(ValueError, match="max_running"):
        ElasticOptions(max_running=0)


def test_fit_comm_recovers_the_degree_terms_over_a_degree_1_fit():
    from batchgen.diffusion.distributed.calibrate import fit, fit_comm

    truth = CostModel(fixed=2e-3, per_token=3e-6, per_attn=1e-8, per_comm_token=4e-6, comm_fixed=5e-3)
    ones = [(r * n, n, truth.step_time(r * n, n)) for r in (1, 4) for n in (16, 64, 256)]
    twos = [(r * n, n, 2, truth.step_time(r * n, n, 2)) for r in (1, 4) for n in (16, 64, 256)]
    got = fit_comm(twos, fit(ones))
    assert got.comm_fixed == pytest.approx(5e-3, rel=1e-6) and got.per_comm_token == pytest.approx(4e-6, rel=1e-6)
    # degree 2 slower than degree 1 at every size (workers sharing a core): the fit says so, and
    # the policy keeps degree 1
    slow = [(bt, n, 2, 1.5 * truth.step_time(bt, n)) for bt, n, _ in ones]
    got = fit_comm(slow, fit(ones))
    assert all(got.step_time(bt, n, 2) > got.step_time(bt, n, 1) for bt, n, _ in ones)
    assert best_degree(256, got, free=2) == 1
    assert fit_comm([], truth) is truth


def test_measured_ratios_correct_the_cost_model_in_the_plan():
    from batchgen.policy.diffusion_plan import Measured, plan_round

    m = Measured(alpha=0.5)
    # big forwards on rank 0 took 4x the model; small ones on rank 1 as modelled
    m.update([(0, BIG, 1, 0.064, 0.256), (1, SMALL, 1, 0.016, 0.016)])
    assert m.scale[(BIG, 1)] == pytest.approx(4.0) and m.scale[(SMALL, 1)] == pytest.approx(1.0)
    assert m.speed == {0: pytest.approx(1.0), 1: pytest.approx(1.0)}
    assert m.overall == pytest.approx(0.5 * 1.0 + 0.5 * 0.272 / 0.08)  # 1 before, then 272 / 80 ms
    m.update([(0, BIG, 1, 0.064, 0.064)])
    assert m.scale[(BIG, 1)] == pytest.approx(2.5)
    # every degree-1 forward measured 3x the model: a large image's unmeasured degree 2 is not
    # taken at the model's word (52 ms against 192 ms) but at 3x too, and it stays at degree 1
    # on a cost model where degree 2 wins by less than that
    from batchgen.policy.diffusion_plan import ClusterState
    near = CostModel(fixed=0.0, per_token=1e-3, per_attn=0.0, per_comm_token=0.0, comm_fixed=0.02)
    state = ClusterState((0, 1), (_placed(0, [0]), _placed(1, [1], tokens=16, key=SMALL)), (), 0.0, (1, 2),
                         {(BIG, 1): 3.0, (SMALL, 1): 3.0})
    assert plan_round(state, "fcfs", near).groups[0] == (0, 1)  # 52 ms + 3 x 16 < 3 x 64: spread
    from dataclasses import replace as _replace
    assert plan_round(_replace(state, scale_default=3.0), "fcfs", near).groups[0] == (0,)
    # a worker slower at the same shape: the shape's scale takes the mean, the rank's speed the rest
    w = Measured(alpha=1.0)
    w.update([(0, SMALL, 1, 0.016, 0.016), (1, SMALL, 1, 0.016, 0.048), (0, BIG, 1, 0.064, 0.064)])
    # small: (16 + 48) / 32 ms -> scale 2; rank 0 then 80 ms real / 96 modelled, rank 1 48 / 32
    assert w.scale[(SMALL, 1)] == pytest.approx(2.0)
    assert w.speed[0] == pytest.approx(0.08 / 0.096) and w.speed[1] == pytest.approx(1.5)
    # four small ones: an even split by the model; rank 1 measured 3x slower gets fewer
    state = _state([_placed(i, [0], tokens=16, key=SMALL) for i in range(4)])
    even = plan_round(state, "fcfs", SP_COST)
    assert sorted(g[0] for g in even.groups.values()) == [0, 0, 1, 1]
    from dataclasses import replace
    slow1 = plan_round(replace(state, speed={0: 1.0, 1: 3.0}), "fcfs", SP_COST)
    assert sorted(g[0] for g in slow1.groups.values()) == [0, 0, 0, 1]


# ---- steal.py: dealing, handing over, whether a synchronised group pays (pure) -----------------
def test_deal_balances_the_estimate_and_keeps_priority_order():
    from batchgen.policy.diffusion_steal import deal, worker_time

    views = [_v(i, steps, tokens=tok, key=key) for i, (steps, tok, key) in
             enumerate([(40, 64, BIG), (10, 16, SMALL), (30, 64, BIG), (20, 16, SMALL), (5, 16, SMALL)])]
    lists = deal(views, [0, 1], "srwf", 0.0, SP_COST)
    assert sorted(lists[0] + lists[1]) == [0, 1, 2, 3, 4]
    rank = {v.tid: i for i, v in enumerate(priority(views, "srwf", 0.0, SP_COST))}
    for tids in lists.values():
        assert [rank[t] for t in tids] == sorted(rank[t] for t in tids)  # each list in srwf order
    # 1 ms per token-step: 2560 + 1920 of large, 160 + 320 + 80 of small; no split beats this one's 2.56 / 2.48 s
    t = [worker_time([views[i] for i in lists[r]], SP_COST) for r in (0, 1)]
    assert max(t) == pytest.approx(2.56)
    # a forward's fixed cost is paid once per shape and step: same-shape work packs together
    fixed = CostModel(fixed=0.01, per_token=0.0, per_attn=0.0)
    assert worker_time([_v(0, 10), _v(1, 4)], fixed) == pytest.approx(0.1)
    packed = deal([_v(0, 10, key=BIG), _v(1, 10, key=SMALL), _v(2, 8, key=BIG), _v(3, 8, key=SMALL)], [0, 1],
                  "fcfs", 0.0, fixed)
    assert sorted(map(sorted, packed.values())) == [[0, 2], [1, 3]]


def test_handover_moves_what_shortens_the_longer_worker():
    from batchgen.policy.diffusion_steal import handover, worker_time

    # two large ones of 30 steps on one worker: one moves; a third with one step left stays
    assert handover([_v(0, 30, tokens=64), _v(1, 30, tokens=64), _v(2, 0, tokens=64)], SP_COST) == (0,)
    # one trajectory alone: moving it saves nothing
    assert handover([_v(0, 30, tokens=64)], SP_COST) == ()
    # the long one of four goes, the short ones stay (1.92 s vs 3 x 0.16 s)
    assert handover([_v(0, 30, tokens=64), _v(1, 10), _v(2, 10), _v(3, 10)], SP_COST) == (0,)
    # under a cost of fixed time per forward and one forward per shape, moving one of a shape
    # saves only its extra steps; the only one of its shape takes its forwards with it
    fixed = CostModel(fixed=0.01, per_token=0.0, per_attn=0.0, packed=False)
    assert handover([_v(0, 30), _v(1, 29)], fixed) == ()
    assert handover([_v(0, 30), _v(1, 10, key=BIG)], fixed) == (0,)
    # packed (one forward a step for every shape): that move saves nothing, the owner still
    # steps 30 times; a worker's time is its longest trajectory's steps
    packed = CostModel(fixed=0.01, per_token=0.0, per_attn=0.0)
    assert handover([_v(0, 30), _v(1, 10, key=BIG)], packed) == ()
    assert worker_time([_v(0, 30), _v(1, 10, key=BIG)], packed) == pytest.approx(0.30)
    assert worker_time([_v(0, 30), _v(1, 10, key=BIG)], fixed) == pytest.approx(0.40)


def test_spread_plan_only_when_a_round_over_both_is_shorter():
    from batchgen.policy.diffusion_steal import spread_plan

    plan = spread_plan(1, 0, [_v(4, 20, tokens=64, key=BIG)], 0.0, (1, 2), "fcfs", SP_COST)
    assert plan is not None and plan.groups == {4: (1, 0)}  # the holder first
    assert spread_plan(1, 0, [_v(4, 20, tokens=64, key=BIG)], 0.0, (1,), "fcfs", SP_COST) is None  # heads: 1 only
    assert spread_plan(1, 0, [_v(4, 1, tokens=64, key=BIG)], 0.0, (1, 2), "fcfs", SP_COST) is None  # one step left
    slow_comm = CostModel(fixed=0.0, per_token=1e-3, per_attn=0.0, per_comm_token=2e-3, comm_fixed=0.0)
    assert spread_plan(1, 0, [_v(4, 20, tokens=64, key=BIG)], 0.0, (1, 2), "fcfs", slow_comm) is None
    # small images: 16 ms alone vs 28 ms spread
    assert spread_plan(1, 0, [_v(4, 20, tokens=16, key=SMALL)], 0.0, (1, 2), "fcfs", SP_COST) is None


def test_forwards_past_the_efficient_batch_are_split_and_priced_so():
    from batchgen.diffusion.distributed.calibrate import fit_cap
    from batchgen.policy.diffusion_step import split_forward

    capped = CostModel(fixed=1e-3, per_token=1e-5, per_attn=0.0, max_batch_tokens=256)
    # 5 guided 64-token trajectories = 640 tokens -> 3 forwards, pairs of rows kept together
    views = [_v(i, 5, tokens=64, rows=2, key=BIG) for i in range(5)]
    parts = split_forward(views, capped)
    assert sorted(map(len, parts)) == [1, 2, 2] and sorted(t for p in parts for t in p) == [0, 1, 2, 3, 4]
    assert plan_step(views, "fcfs", 0.0, capped) == parts
    assert capped.step_time(640, 64) == pytest.approx(3 * capped.step_time(640 / 3, 64))
    assert split_forward(views, COST) == [[0, 1, 2, 3, 4]] and COST.chunks(10**6) == 1
    # timed: time per token falls to 12 rows of 144 tokens, then rises by a fifth: cap 12 rows
    per_token = {1: 34e-6, 4: 18e-6, 8: 15.5e-6, 12: 15.3e-6, 16: 18.5e-6}
    samples = [(r * 144, 144, r * 144 * s) for r, s in per_token.items()] + [(16, 16, 2.5e-3), (256, 16, 6e-3)]
    assert fit_cap(samples) == 12 * 144
    assert fit_cap([x for x in samples if x[0] != 16 * 144]) is None  # nothing timed past the best


def test_packed_forwards_pay_one_fixed_cost_per_worker_step():
    from batchgen.policy.diffusion_plan import ClusterState, Placed, plan_round
    from batchgen.policy.diffusion_step import pack_forwards

    small, big = [_v(0, 5), _v(1, 5)], [_v(2, 5, tokens=64, key=BIG)]
    # one worker's step: both shapes in one forward, one fixed cost
    parts = [(32, 16), (64, 64)]
    assert COST.pack_time(parts) == pytest.approx(COST.step_time(32, 16) + COST.step_time(64, 64) - COST.fixed)
    unpacked = CostModel(fixed=1e-3, per_token=1e-5, per_attn=1e-7, packed=False)
    assert unpacked.pack_time(parts) == pytest.approx(unpacked.step_time(32, 16) + unpacked.step_time(64, 64))
    assert pack_forwards([small, big], COST) == [[0, 1]]
    # a pipeline that cannot pack gets the unpacked model; one that can keeps it
    assert not COST.packing(False).packed and COST.packing(True) is COST
    assert pack_forwards([small, big], unpacked) == [[0], [1]]
    # within max_batch_tokens: 32 + 64 tokens fit 100, a third forward of 64 does not
    capped = CostModel(fixed=1e-3, per_token=1e-5, per_attn=0.0, max_batch_tokens=100)
    assert pack_forwards([small, big, [_v(3, 5, tokens=64, key=SMALL)]], capped) == [[0, 1], [2]]
    # the elastic plan prices a worker's degree-1 forwards the same way
    state = ClusterState((0,), tuple(Placed(v, (0,)) for v in small + big), (), 0.0)
    for cost in (COST, unpacked):
        plan = plan_round(state, "fcfs", cost)
        assert plan.est_round_s == pytest.approx(cost.pack_time([(32, 16), (64, 64)]))
