"""batchgen.moa.place: optimal against brute force, memory respected, clear errors, fallback."""
from __future__ import annotations

import itertools
import random
import time

import pytest

from batchgen.moa import Demand, ModelCost, PlacementError, WorkerSlot, place


def brute_force(demand: dict[str, Demand], costs: dict[str, ModelCost], workers: list[WorkerSlot]) -> float:
    """Every row -> worker assignment; a model is loaded where it has rows."""
    items = [(m, i) for m, d in demand.items() for i in range(len(d.rows))]
    best = float("inf")
    for choice in itertools.product(range(len(workers)), repeat=len(items)):
        held: list[set[str]] = [set() for _ in workers]
        work = [0.0] * len(workers)
        tokens: dict[tuple[int, str], list[float]] = {}
        for (m, i), w in zip(items, choice):
            held[w].add(m)
            work[w] += costs[m].seconds_per_row + demand[m].tokens[i] * costs[m].seconds_per_token
            tokens.setdefault((w, m), []).append(demand[m].tokens[i])
        for (w, m), ts in tokens.items():  # forwards: the longest row, or the batches the tokens fill
            work[w] += costs[m].seconds_per_step * max(max(ts), sum(ts) / costs[m].max_batch)
        if any(sum(costs[m].memory_bytes for m in h) > ws.memory_bytes for h, ws in zip(held, workers)):
            continue
        span = max(work[w] + sum(costs[m].load_s for m in held[w]) for w in range(len(workers)))
        best = min(best, span)
    return best


def check_valid(p, demand, costs, workers) -> None:
    where = p.worker_of()
    assert sorted(where) == sorted((m, r) for m, d in demand.items() for r in d.rows)  # every row once
    for w in workers:
        assert sum(costs[m].memory_bytes for m in p.rows[w.name]) <= w.memory_bytes
    for m, ws in p.replicas.items():
        assert set(ws) == {w for w, by in p.rows.items() if m in by}


def random_case(rng: random.Random, rows: int, per_row: bool = False) -> tuple[dict, dict, list]:
    n_models, n_workers = rng.choice([(2, 2), (3, 2), (2, 3), (3, 3)])
    names = [f"m{i}" for i in range(n_models)]
    demand: dict[str, list] = {m: [] for m in names}
    for r in range(rows):
        demand[rng.choice(names)].append((r, rng.choice([1, 5, 20, 60])))
    demand = {m: Demand.of(dict(rs)) for m, rs in demand.items()}
    costs = {m: ModelCost(rng.choice([0.01, 0.05]), rng.choice([0.0, 0.3, 2.0]), rng.choice([4, 6]),
                          rng.choice([0.0, 0.1, 0.5]) if per_row else 0.0,
                          rng.choice([0.0, 0.005, 0.02]) if per_row else 0.0, rng.choice([2, 3, 100]) if per_row else 256)
             for m in names}
    workers = [WorkerSlot(f"w{i}", rng.choice([10, 12, 100])) for i in range(n_workers)]
    return demand, costs, workers


@pytest.mark.parametrize("seed", range(12))
def test_ilp_is_optimal_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    demand, costs, workers = random_case(rng, rows=6, per_row=seed % 2 == 1)  # odd seeds: costs per row and per forward too
    best = brute_force(demand, costs, workers)
    p = place(demand, costs, workers, "ilp", gap=0.0)
    check_valid(p, demand, costs, workers)
    assert p.optimal and p.solver in ("ilp", "greedy")  # greedy: it met the lower bound
    assert p.makespan_s == pytest.approx(best, rel=1e-9, abs=1e-9)
    near = place(demand, costs, workers, "ilp")  # the default gap: within 1% of the optimum
    check_valid(near, demand, costs, workers)
    assert best - 1e-9 <= near.makespan_s
    # proven within the gap (or greedy within it of the bound), unless the solver's time (capped
    # at what it could save: a wall-clock limit, which a loaded machine reaches) ran out first
    timed_out = near.solver == "ilp-incumbent" or " s " in near.note  # "solver ... after/in X s ..."
    assert timed_out or near.makespan_s <= best * 1.01 + 1e-9, (near.solver, near.note)
    for policy in ("round_robin", "data_parallel"):
        try:
            other = place(demand, costs, workers, policy)
        except PlacementError:
            continue
        check_valid(other, demand, costs, workers)
        assert other.makespan_s >= best - 1e-9


def test_replicates_the_heavy_model_and_pins_light_ones() -> None:
    demand = {"reason": Demand.of({i: 200 for i in range(40)}), "a": Demand.of({100 + i: 20 for i in range(10)}),
              "b": Demand.of({200 + i: 20 for i in range(10)})}
    costs = {m: ModelCost(0.001, 0.5, 1) for m in demand}
    workers = [WorkerSlot(f"w{i}") for i in range(4)]
    p = place(demand, costs, workers)
    assert len(p.replicas["reason"]) >= 3 and len(p.replicas["a"]) == 1 and len(p.replicas["b"]) == 1
    rr = place(demand, costs, workers, "round_robin")
    assert p.makespan_s < rr.makespan_s / 2


def test_load_time_against_work() -> None:
    # x: 1 s of work, 5 s to load; z: 20 s of work, free to load. A second replica of x would
    # cost more load than the work it takes over; z is split around x.
    demand = {"x": Demand.of({i: 10 for i in range(10)}), "z": Demand.of({100 + i: 100 for i in range(20)})}
    costs = {"x": ModelCost(0.01, 5.0, 1), "z": ModelCost(0.01, 0.0, 1)}
    workers = [WorkerSlot("a"), WorkerSlot("b")]
    p = place(demand, costs, workers)
    assert len(p.replicas["x"]) == 1 and len(p.replicas["z"]) == 2
    assert p.makespan_s == pytest.approx(13.0)
    # alone, x is worth a second replica: the two loads run in parallel (5 + 0.5 < 5 + 1)
    alone = place({"x": demand["x"]}, costs, workers)
    assert len(alone.replicas["x"]) == 2 and alone.makespan_s == pytest.approx(5.5)
    capped = place({"x": demand["x"]}, costs, workers, max_replicas={"x": 1})
    assert capped.replicas == {"x": ("a",)} and capped.makespan_s == pytest.approx(6.0)


def test_memory_is_respected() -> None:
    # two big models cannot share a worker: each gets its own even though one has all the work
    demand = {"x": Demand.of({i: 100 for i in range(10)}), "y": Demand.of({100 + i: 1 for i in range(10)})}
    costs = {"x": ModelCost(0.01, 0.0, 8), "y": ModelCost(0.01, 0.0, 8)}
    p = place(demand, costs, [WorkerSlot("a", 10), WorkerSlot("b", 10)])
    check_valid(p, demand, costs, [WorkerSlot("a", 10), WorkerSlot("b", 10)])
    assert len(p.replicas["x"]) == 1 and p.replicas["x"] != p.replicas["y"]
    with pytest.raises(PlacementError, match="data_parallel puts every model on every worker"):
        place(demand, costs, [WorkerSlot("a", 10), WorkerSlot("b", 10)], "data_parallel")


def test_infeasible_memory_is_a_clear_error() -> None:
    demand = {"x": Demand.of({1: 5}), "y": Demand.of({2: 5}), "z": Demand.of({3: 5})}
    costs = {m: ModelCost(0.01, 0.0, 6) for m in demand}
    with pytest.raises(PlacementError, match="cannot all be held"):
        place(demand, costs, [WorkerSlot("a", 10), WorkerSlot("b", 10)])
    with pytest.raises(PlacementError, match="fits no worker"):
        place({"x": Demand.of({1: 5})}, {"x": ModelCost(0.01, 0.0, 11)}, [WorkerSlot("a", 10)])
    with pytest.raises(PlacementError, match="unknown"):
        place(demand, costs, [WorkerSlot("a")], "fastest")  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="no ModelCost"):
        place({"q": Demand.of({1: 1})}, {}, [WorkerSlot("a")])


def test_falls_back_within_the_time_limit() -> None:
    rng = random.Random(7)
    demand = {f"m{k}": Demand.of({(k, i): rng.randint(1, 500) for i in range(300)}) for k in range(8)}
    costs = {m: ModelCost(rng.choice([0.001, 0.003, 0.01]), 0.2, 1) for m in demand}
    workers = [WorkerSlot(f"w{i}") for i in range(16)]
    start = time.perf_counter()
    p = place(demand, costs, workers, time_limit_s=0.05, gap=0.0)
    elapsed = time.perf_counter() - start
    check_valid(p, demand, costs, workers)
    assert p.solver in ("greedy", "ilp-incumbent") and not p.optimal
    assert p.solver != "greedy" or p.note  # the fallback says why
    assert elapsed < 10.0  # the limit bounds the solver; building the program and greedy add the rest
    total = sum(d.total * costs[m].seconds_per_token for m, d in demand.items())
    assert p.makespan_s <= 1.25 * (total / len(workers) + 0.2 * 8)


def test_empty_and_zero_demand() -> None:
    p = place({"m": Demand((), ())}, {"m": ModelCost(0.1)}, [WorkerSlot("a")])
    assert p.replicas == {} and p.makespan_s == 0.0


def test_cost_per_row_moves_short_rows_off_the_long_model() -> None:
    """Many 1-token rows cost more than their tokens say: with seconds_per_row the placement
    sees the short model's rows as the work they are (and predicts it)."""
    demand = {"long": Demand.of({i: 40 for i in range(20)}), "short": Demand.of({100 + i: 1 for i in range(200)})}
    workers = [WorkerSlot("w0"), WorkerSlot("w1")]
    tokens_only = {"long": ModelCost(0.01, 0.0), "short": ModelCost(0.01, 0.0)}
    with_rows = {"long": ModelCost(0.01, 0.0, 0, 0.001), "short": ModelCost(0.01, 0.0, 0, 0.04)}
    a = place(demand, tokens_only, workers, "round_robin")
    b = place(demand, with_rows, workers, "round_robin")
    assert a.makespan_s == pytest.approx(8.0) and b.makespan_s == pytest.approx(200 * 0.05)
    p = place(demand, with_rows, workers, "ilp")
    total = 20 * (0.001 + 0.4) + 200 * 0.05
    assert p.makespan_s <= total / 2 + 0.41 and len(p.replicas["short"]) == 2


def test_no_solver_when_greedy_meets_the_lower_bound() -> None:
    """Equal rows of one model over two workers: the greedy split is provably optimal, so the
    solver is not run (its time would only add to the stage)."""
    demand = {"m": Demand.of({i: 10 for i in range(40)})}
    costs = {"m": ModelCost(0.01, 0.0)}
    p = place(demand, costs, [WorkerSlot("w0"), WorkerSlot("w1")], "ilp", gap=0.0)
    assert p.solver == "greedy" and p.optimal and "lower bound" in p.note
    assert p.makespan_s == pytest.approx(2.0)
    with pytest.raises(PlacementError, match="gap"):
        place(demand, costs, [WorkerSlot("w0")], "ilp", gap=1.5)


def test_forwards_keep_a_small_job_on_one_replica() -> None:
    """A forward's fixed cost: 20 rows fill no batch of 64, so a second replica would run all 40
    forwards again, on the worker the other model needs; with rows that fill batches the model
    is split again."""
    workers = [WorkerSlot("w0"), WorkerSlot("w1")]
    costs = {"m": ModelCost(0.0001, 0.0, 0, 0.0, 0.01, 64), "other": ModelCost(0.001)}
    demand = {"m": Demand.of({i: 40 for i in range(20)}), "other": Demand.of({100 + i: 1 for i in range(400)})}
    small = place(demand, costs, workers, "ilp", gap=0.0)
    assert len(small.replicas["m"]) == 1 and small.makespan_s == pytest.approx(0.4 + 20 * 40 * 0.0001)
    big = place({"m": Demand.of({i: 40 for i in range(1280)})}, costs, workers, "ilp", gap=0.0)
    assert len(big.replicas["m"]) == 2
    assert big.makespan_s == pytest.approx(0.01 * 640 * 40 / 64 + 640 * 40 * 0.0001)


def test_longest_row_bounds_the_forwards_in_the_program() -> None:
    """A replica runs at least its longest row's forwards: the program must charge them too
    (it once skipped that bound and proved a worse placement optimal: 6.0 s here, not 5.3 s)."""
    demand = {"m0": Demand.of({0: 20.0}), "m1": Demand.of({3: 60.0, 5: 5.0}),
              "m2": Demand.of({1: 20.0, 2: 5.0, 4: 5.0})}
    costs = {"m0": ModelCost(0.01, 2.0, 6, 0.5, 0.0, 3), "m1": ModelCost(0.01, 2.0, 4, 0.0, 0.02, 3),
             "m2": ModelCost(0.01, 2.0, 6, 0.1, 0.0, 2)}
    workers = [WorkerSlot("w0", 10), WorkerSlot("w1", 12)]
    best = brute_force(demand, costs, workers)
    p = place(demand, costs, workers, "ilp", gap=0.0)
    check_valid(p, demand, costs, workers)
    assert best == pytest.approx(5.3) and p.makespan_s == pytest.approx(best, rel=1e-9)


def test_greedy_sums_each_row_once_not_per_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 workers, 8 models, ~5,000 rows: the greedy placement tries a replica per (model, worker)
    on the bottleneck, and once summed every row's work again for every trial (~4 million
    row_s calls, 2 CPU seconds beside a 0.5 s solver limit). Now each row's sums are kept per
    chunk: a few calls per row in all."""
    rng = random.Random(0)
    demand = {f"m{j}": Demand.of({(j, i): rng.choice([4, 40, 400]) for i in range(rng.randint(300, 1250))})
              for j in range(8)}
    costs = {m: ModelCost(rng.choice([1e-4, 5e-4, 2e-3]), rng.choice([0.1, 1.0, 5.0]), rng.choice([1, 2, 3]) << 30,
                          rng.choice([0, 1e-3]), rng.choice([0, 5e-3]), 64) for m in demand}
    workers = [WorkerSlot(f"w{i}", 8 << 30) for i in range(16)]
    calls = 0
    row_s = ModelCost.row_s

    def counted(self: ModelCost, tokens: float) -> float:
        nonlocal calls
        calls += 1
        return row_s(self, tokens)

    monkeypatch.setattr(ModelCost, "row_s", counted)
    p = place(demand, costs, workers, time_limit_s=0.5)
    check_valid(p, demand, costs, workers)
    rows = sum(len(d.rows) for d in demand.values())
    assert calls <= 10 * rows, (calls, rows)
    assert p.makespan_s < place(demand, costs, workers, "round_robin").makespan_s / 2


def test_plain_demand_dicts_and_wrong_types() -> None:
    p = place({"m": {0: 5.0, 1: 7.0}}, {"m": ModelCost(0.1)}, [WorkerSlot("a")])  # {row: tokens} is a Demand
    assert p.rows == {"a": {"m": (1, 0)}} and p.makespan_s == pytest.approx(1.2)
    with pytest.raises(PlacementError, match="workers must be WorkerSlot values, got 'a'"):
        place({"m": {0: 5.0}}, {"m": ModelCost(0.1)}, ["a"])  # type: ignore[list-item]
    with pytest.raises(PlacementError, match="costs must be ModelCost values"):
        place({"m": {0: 5.0}}, {"m": 0.1}, [WorkerSlot("a")])  # type: ignore[dict-item]
