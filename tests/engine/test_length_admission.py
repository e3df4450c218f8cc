"""Length-aware admission without a model: the online predictor, the length-ordered queue and the
Scheduler that drives them (admission="length")."""
from __future__ import annotations

import numpy as np
import pytest

from batchgen.policy.length_prediction import LengthPredictor, PredictorConfig, length_key
from batchgen.runtime.kv_cache import BlockAllocator
from batchgen.runtime.length_order import LengthOrderedQueue
from batchgen.runtime.policy import Scheduler, SchedulerConfig
from batchgen.runtime.sequence import SeqId, SeqStatus, Sequence
from batchgen.sampling_params import SamplingParams


def seq(i: int, prompt_len: int = 4, max_tokens: int = 64) -> Sequence:
    return Sequence(SeqId(i), i, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), seed=i)


def taught(short: int = 10, long: int = 1000, rows: int = 100) -> LengthPredictor:
    p = LengthPredictor(PredictorConfig(min_finished=20, min_group=4, window=64))
    for i in range(rows):
        p.observe("a", short + i % 3) if i % 2 else p.observe("b", long + i % 7)
    return p


def test_no_prediction_before_enough_rows_finished() -> None:
    p = LengthPredictor(PredictorConfig(min_finished=20, min_group=4))
    for i in range(19):
        p.observe("a" if i % 2 else "b", 10 if i % 2 else 1000)
    assert p.predict("a", 10_000) is None and not p.confident
    p.observe("a", 10)
    assert p.confident


def test_group_means_predict_and_are_capped_by_max_tokens() -> None:
    p = taught()
    assert p.confident
    assert p.predict("a", 10_000) == pytest.approx(11, abs=1.5)
    assert p.predict("b", 10_000) == pytest.approx(1003, abs=5)
    assert p.predict("b", 200) == 200
    assert p.predict("never seen", 10_000) == pytest.approx(p.pooled.mean)


def test_one_group_carries_no_signal_so_it_is_never_used() -> None:
    rng = np.random.default_rng(0)
    p = LengthPredictor(PredictorConfig(min_finished=10))
    for x in np.exp(rng.normal(6, 1, 500)).astype(int).tolist():
        p.observe("only", x)
    assert not p.confident and p.predict("only", 10**6) is None


def test_statistics_that_flip_turn_the_predictions_off() -> None:
    p = taught()
    assert p.confident
    off_after = None
    for i in range(200):  # the groups swap their lengths
        p.observe("b", 10 + i % 3) if i % 2 else p.observe("a", 1000 + i % 7)
        if not p.confident:
            off_after = i + 1
            break
    assert off_after is not None and off_after <= 64  # within the error window


def test_prompt_buckets_are_the_fallback_key() -> None:
    assert length_key("template-1", 500) == "template-1"
    assert length_key(None, 500) == length_key(None, 300) != length_key(None, 600)


def test_rows_all_of_one_length_never_turn_predictions_on() -> None:
    """Every row stopping at max_tokens leaves the keys and the pooled mean without error: nothing
    tells rows apart, so today's order must stay (0 <= 0.9 x 0 must not count as a win)."""
    p = LengthPredictor(PredictorConfig(min_finished=8, min_group=2, window=32))
    for i in range(200):
        p.observe(("prompt", i % 5), 48)
    assert p.finished == 200 and not p.confident and p.predict(("prompt", 0), 48) is None


def test_queue_keeps_arrival_order_until_predictions_are_used() -> None:
    p = LengthPredictor(PredictorConfig(min_finished=20, min_group=4, window=64))
    groups = {0: "a", 1: "b", 2: "a", 3: "b", 4: "a"}
    q = LengthOrderedQueue(p, lambda s: groups.get(int(s.seq_id)))
    rows = [seq(i) for i in range(5)]
    for r in rows:
        q.append(r)
    assert list(q) == rows and q[0] is rows[0]
    assert [q.popleft() for _ in range(5)] == rows  # the lanes interleave in arrival order
    for r in rows:
        q.append(r)
    q2 = LengthOrderedQueue(taught(), lambda s: groups.get(int(s.seq_id)))
    for r in rows:
        q2.append(r)
    assert [int(s.seq_id) for s in q2] == [1, 3, 0, 2, 4]  # group b (long) first, arrival order within
    back = seq(9)
    q2.appendleft(back)
    assert [int(q2.popleft().seq_id) for _ in range(3)] == [9, 1, 3]
    q2.remove(rows[2])
    assert rows[2] not in q2 and rows[4] in q2 and len(q2) == 2
    assert [int(q2.popleft().seq_id) for _ in range(2)] == [0, 4] and not q2
    with pytest.raises(IndexError):
        q2.popleft()


def _finish_first(s: Scheduler, n: dict[int, int]) -> None:
    """Run the scheduler's running rows as if row i stopped after n[i] tokens (EOS)."""
    while s.has_work:
        plan = s.schedule()
        for item in plan.scheduled:
            q = item.seq
            q.num_computed += item.num_new
            if item.samples:
                q.output_ids.append(7)
                if len(q.output_ids) >= n[int(q.seq_id)]:
                    q.finish("stop")
                    s.release(q)


def test_scheduler_learns_from_finished_rows_and_admits_the_longest_first() -> None:
    group = {}
    s = Scheduler(SchedulerConfig(max_num_seqs=4, admission="length"), BlockAllocator(256, 16),
                  group_of=lambda q: group[int(q.seq_id)])
    assert s.lengths is not None
    s.lengths.config = PredictorConfig(min_finished=8, min_group=2, window=32)
    lengths = {}
    i = 0
    for _ in range(4):  # learning rounds: 2 rows of each group per batch
        for g, n in (("short", 2), ("long", 12), ("short", 2), ("long", 12)):
            group[i], lengths[i] = g, n
            s.add(seq(i))
            i += 1
        _finish_first(s, lengths)
    assert s.lengths.finished == 16 and s.lengths.confident
    arrivals = []
    for g in ("short", "short", "long", "short", "long"):
        group[i], lengths[i] = g, 1
        arrivals.append(i)
        s.add(seq(i))
        i += 1
    plan = s.schedule()
    admitted = [int(item.seq.seq_id) for item in plan.scheduled]
    assert [group[a] for a in admitted] == ["long", "long", "short", "short"]
    assert admitted == [arrivals[2], arrivals[4], arrivals[0], arrivals[1]]


def test_an_unfinished_row_teaches_nothing() -> None:
    s = Scheduler(SchedulerConfig(admission="length"), BlockAllocator(64, 16))
    r = seq(0)
    s.add(r)
    s.schedule()
    s.release(r)  # suspended (migrated), not finished
    assert s.lengths is not None and s.lengths.finished == 0
    r2 = seq(1)
    s.add(r2)
    s.schedule()
    r2.output_ids.extend([7, 7, 7])
    r2.transition(SeqStatus.FINISHED, "finish:stop")
    r2.finish_reason = "stop"
    s.release(r2)
    assert s.lengths.finished == 1 and s.lengths.pooled.mean == 3


def test_length_admission_without_predictions_is_the_fifo_scheduler() -> None:
    """Until predictions are used, "length" admission makes the fifo scheduler's decisions."""
    plans = []
    for admission in ("fifo", "length"):
        s = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, admission=admission),
                      BlockAllocator(12, 16))
        for i in range(8):
            s.add(seq(i, prompt_len=5 + 3 * i, max_tokens=20 + i))
        trace = []
        while s.has_work:
            plan = s.schedule()
            trace.append(([(int(x.seq.seq_id), x.num_new) for x in plan.scheduled],
                          [int(e.seq.seq_id) for e in plan.evicted]))
            for item in plan.scheduled:
                item.seq.num_computed += item.num_new
                if item.samples:
                    item.seq.output_ids.append(7)
                    if len(item.seq.output_ids) >= item.seq.params.max_tokens:
                        item.seq.finish("length")
                        s.release(item.seq)
        plans.append(trace)
    assert plans[0] == plans[1] and len(plans[0]) > 20


def test_a_long_stream_keeps_order_and_drops_what_it_served() -> None:
    """Rows taken through one order leave the other too (compacted), and the order holds across."""
    p = taught()
    groups: dict[int, str] = {}
    q = LengthOrderedQueue(p, lambda s: groups[int(s.seq_id)])
    served: list[int] = []
    for i in range(3000):
        groups[i] = "b" if i % 3 == 0 else "a"
        q.append(seq(i))
        if i % 2:
            served.append(int(q.popleft().seq_id))
    while q:
        served.append(int(q.popleft().seq_id))
    assert sorted(served) == list(range(3000))
    long_rows = [i for i in served[:1000] if groups[i] == "b"]
    assert long_rows == sorted(long_rows)  # arrival order within a lane
    # while waiting rows of group b remain, none of group a is served before them
    for k, i in enumerate(served):
        if groups[i] == "a":
            assert all(groups[j] == "a" for j in served[k:] if j < i), i
            break
    assert len(q._today) == 0 and sum(len(rows) for rows in q._lanes.values()) == 0  # noqa: SLF001
    q2 = LengthOrderedQueue(p, lambda s: groups[int(s.seq_id)])
    for i in range(3000):
        q2.append(seq(i))
    for _ in range(2500):
        q2.popleft()
    assert len(q2) == 500 == len(list(q2)) and len(q2._today) <= 500 + 1024  # noqa: SLF001
