"""The simulated engine's running rows as arrays (sim/batch.py): the scheduler's running loop in
closed form gives the runtime Scheduler's own plan, and the simulations give the same results
with it as with a Scheduler.schedule() call for every decision."""
from __future__ import annotations

import gc
from dataclasses import replace

import numpy as np
import pytest

from batchgen.runtime.policy import Scheduler, SchedulerConfig
from batchgen.runtime.sequence import SeqStatus
from batchgen.sim.batch import RunningBatch
from batchgen.sim.blocks import BlockCounter
from batchgen.sim.cluster import ClusterSimConfig, simulate_all
from batchgen.sim.cost import ExpertTiers, build_cost
from batchgen.sim.engine import SimEngine
from batchgen.sim.engine_config import EngineSimConfig
from batchgen.sim.gc_pace import YOUNG_THRESHOLD, rare_collections
from batchgen.sim.policies import BatchGen, Dynamic, Static
from batchgen.sim.profiles import load_profile
from batchgen.sim.seqs import make_sequence
from batchgen.sim.shapes import load_shape
from batchgen.sim.slices import DecodeSlice
from batchgen.sim.workload import synthetic


def _running(rng: np.random.Generator, rows: int, block_size: int, alloc: BlockCounter) -> list:
    """Running rows in every state the loop meets: prefill chunks part done, decoding rows with
    spare room in their blocks (a lookahead reserved it), rows one token from max_tokens."""
    seqs = []
    for r in range(rows):
        prompt = int(rng.integers(1, 600))
        max_tokens = int(rng.integers(1, 400))
        out = int(rng.integers(0, max_tokens)) if rng.random() < 0.7 else 0
        computed = prompt + out - 1 if out else int(rng.integers(0, prompt))
        q = make_sequence(r, prompt, max_tokens, max_tokens + 5)
        q.num_computed, q.output_ids = computed, range(out)
        held = -(-computed // block_size) + int(rng.integers(0, 3))
        q.block_ids, q.status = alloc.allocate(held), SeqStatus.RUNNING
        seqs.append(q)
    return seqs


@pytest.mark.parametrize("seed", range(60))
def test_the_closed_form_running_loop_is_the_schedulers(seed: int) -> None:
    """The rows scheduled, the tokens each feeds, the blocks each gets and the rows evicted (in
    order) are the real loop's, on pools from ample to nearly empty."""
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([1, 4, 16]))
    lookahead = int(rng.choice([1, 2, 9, 64]))
    rows = int(rng.integers(1, 60))
    alloc = BlockCounter(100_000, block_size)
    seqs = _running(rng, rows, block_size, alloc)
    batch = RunningBatch(seqs)
    fed_all = sum(q.num_tokens - q.num_computed for q in seqs)  # every row feeding all it has left
    budget = max(1, int(rng.choice([1, 7, 64, 8192, fed_all - 1, fed_all, fed_all + 1])))
    asked = int(batch.plan_running(budget, lookahead, block_size, 10**9)[1].sum())
    free = int(rng.choice([asked, asked + 3, asked - 1, asked // 2, 0])) if asked else int(rng.integers(0, 3))
    free = max(free, 0)
    fed, need, first, keep = batch.plan_running(budget, lookahead, block_size, free)
    alloc.take(alloc.num_free - free)
    sched = Scheduler(SchedulerConfig(256, budget, eviction="newest"), alloc)
    sched.running = list(seqs)
    held = [len(q.block_ids) for q in seqs]
    plan = sched.schedule(lookahead)
    assert [int(e.seq.seq_id) for e in plan.evicted] == list(range(rows - 1, keep - 1, -1))
    assert [int(q.seq_id) for q in sched.running] == list(range(keep))
    assert [(int(i.seq.seq_id), i.num_new) for i in plan.scheduled] == \
        [(r, int(n)) for r, n in enumerate(fed[:first])]
    assert not fed[first:].any() and not need[first:].any()
    assert [len(q.block_ids) - h for q, h in zip(seqs[:keep], held)] == need[:keep].tolist()
    assert alloc.num_free == free + sum(held[keep:]) - int(need.sum())


def test_a_batch_writes_its_counters_back_into_the_rows() -> None:
    alloc = BlockCounter(1000, 16)
    seqs = _running(np.random.default_rng(0), 5, 16, alloc)
    batch = RunningBatch(seqs)
    before = batch.state
    batch.computed = batch.computed + 3
    assert (before[4] == [q.num_computed for q in seqs]).all()  # the old array is unchanged
    batch.out, batch.blocks = batch.out + 1, batch.blocks + 2
    batch.sync([1])
    assert seqs[1].num_computed == int(batch.computed[1]) and len(seqs[1].output_ids) == int(batch.out[1])
    assert len(seqs[1].block_ids) == int(batch.blocks[1]) and seqs[0].num_computed != int(batch.computed[0])
    kept = batch.state
    batch.drop([1, 3])
    assert batch.seqs == [seqs[0], seqs[2], seqs[4]] and batch.ids.tolist() == [0, 2, 4]
    batch.drop([0, 2])
    assert batch.seqs == [seqs[2]] and batch.ids.tolist() == [2] and batch.state.shape == (7, 1)
    assert kept.shape == (7, 5)  # the array read before is unchanged
    assert len(seqs) == 5  # the list the batch was made from is not the batch's


@pytest.fixture(scope="module")
def small_pool():  # KV-bound: evictions, swaps and the real schedule() calls happen
    return build_cost(load_profile("H200"), load_shape("qwen3-30b-a3b"), kv_capacity_tokens=40_000)


@pytest.mark.parametrize(("exact", "eviction"), [(False, "newest"), (True, "newest"), (False, "most_remaining")])
def test_an_engine_decides_the_same_with_the_closed_form(small_pool, monkeypatch, exact: bool, eviction: str) -> None:
    w = synthetic("reasoning", 300, 3)
    w = replace(w, output_len=np.minimum(w.output_len, 3000), max_tokens=np.full(300, 3000))

    def run() -> tuple:
        e = SimEngine("w", small_pool, EngineSimConfig(max_num_seqs=24, max_num_batched_tokens=1024, exact=exact,
                                                    eviction=eviction))  # type: ignore[arg-type]
        for r in range(300):
            e.add(make_sequence(r, int(w.prompt_len[r]), int(w.max_tokens[r]), int(w.output_len[r])))
        for t in np.arange(2.0, 400.0, 2.0):  # ticks with loads read, as a fleet's are
            e.run_until(float(t))
            e.load()
        e.run_until(float("inf"))
        return e.finished, e.preemptions, e.generated, e.busy_s, e.resumed

    fast = run()
    monkeypatch.setattr(SimEngine, "closed_form", False)
    assert run() == fast and fast[1] > 0  # (rows were evicted: both paths ran)


def test_a_fleet_simulates_the_same_with_the_closed_form(monkeypatch) -> None:
    """Every policy, with migrations (batchgen) and batches dealt (dynamic)."""
    cost = build_cost(load_profile("H200"), load_shape("qwen3-30b-a3b"), kv_capacity_tokens=60_000)
    w = synthetic("mixed", 1500, 1, "grouped")
    policies = (Static(), Dynamic(), BatchGen())
    cluster = ClusterSimConfig(workers=6, tick_s=2.0)
    fast = simulate_all(w, cost, EngineSimConfig(max_num_seqs=32), policies, cluster)
    monkeypatch.setattr(SimEngine, "closed_form", False)
    slow = simulate_all(w, cost, EngineSimConfig(max_num_seqs=32), policies, cluster)
    assert [replace(r, wall_s=0) for r in fast] == [replace(r, wall_s=0) for r in slow]
    assert fast[2].migrated_coroutines > 0


def test_step_seconds_looked_up_by_token_count_are_the_expressions_values() -> None:
    """One forward in Python floats and integer counts looked up (RooflineCost.per_tokens) give
    the values of the expressions over float token counts, to the last bit."""
    rng = np.random.default_rng(0)
    for model, memory in (("qwen3-30b-a3b", None), ("mixtral-8x7b", 4 << 30), ("deepseek-v3", 8 << 30)):
        cost = build_cost(load_profile("H200"), load_shape(model), ExpertTiers(memory))
        tokens, kv = rng.integers(0, 20_000, 500), rng.integers(0, 10**7, 500)
        pairs = rng.integers(0, 10**9, 500) / 2
        expressions = cost.step_seconds(tokens.astype(np.float64), tokens, kv, pairs)
        assert (cost.step_seconds(tokens, tokens, kv, pairs) == expressions).all()
        for t, k, p, want in zip(tokens.tolist(), kv.tolist(), pairs.tolist(), expressions.tolist()):
            one = cost.step_seconds(t, t, k, p)
            assert type(one) is float and one == want


def test_collections_are_rarer_only_inside_the_block() -> None:
    before = gc.get_threshold()
    with rare_collections():
        assert gc.get_threshold()[0] == max(before[0], YOUNG_THRESHOLD)
        assert gc.get_threshold()[1:] == before[1:]
    assert gc.get_threshold() == before


@pytest.mark.parametrize("seed", range(30))
def test_a_kv_bound_slice_ends_where_the_pool_runs_out(seed: int) -> None:
    """DecodeSlice.fit: the most steps whose new blocks fit the free ones, as a search over
    every step count finds them."""
    rng = np.random.default_rng(seed)
    rows, block_size, k = int(rng.integers(1, 80)), int(rng.choice([1, 4, 16])), int(rng.integers(1, 300))
    c0 = rng.integers(1, 5000, rows)
    have = -(-(c0 + 1) // block_size) + rng.integers(0, 3, rows)  # step 1's block came with the plan
    left = rng.integers(1, 400, rows)

    def piece() -> DecodeSlice:
        return DecodeSlice(np.arange(rows), left + 10, 0.0, 0, c0, np.zeros(rows, np.int64), left, have,
                           np.sort(left), None, k, block_size)  # type: ignore[arg-type]

    total = int(piece().blocks_needed(k).sum())
    for free in sorted({0, total // 3, max(total - 1, 0), total, total + 5}):
        p = piece()
        p.fit(free)
        fits = [j for j in range(1, k + 1) if int(piece().blocks_needed(j).sum()) <= free]
        assert p.k == max(fits)
