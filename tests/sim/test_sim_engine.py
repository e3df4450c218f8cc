"""The simulated engine drives the runtime's own Scheduler, and its closed-form slices agree with
calling that Scheduler every step."""
from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

import batchgen.policy.balance as balance
import batchgen.runtime.policy as policy
from batchgen.errors import PlanError
from batchgen.policy.balance import CoroutineInfo, reported_movable
from batchgen.sim import cluster as sim_cluster
from batchgen.sim import engine as sim_engine
from batchgen.sim import reports as sim_reports
from batchgen.sim.cost import build_cost
from batchgen.sim.engine import SimEngine
from batchgen.sim.engine_config import EngineSimConfig
from batchgen.sim.profiles import load_profile
from batchgen.sim.seqs import make_sequence
from batchgen.sim.shapes import load_shape
from batchgen.sim.waiting import WaitingQueue
from batchgen.sim.workload import synthetic


@pytest.fixture(scope="module")
def cost():  # a small KV pool, so eviction and swap are exercised
    return build_cost(load_profile("H200"), load_shape("qwen3-30b-a3b"), kv_capacity_tokens=40_000)


def _engine(cost, rows: int, seed: int, **config: object) -> SimEngine:
    w = synthetic("reasoning", rows, seed)
    w = replace(w, output_len=np.minimum(w.output_len, 3000), max_tokens=np.full(rows, 3000))
    e = SimEngine("w", cost, EngineSimConfig(max_num_seqs=24, max_num_batched_tokens=1024, **config))
    for r in range(rows):
        e.add(make_sequence(r, int(w.prompt_len[r]), int(w.max_tokens[r]), int(w.output_len[r])))
    return e


def _trace(e: SimEngine) -> tuple[list[tuple[int, float]], int, int]:
    e.run_until(float("inf"))
    return e.finished, e.preemptions, e.generated


def test_the_policy_code_is_the_runtimes_own() -> None:
    assert sim_engine.Scheduler is policy.Scheduler
    assert sim_engine.prefer_transfer is policy.prefer_transfer
    assert sim_cluster.plan_migrations is balance.plan_migrations
    assert sim_reports.reported_movable is balance.reported_movable


@pytest.mark.parametrize("seed", [0, 1])
def test_closed_form_slices_match_a_schedule_call_per_step(cost, seed: int) -> None:
    """quantum_steps=1 calls Scheduler.schedule() before every forward; exact slices of up to 64
    steps must reach the same finishes (order and time), evictions and tokens."""
    stepwise = _trace(_engine(cost, 60, seed, quantum_steps=1, exact=True))
    sliced = _trace(_engine(cost, 60, seed, quantum_steps=64, exact=True))
    assert stepwise[1] > 0, "the pool must be small enough to evict"
    assert [r for r, _ in sliced[0]] == [r for r, _ in stepwise[0]]
    assert sliced[1:] == stepwise[1:]
    np.testing.assert_allclose([t for _, t in sliced[0]], [t for _, t in stepwise[0]], rtol=1e-9)


def test_coarse_slices_stay_close_to_exact(cost) -> None:
    exact = _trace(_engine(cost, 120, 3, exact=True))
    coarse = _trace(_engine(cost, 120, 3))
    assert sorted(r for r, _ in coarse[0]) == list(range(120))
    bct_exact, bct_coarse = max(t for _, t in exact[0]), max(t for _, t in coarse[0])
    assert coarse[2] == exact[2]  # every row still generates exactly its tokens
    assert abs(bct_coarse / bct_exact - 1) < 0.03, (bct_coarse, bct_exact)


def test_load_report_equals_the_runners_full_sort() -> None:
    """WaitingQueue.most_remaining must pick what sorting every unfinished row would."""
    rng = random.Random(0)
    for trial in range(30):
        q = WaitingQueue()
        for r in range(rng.randint(0, 700)):
            seq = make_sequence(r, 10, rng.choice([64, 64, 64, 100, 7, rng.randint(1, 200)]), 1)
            (q.appendleft if rng.random() < 0.2 else q.append)(seq)
        for _ in range(rng.randint(0, 50)):
            if q:
                q.remove(q[rng.randrange(len(q))]) if rng.random() < 0.5 else q.popleft()
        infos = [CoroutineInfo(int(s.seq_id), s.remaining_tokens, 0) for s in q]
        want = reported_movable(infos)
        got = reported_movable(q.most_remaining(256))
        assert got == want, trial
        assert q.remaining_tokens == sum(s.remaining_tokens for s in q)
        again = q.most_remaining(256)  # a row's entry is made once, on its first report
        assert all(a is b for a, b in zip(again, q.most_remaining(256)))
        if q:
            q.popleft()
            assert set(q.reported) <= set(q), "a row that left the queue keeps no entry"


def test_engine_load_is_what_the_policy_reads(cost) -> None:
    """A report taken while a decode slice runs past the tick is what closing the slice there
    leaves, and that is the runner's report on the sequences."""
    e = _engine(cost, 300, 5)
    open_slices = 0
    for tick in np.arange(0.5, 60, 0.5):
        e.run_until(float(tick))
        load = e.load()
        if e.slice is not None:
            open_slices += 1
            e.cut()
            closed = e.load()
            assert replace(load, tokens_per_s=0, speed=0) == replace(closed, tokens_per_s=0, speed=0)
        e.settle()  # the rows' Sequence objects as the runtime's report reads them
        unfinished = list(e.scheduler.waiting) + e.scheduler.running
        assert load.waiting == len(e.scheduler.waiting) and load.running == len(e.scheduler.running)
        assert load.remaining_tokens == sum(s.remaining_tokens for s in unfinished)
        assert load.kv_used == 1 - e.allocator.num_free / e.allocator.num_blocks
        assert tuple(load.movable) == reported_movable(CoroutineInfo(int(s.seq_id), s.remaining_tokens, s.num_computed)
                                                       for s in unfinished)
    assert open_slices > 10


def test_lookahead_reserves_the_coming_decode_steps_and_evicts_for_them() -> None:
    """Scheduler.schedule(lookahead=k): each sampling row gets KV for k tokens (at most until its
    max_tokens), evicting the newest when the pool cannot hold that; k=1 is the engine's plan."""
    from batchgen.runtime.kv_cache import BlockAllocator
    from batchgen.runtime.policy import Scheduler, SchedulerConfig
    from batchgen.runtime.sequence import SeqStatus

    def three_running(lookahead: int) -> tuple[Scheduler, policy.Plan]:
        alloc = BlockAllocator(12, 8)  # 6 blocks held below, 6 free
        sched = Scheduler(SchedulerConfig(8, 64), alloc)
        for r, m in enumerate((100, 100, 3)):  # row 2 may generate 2 more tokens
            q = make_sequence(r, 16, m, m)
            q.num_computed, q.output_ids = 16, range(1)  # prefilled, one token sampled: 1 to feed
            q.block_ids, q.status = alloc.allocate(2), SeqStatus.RUNNING
            sched.running.append(q)
        return sched, sched.schedule(lookahead)

    sched, plan = three_running(1)  # 17 tokens: a third block each
    assert [len(s.block_ids) for s in sched.running] == [3, 3, 3] and not plan.evicted
    sched, plan = three_running(10)  # 26 tokens -> 4 blocks; row 2 only to its end: 18 -> 3
    assert [len(s.block_ids) for s in sched.running] == [4, 4, 3] and not plan.evicted
    assert sched.allocator.num_free == 1 and [i.num_new for i in plan.scheduled] == [1, 1, 1]
    sched, plan = three_running(30)  # 46 tokens -> 6 blocks: row 1's do not fit until row 2 goes
    assert [int(e.seq.seq_id) for e in plan.evicted] == [2]
    assert [len(s.block_ids) for s in sched.running] == [6, 6] and sched.allocator.num_free == 0


def test_the_watermark_stops_the_evict_readmit_thrash() -> None:
    """A KV-bound H200 engine, scheduled step by step (exact): without the admission watermark
    rows are re-admitted into the last free blocks and evicted again (up to 16 times each here)."""
    h200 = build_cost(load_profile("H200"), load_shape("qwen3-30b-a3b"))
    w = synthetic("reasoning", 800, 0)

    def run(watermark: float) -> tuple[int, int, float]:
        e = SimEngine("w", h200, EngineSimConfig(exact=True))
        e.scheduler.config = replace(e.scheduler.config, watermark=watermark)
        seqs = [make_sequence(r, int(w.prompt_len[r]), int(w.max_tokens[r]), int(w.output_len[r])) for r in range(800)]
        for s in seqs:
            e.add(s)
        e.run_until(float("inf"))
        return e.preemptions, max(s.num_preemptions for s in seqs), max(t for _, t in e.finished)

    (thrash, worst, bct0), (calm, calm_worst, bct1) = run(0.0), run(policy.SchedulerConfig().watermark)
    assert thrash > 3 * calm and worst > 2 * calm_worst, (thrash, worst, calm, calm_worst)
    assert bct1 <= bct0 * 1.01


def test_a_sealed_engine_runs_its_tail_in_fewer_slices_with_the_same_finishes() -> None:
    """Nothing will come to a sealed engine, so once nothing waits a slice runs to its last
    row's finish instead of closing at each eighth: where the pool does not bind, the same rows
    finish, the last at the same time (to float rounding), in fewer decisions. (A row that
    finishes inside a slice is recorded at the slice's end, so the others' times may differ.)"""
    h200 = build_cost(load_profile("H200"), load_shape("qwen3-30b-a3b"))
    w = synthetic("reasoning", 400, 5)
    runs = []
    for sealed in (False, True):
        e = SimEngine("w", h200, EngineSimConfig())
        for r in range(w.rows):
            e.add(make_sequence(r, int(w.prompt_len[r]), int(w.max_tokens[r]), int(w.output_len[r])))
        e.sealed = sealed
        e.run_until(float("inf"))
        runs.append(e)
    open_, sealed_ = runs
    assert sorted(r for r, _ in sealed_.finished) == sorted(r for r, _ in open_.finished) == list(range(w.rows))
    assert max(t for _, t in sealed_.finished) == pytest.approx(max(t for _, t in open_.finished), rel=1e-12)
    assert sealed_.busy_s == pytest.approx(open_.busy_s, rel=1e-12)
    assert (sealed_.generated, sealed_.preemptions) == (open_.generated, open_.preemptions)
    assert len(sealed_.timeline) < len(open_.timeline)
    with pytest.raises(PlanError, match="sealed"):
        sealed_.add(make_sequence(w.rows, 16, 16, 16))
