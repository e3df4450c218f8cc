"""The torch-free scheduling core: block allocator, scheduler, micro-batching, cost model."""
from __future__ import annotations

import subprocess
import sys

import pytest

from batchgen.runtime.kv_cache import BlockAllocator
from batchgen.runtime.policy import (
    Scheduler,
    SchedulerConfig,
    prefer_transfer,
    split_micro_batches,
)
from batchgen.runtime.sequence import SeqId, SeqStatus, Sequence
from batchgen.sampling_params import SamplingParams


def seq(i: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(SeqId(i), i, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), seed=i)


def run_forward(plan) -> None:
    """What the executor and sampler do to the bookkeeping: compute, then append a token."""
    for item in plan.scheduled:
        samples = item.samples
        item.seq.num_computed += item.num_new
        if samples:
            item.seq.output_ids.append(7)


def test_scheduling_core_imports_no_torch() -> None:
    code = ("import sys, batchgen.runtime.policy, batchgen.runtime.sequence, batchgen.runtime.kv_cache, "
            "batchgen.sampling_params; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocator_hands_out_and_takes_back() -> None:
    alloc = BlockAllocator(4, 16)
    a = alloc.allocate(3)
    assert len(set(a)) == 3 and alloc.num_free == 1
    assert alloc.extra_blocks(have=1, num_tokens=33) == 2
    with pytest.raises(RuntimeError, match="exhausted"):
        alloc.allocate(2)
    alloc.free(a)
    assert alloc.num_free == 4


def test_prompts_are_chunked_by_token_budget_and_decode_continues() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10), BlockAllocator(32, 4))
    for i, n in enumerate([6, 9]):
        sched.add(seq(i, n))
    plan = sched.schedule()
    assert [(s.seq.seq_id, s.num_new, s.samples) for s in plan.scheduled] == [(0, 6, True), (1, 4, False)]
    run_forward(plan)
    plan = sched.schedule()
    assert [(s.seq.seq_id, s.num_new, s.samples) for s in plan.scheduled] == [(0, 1, True), (1, 5, True)]


def test_full_pool_evicts_the_newest_and_never_hangs() -> None:
    alloc = BlockAllocator(4, 4)  # 16 tokens in all
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), alloc)
    a, b = seq(0, 7, max_tokens=9), seq(1, 7, max_tokens=9)
    sched.add(a), sched.add(b)
    evictions = 0
    for _ in range(200):
        plan = sched.schedule()
        evictions += len(plan.evicted)
        assert alloc.num_free >= 0
        run_forward(plan)
        for s in list(sched.running):
            if len(s.output_ids) >= 9:
                s.finish("length")
                sched.release(s)
        if not sched.has_work:
            break
    assert not sched.has_work and evictions >= 1
    assert len(a.output_ids) == 9 and len(b.output_ids) == 9
    assert alloc.num_free == 4


@pytest.mark.parametrize("policy, expected", [("newest", 2), ("fewest_computed", 1), ("most_remaining", 0)])
def test_victim_choice_follows_policy(policy: str, expected: int) -> None:
    alloc = BlockAllocator(6, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, eviction=policy), alloc)  # type: ignore[arg-type]
    seqs = [seq(0, 4, max_tokens=100), seq(1, 3, max_tokens=2), seq(2, 4, max_tokens=3)]
    for s in seqs:
        sched.add(s)
    run_forward(sched.schedule())  # 3 blocks used, each sequence needs a 2nd block soon
    seqs[0].output_ids += [7] * 12  # seq 0 grows past the free blocks: someone must go
    plan = sched.schedule()
    assert [e.seq.seq_id for e in plan.evicted][0] == expected
    victim = plan.evicted[0].seq
    assert victim.status is SeqStatus.WAITING and victim.num_computed == 0 and victim.num_preemptions == 1


def test_micro_batches_respect_the_kv_budget_and_keep_order() -> None:
    sched = Scheduler(SchedulerConfig(), BlockAllocator(64, 16))
    for i, n in enumerate([30, 30, 30, 100, 10]):
        sched.add(seq(i, n))
    groups = split_micro_batches(sched.schedule().scheduled, kv_token_budget=64)
    assert [[s.seq.seq_id for s in g] for g in groups] == [[0, 1], [2], [3], [4]]
    assert split_micro_batches([], 64) == []


def test_transfer_cost_model() -> None:
    assert prefer_transfer(1000, kv_bytes=1_000_000, link_bytes_per_s=1e9, recompute_tokens_per_s=1000)
    assert not prefer_transfer(10, kv_bytes=10_000_000_000, link_bytes_per_s=1e9, recompute_tokens_per_s=1000)
    assert not prefer_transfer(0, 0, 1e9, 1000)


def test_admission_leaves_the_watermark_free_so_the_batch_does_not_thrash() -> None:
    """A row admitted into the pool's last blocks is evicted by the running rows' next blocks:
    admission keeps int(watermark * blocks) free while a batch runs (vLLM's watermark)."""
    def admitted(watermark: float) -> list[int]:
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, watermark=watermark),
                          BlockAllocator(200, 4))  # 800 tokens; 0.1 -> 20 blocks kept free
        sched.add(seq(0, 400, max_tokens=64))
        run_forward(sched.schedule())  # 100 blocks
        sched.add(seq(1, 380, max_tokens=64))  # 95 more: 5 left
        return [int(s.seq.seq_id) for s in sched.schedule().scheduled]

    assert admitted(0.0) == [0, 1]
    assert admitted(0.1) == [0]
    # an empty batch admits into any room (the watermark never starves the engine)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, watermark=0.1),
                      BlockAllocator(200, 4))
    sched.add(seq(0, 790))
    assert [s.num_new for s in sched.schedule().scheduled] == [790]
    with pytest.raises(ValueError, match="watermark"):
        SchedulerConfig(watermark=1.0)


@pytest.mark.parametrize("admission", ["fifo", "length"])
def test_release_running_by_position_is_release_of_each(admission: str) -> None:
    """Releasing running rows by position leaves the scheduler as releasing each in turn: the
    same running list (the same list object), free blocks and learned lengths."""
    def started() -> Scheduler:
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, admission=admission),
                          BlockAllocator(64, 4))
        for i in range(6):
            sched.add(seq(i, 3 + i))
        run_forward(sched.schedule())
        for s in sched.running[1::2]:
            s.finish("stop")
        return sched

    one_by_one, by_position = started(), started()
    before = by_position.running
    for s in [s for s in one_by_one.running if s.is_finished]:
        one_by_one.release(s)
    by_position.release_running([i for i, s in enumerate(by_position.running) if s.is_finished])
    assert by_position.running is before
    assert [s.seq_id for s in by_position.running] == [s.seq_id for s in one_by_one.running] == [0, 2, 4]
    assert by_position.allocator.num_free == one_by_one.allocator.num_free > started().allocator.num_free
    if admission == "length":
        assert by_position.lengths.finished == one_by_one.lengths.finished == 3
        assert by_position.lengths.version == one_by_one.lengths.version
    with pytest.raises(ValueError, match="ascending positions"):
        by_position.release_running([1, 0])
    with pytest.raises(ValueError, match="ascending positions"):
        by_position.release_running([3])
    assert [s.seq_id for s in by_position.running] == [0, 2, 4]  # nothing released
