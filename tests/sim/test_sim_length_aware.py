"""The length-aware policy in the simulator: the runtime's own queue and predictor, a gain where rows
name a group that predicts their length, and no more than the stated harm where it misleads."""
from __future__ import annotations

import numpy as np
import pytest

import batchgen.policy.length_prediction as length_prediction
import batchgen.runtime.length_order as length_order
from batchgen.policy.length_prediction import LengthPredictor, PredictorConfig
from batchgen.runtime.kv_cache import BlockAllocator
from batchgen.runtime.policy import Scheduler, SchedulerConfig
from batchgen.sim import engine as sim_engine
from batchgen.sim.cluster import ClusterSimConfig, simulate_all
from batchgen.sim.cost import build_cost
from batchgen.sim.engine import SimEngine
from batchgen.sim.engine_config import EngineSimConfig
from batchgen.sim.partitions import rows_as_sequences
from batchgen.sim.policies import LENGTH_AWARE, BatchGen
from batchgen.sim.profiles import load_profile
from batchgen.sim.seqs import make_sequence, row_group
from batchgen.sim.shapes import load_shape
from batchgen.sim.waiting import LengthWaitingQueue
from batchgen.sim.workload import synthetic


@pytest.fixture(scope="module")
def cost():
    return build_cost(load_profile("H200"), load_shape("qwen3-30b-a3b"))


def _bcts(cost, kind: str, rows: int, workers: int) -> tuple[float, float]:
    w = synthetic(kind, rows, seed=0)
    out = simulate_all(w, cost, EngineSimConfig(), (BatchGen(), LENGTH_AWARE), ClusterSimConfig(workers, tick_s=2.0))
    return out[0].bct_s, out[1].bct_s


def test_the_simulated_engine_runs_the_runtimes_queue_and_predictor(cost) -> None:
    e = SimEngine("w", cost, EngineSimConfig(admission="length"))
    assert isinstance(e.scheduler.waiting, length_order.LengthOrderedQueue)
    assert isinstance(e.scheduler.lengths, length_prediction.LengthPredictor)
    assert e.scheduler.waiting is e.waiting and e.scheduler.group_of is row_group
    assert sim_engine.Scheduler is Scheduler


def test_the_simulator_admits_as_the_runtime_scheduler_does() -> None:
    """The same rows, finishes and arrivals through the runtime's Scheduler with its own queue and
    through the simulator's counted queue: the same admissions, step by step."""
    rng = np.random.default_rng(3)
    groups, lengths = rng.integers(0, 3, 300), rng.integers(1, 40, 300)
    lengths[groups == 2] += 60
    traces = []
    for counted in (False, True):
        s = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, admission="length"),
                      BlockAllocator(400, 16), group_of=row_group)
        assert s.lengths is not None
        s.lengths.config = PredictorConfig(min_finished=24, min_group=4, window=64)
        if counted:
            s.waiting = LengthWaitingQueue(s.lengths, row_group)
        rows = [make_sequence(i, 8 + i % 5, 200, int(lengths[i]), int(groups[i])) for i in range(300)]
        for r in rows[:150]:
            s.add(r)
        trace, step, used = [], 0, 0
        while s.has_work:
            step += 1
            if step == 20:  # more rows arrive mid-job
                for r in rows[150:]:
                    s.add(r)
            used += s.lengths.confident
            plan = s.schedule()
            trace.append([int(x.seq.seq_id) for x in plan.scheduled])
            for item in plan.scheduled:
                q = item.seq
                q.num_computed += item.num_new
                if item.samples:
                    q.output_ids = range(len(q.output_ids) + 1)
                    if len(q.output_ids) >= q.params.stop_at:
                        q.finish("stop")
                        s.release(q)
        traces.append((trace, used))
    assert traces[0] == traces[1] and traces[0][1] > 100  # predictions were in use for most steps


def test_length_aware_wins_where_groups_predict_lengths(cost) -> None:
    batchgen, aware = _bcts(cost, "mixed", 2400, 2)  # 2.0% less
    assert aware < 0.99 * batchgen, (batchgen, aware)


def test_without_a_signal_length_aware_is_todays_policy(cost) -> None:
    """Reasoning rows: nothing known at admission predicts a length, the predictor is never
    confident, and every decision is today's."""
    batchgen, aware = _bcts(cost, "reasoning", 1200, 2)
    assert aware == batchgen


def test_a_misleading_group_costs_no_more_than_the_bound(cost) -> None:
    batchgen, aware = _bcts(cost, "mislead", 1200, 2)
    assert aware <= 1.02 * batchgen, (batchgen, aware)


def test_a_single_engine_learns_group_lengths_from_finished_rows(cost) -> None:
    w = synthetic("mixed", 600, seed=1)
    e = SimEngine("w", cost, EngineSimConfig(admission="length"))
    for seq in rows_as_sequences(w, np.arange(w.rows)):
        e.add(seq)
    e.run_until(float("inf"))
    lengths = e.scheduler.lengths
    assert isinstance(lengths, LengthPredictor) and lengths.finished == 600
    means = {k: v.mean for k, v in lengths.keys.items()}
    assert means[0] > 3 * means[1] > 3 * means[2]  # reasoning > chat > classification


def test_age_isolation_with_no_row_old_enough_is_the_fluid_estimate_on_the_other_workers(cost) -> None:
    """No row reaches min_age: the isolated workers stay empty and the rest run oblivious.fifo_bct
    (to 0.2%: the two fluid models step their clocks differently; 0.04% apart here)."""
    from batchgen.sim.age_isolation import age_isolated_bct
    from batchgen.sim.oblivious import fifo_bct

    w = synthetic("chat", 2_000, seed=0)
    never = int(w.output_len.max()) + 1
    shared_only = fifo_bct(w, cost, EngineSimConfig(), 6)
    assert age_isolated_bct(w, cost, EngineSimConfig(), 8, never, isolated=2) == pytest.approx(shared_only, rel=2e-3)
    # rows that do grow old move to the two other workers, and the end moves (on chat rows, later:
    # old rows' steps are bound by their own KV, so small batches do not make up for the workers)
    assert abs(age_isolated_bct(w, cost, EngineSimConfig(), 8, 256, isolated=2) / shared_only - 1) > 0.01
