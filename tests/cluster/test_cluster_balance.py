"""The balancing policy alone: loads in, orders out. No torch, no model, no cluster."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from batchgen.policy.balance import BalanceConfig, CoroutineInfo, EngineLoad, Migration, plan_migrations

M = "model"


def load(worker: str, coroutines: list[tuple[int, int, int]], *, ready: bool = True, kv_used: float = 0.0,
         model: str = M, speed: float = 0.0) -> EngineLoad:
    """coroutines: (seq_id, remaining, num_computed)."""
    infos = tuple(CoroutineInfo(s, r, c) for s, r, c in coroutines)
    return EngineLoad(worker, model, ready, sum(c == 0 for _, _, c in coroutines),
                      sum(c > 0 for _, _, c in coroutines), sum(r for _, r, _ in coroutines), kv_used, 0.0, infos,
                      speed)


def moved_tokens(orders: list[Migration]) -> int:
    return sum(o.tokens for o in orders)


def test_module_is_pure() -> None:
    tree = ast.parse(Path(__file__).parents[2].joinpath("batchgen/policy/balance.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "collections", "dataclasses", "heapq"}, imported  # the standard library only


def test_reported_rows_are_the_sorted_report_and_made_only_for_those_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    import batchgen.policy.balance as balance
    from batchgen.policy.balance import CoroutineInfo, reported_movable, reported_movable_rows

    rng = random.Random(0)
    rows = [(i, rng.choice([5, 9, 9, 30]), rng.choice([0, 0, 3])) for i in range(1000)]  # many ties
    want = tuple(sorted((CoroutineInfo(*r) for r in rows), key=lambda c: (c.is_started, -c.remaining))[:256])
    assert reported_movable_rows(rows) == want == reported_movable(CoroutineInfo(*r) for r in rows)
    assert reported_movable_rows(rows[:10], limit=256) == tuple(sorted((CoroutineInfo(*r) for r in rows[:10]),
                                                                     key=lambda c: (c.is_started, -c.remaining)))
    made: list[int] = []

    class Counted(CoroutineInfo):
        __slots__ = ()

        def __init__(self, *args: int) -> None:
            made.append(1)
            super().__init__(*args)
    monkeypatch.setattr(balance, "CoroutineInfo", Counted)
    assert len(reported_movable_rows(rows, limit=7)) == 7 and len(made) == 7  # not one per row


def test_balanced_cluster_gets_no_orders() -> None:
    a = load("a", [(i, 50, 10) for i in range(4)])
    b = load("b", [(i, 50, 10) for i in range(4)])
    assert plan_migrations([a, b]) == []


def test_long_tail_moves_half_to_the_idle_worker() -> None:
    a = load("a", [(i, 100, 40) for i in range(6)])
    b = load("b", [])
    [order] = plan_migrations([a, b])
    assert (order.src, order.dst, order.model, order.reason) == ("a", "b", M, "migrate")
    assert len(order.seq_ids) == 3 and order.tokens == 300


def test_unstarted_coroutines_move_first_as_a_split() -> None:
    running = [(i, 80, 30) for i in range(4)]
    waiting = [(10 + i, 80, 0) for i in range(4)]
    [order] = plan_migrations([load("a", running + waiting), load("b", [])])
    assert order.reason == "split"
    assert set(order.seq_ids) == {10, 11, 12, 13}


def test_never_moves_past_half_the_gap() -> None:
    a = load("a", [(0, 90, 5), (1, 50, 5), (2, 30, 5), (3, 7, 5)])  # 177 tokens
    [order] = plan_migrations([a, load("b", [])])
    assert order.tokens <= 177 / 2
    assert order.tokens == 87  # 50 + 30 + 7: largest first that fit


def test_a_lone_coroutine_is_not_split() -> None:
    assert plan_migrations([load("a", [(0, 500, 100)]), load("b", [])]) == []


@pytest.mark.parametrize("remaining", [1, 3])
def test_nearly_done_coroutines_stay(remaining: int) -> None:
    a = load("a", [(i, remaining, 10) for i in range(40)])
    assert plan_migrations([a, load("b", [])], BalanceConfig(min_move_tokens=1)) == []


def test_small_imbalance_is_left_alone() -> None:
    a = load("a", [(i, 10, 5) for i in range(5)])  # 50
    b = load("b", [(i, 10, 5) for i in range(4)])  # 40: gap under 2 * min_move_tokens
    assert plan_migrations([a, b]) == []
    ratio = BalanceConfig(min_move_tokens=1, imbalance_ratio=2.0)
    assert plan_migrations([load("a", [(i, 10, 5) for i in range(15)]), load("b", [(0, 10, 5)] * 10)], ratio) == []


def test_switches_off() -> None:
    loads = [load("a", [(i, 100, 0) for i in range(4)] + [(9, 100, 50), (8, 100, 50)]), load("b", [])]
    assert plan_migrations(loads, BalanceConfig(split=False, migrate=False)) == []
    [order] = plan_migrations(loads, BalanceConfig(split=False))
    assert set(order.seq_ids) <= {8, 9}
    [order] = plan_migrations(loads, BalanceConfig(migrate=False))
    assert set(order.seq_ids) <= {0, 1, 2, 3} and order.reason == "split"


def test_running_coroutines_wait_for_the_tail_while_tasks_arrive() -> None:
    loads = [load("a", [(i, 100, 0) for i in range(4)] + [(9, 100, 50), (8, 100, 50)]), load("b", [])]
    [order] = plan_migrations(loads, arriving=True)
    assert set(order.seq_ids) <= {0, 1, 2, 3} and order.reason == "split"
    running_only = [load("a", [(i, 100, 50) for i in range(6)]), load("b", [])]
    assert plan_migrations(running_only, arriving=True) == []
    assert plan_migrations(running_only, BalanceConfig(tail_only=False), arriving=True) != []


def test_full_destination_takes_nothing() -> None:
    a = load("a", [(i, 100, 10) for i in range(6)])
    assert plan_migrations([a, load("b", [], kv_used=0.95)]) == []


def test_orders_of_one_round_do_not_fill_the_destinations_pool() -> None:
    # 12 x 100 tokens to move; b's pool holds 2000 tokens at 50% use: room for (0.9 - 0.5) * 2000 =
    # 800 tokens of KV, i.e. 5 started coroutines arriving with 150 computed each (the KV they bring;
    # what they still generate is admitted as it comes, like any running row)
    a = load("a", [(i, 50, 150) for i in range(24)])
    full = dataclasses.replace(load("b", [], kv_used=0.5), kv_capacity_tokens=2000)
    orders = plan_migrations([a, full], BalanceConfig(max_orders=8))
    assert sum(len(o.seq_ids) for o in orders) == 5
    assert all(o.dst == "b" for o in orders)
    # pool size not reported: only the reported use counts, and half the gap moves
    unknown = plan_migrations([a, load("b", [], kv_used=0.5)], BalanceConfig(max_orders=8))
    assert sum(len(o.seq_ids) for o in unknown) == 12
    # a second destination takes what the first has no room for
    spread = plan_migrations([a, full, dataclasses.replace(load("c", []), kv_capacity_tokens=100_000)])
    assert {o.dst for o in spread} == {"b", "c"}
    assert sum(len(o.seq_ids) for o in spread if o.dst == "b") <= 5


def test_cold_worker_only_for_big_work() -> None:
    a = load("a", [(i, 100, 0) for i in range(6)])
    cold = EngineLoad("b", M, ready=False)
    assert plan_migrations([a, cold]) == []
    [order] = plan_migrations([a, cold], BalanceConfig(cold_start_tokens=500))
    assert order.dst == "b"


def test_spreads_over_several_idle_workers_and_models_stay_apart() -> None:
    a = load("a", [(i, 100, 0) for i in range(12)])
    others = [load(w, []) for w in ("b", "c", "d")]
    other_model = load("e", [], model="other")
    orders = plan_migrations([a, *others, other_model])
    assert {o.dst for o in orders} == {"b", "c", "d"}
    assert all(o.src == "a" and o.model == M for o in orders)
    assert len({s for o in orders for s in o.seq_ids}) == sum(len(o.seq_ids) for o in orders)  # no seq twice
    assert 12 * 100 - moved_tokens(orders) >= 200  # the source keeps its share


def test_recompute_cost_counts_against_running_coroutines() -> None:
    # equal remaining; the one with more KV to recompute is moved last
    a = load("a", [(0, 60, 500), (1, 60, 10), (2, 60, 10), (3, 60, 10)])
    [order] = plan_migrations([a, load("b", [])], BalanceConfig(recompute_weight=0.1))
    assert 0 not in order.seq_ids


def test_bad_config_is_named() -> None:
    with pytest.raises(ValueError, match="imbalance_ratio"):
        BalanceConfig(imbalance_ratio=0.5)
    with pytest.raises(ValueError, match="max_kv_used"):
        BalanceConfig(max_kv_used=2.0)


def test_a_faster_engine_gets_its_share_of_the_work() -> None:
    work = [(i, 10, 0) for i in range(100)]  # 1000 tokens, none started
    [order] = plan_migrations([load("slow", work, speed=100.0), load("fast", [], speed=300.0)])
    assert (order.src, order.dst) == ("slow", "fast")
    assert order.tokens == 750  # both then finish in 2.5 s: 250 / 100 == 750 / 300


def test_equal_work_moves_from_the_slower_engine() -> None:
    slow = load("a", [(i, 10, 0) for i in range(40)], speed=100.0)
    fast = load("b", [(100 + i, 10, 0) for i in range(40)], speed=400.0)
    [order] = plan_migrations([slow, fast])
    assert (order.src, order.dst) == ("a", "b") and order.tokens == 240  # then 160 / 100 == 640 / 400
    unmeasured = load("b", [(100 + i, 10, 0) for i in range(40)])  # one speed known: nothing to compare
    assert plan_migrations([slow, unmeasured]) == []


def test_speeds_within_tolerance_count_as_equal() -> None:
    a = load("a", [(i, 100, 40) for i in range(6)], speed=100.0)
    b = load("b", [], speed=120.0)  # measured on other rows: not a faster device
    [order] = plan_migrations([a, b])
    assert order.tokens == 300
    unmeasured = load("c", [])
    assert plan_migrations([a, unmeasured]) == plan_migrations([load("a", [(i, 100, 40) for i in range(6)]),
                                                                load("c", [])])
    with pytest.raises(ValueError, match="speed_tolerance"):
        BalanceConfig(speed_tolerance=0.5)


def _sized(base: EngineLoad, kv_capacity_tokens: int, max_num_seqs: int) -> EngineLoad:
    return EngineLoad(base.worker, base.model, base.ready, base.waiting, base.running, base.remaining_tokens,
                      base.kv_used, base.tokens_per_s, base.movable, base.speed, kv_capacity_tokens, max_num_seqs)


def test_running_coroutines_move_only_into_the_kv_the_plan_leaves_free() -> None:
    """Two idle destinations of 1000 free KV tokens each (below max_kv_used 0.9 of 2000, half
    used): orders planned in one round count against them, so no destination is sent more
    started KV than it holds free, and what does not fit stays put."""
    src = load("a", [(i, 400, 300) for i in range(12)])  # 12 x 300 KV tokens, 4800 to generate
    dsts = [_sized(load(name, [], kv_used=0.4), 2000, 64) for name in ("b", "c")]
    orders = plan_migrations([_sized(src, 8000, 64)] + dsts)
    kv_in: dict[str, int] = {}
    for o in orders:
        kv_in[o.dst] = kv_in.get(o.dst, 0) + 300 * len(o.seq_ids)
    assert orders and all(v <= 0.5 * 2000 for v in kv_in.values()), kv_in
    unsized = plan_migrations([src, load("b", [], kv_used=0.4), load("c", [], kv_used=0.4)])
    assert sum(len(o.seq_ids) for o in unsized) > sum(len(o.seq_ids) for o in orders)  # pool unknown: old rule


def test_running_coroutines_need_free_seats_and_no_queue_at_the_destination() -> None:
    src = _sized(load("a", [(i, 400, 30) for i in range(8)]), 10**6, 64)
    full = _sized(load("b", [(100 + i, 5, 10) for i in range(62)]), 10**6, 64)  # 2 seats free
    [order] = plan_migrations([src, full])
    assert len(order.seq_ids) == 2
    queued = load("b", [(100, 50, 0)])  # a row waiting for a seat there: running ones would park behind it
    assert plan_migrations([src, _sized(queued, 10**6, 64)]) == []
    # not-started coroutines still split onto a destination with a queue
    fresh = _sized(load("a", [(i, 400, 0) for i in range(8)]), 10**6, 64)
    [split] = plan_migrations([fresh, _sized(queued, 10**6, 64)])
    assert split.reason == "split"


def _plan_model_reference(loads: list[EngineLoad], config: BalanceConfig, budget: int) -> list[Migration]:
    """The planning loop before it stopped at the first source not worth moving from: it tried
    every source in turn (O(workers^2) a plan). The loop now must give the same orders."""
    from batchgen.policy import balance as b

    loads = sorted(loads, key=lambda x: x.worker)
    nodes = [b._Node(load, load.remaining_tokens / speed, speed, queued=load.waiting)
             for load, speed in zip(loads, b.relative_speeds(loads, config.speed_tolerance))]
    orders: list[Migration] = []
    exhausted: set[str] = set()
    while len(orders) < budget:
        sources = [n for n in nodes if n.load.ready and n.load.worker not in exhausted and n.load.movable]
        if not sources:
            break
        src = max(sources, key=lambda n: n.work)
        dst = b._pick_destination(nodes, src, config)
        if dst is None or not b._worth_moving(src.work, dst.work, config):
            exhausted.add(src.load.worker)
            continue
        target = src.speed * dst.speed * (src.work - dst.work) / (src.speed + dst.speed)
        picked, tokens, cost = b._pick(src, target, config, *dst.room(config))
        if tokens < config.min_move_tokens or not picked:
            exhausted.add(src.load.worker)
            continue
        src.taken.update(c.seq_id for c in picked)
        src.work -= tokens / src.speed
        dst.work += (tokens + cost) / dst.speed
        dst.kv_incoming += sum(c.num_computed for c in picked)
        dst.queued += sum(not c.is_started for c in picked)
        dst.seats_incoming += sum(c.is_started for c in picked)
        reason = "migrate" if any(c.is_started for c in picked) else "split"
        orders.append(Migration(src.load.worker, dst.load.worker, src.load.model,
                                tuple(c.seq_id for c in picked), tokens, reason))
    return orders


def test_planning_stops_early_with_the_same_orders_as_trying_every_source() -> None:
    import random

    from batchgen.policy.balance import _plan_model

    rng = random.Random(7)
    for case in range(300):
        loads = []
        for w in range(rng.randint(2, 12)):
            rows = [(w * 1000 + i, rng.choice([3, 40, 400, 4000]), rng.choice([0, 0, 50, 900]))
                    for i in range(rng.randint(0, 10))]
            base = load(f"w{w:02d}", rows, ready=rng.random() > 0.1, kv_used=rng.choice([0.0, 0.5, 0.95]),
                        speed=rng.choice([0.0, 100.0, 300.0]))
            loads.append(dataclasses.replace(base, kv_capacity_tokens=rng.choice([0, 5000]),
                                             max_num_seqs=rng.choice([0, 4, 64]),
                                             device=rng.choice(["", "gpu"]) if case % 2 else "gpu"))
        config = BalanceConfig(imbalance_ratio=rng.choice([1.0, 1.5, 3.0]), max_orders=rng.choice([1, 8]))
        assert _plan_model(loads, config, config.max_orders) == _plan_model_reference(loads, config, config.max_orders)
