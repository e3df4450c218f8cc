"""Prefix caching's torch-free core: refcounted blocks, chain hashes, LRU eviction, admission."""
from __future__ import annotations

import subprocess
import sys

import pytest

from batchgen.runtime.kv_cache import BlockAllocator
from batchgen.runtime.policy import Scheduler, SchedulerConfig
from batchgen.runtime.prefix_cache import PrefixCache
from batchgen.runtime.prefix_order import PrefixOrderedQueue
from batchgen.runtime.sequence import SeqId, Sequence
from batchgen.sampling_params import SamplingParams

BS = 4


def seq(i: int, tokens: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(SeqId(i), i, list(tokens), SamplingParams(max_tokens=max_tokens), seed=i)


def scheduler(num_blocks: int = 64, budget: int = 256, admission: str = "fifo",
              max_num_seqs: int = 16) -> Scheduler:
    alloc = BlockAllocator(num_blocks, BS)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     admission=admission),  # type: ignore[arg-type]
                     alloc, PrefixCache(alloc))


def run_forward(sched: Scheduler, plan) -> None:
    """What the executor does to the bookkeeping, checking every written slot is private."""
    alloc = sched.allocator
    for item in plan.scheduled:
        s = item.seq
        for pos in range(s.num_computed, s.num_computed + item.num_new):
            block = s.block_ids[pos // BS]
            assert alloc.ref_count(block) == 1, f"seq {s.seq_id} writes shared block {block}"
            assert block not in alloc._hash_of, f"seq {s.seq_id} writes cached block {block}"
    for item in plan.scheduled:
        samples = item.samples
        item.seq.num_computed += item.num_new
        if samples:
            item.seq.output_ids.append(900 + int(item.seq.seq_id))


def finish(sched: Scheduler, s: Sequence) -> None:
    sched.release(s)


PREFIX = list(range(100, 112))  # 3 blocks of 4


def test_core_imports_no_torch() -> None:
    code = ("import sys, batchgen.runtime.prefix_cache, batchgen.runtime.prefix_order, batchgen.runtime.policy; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_chain_hash_covers_every_token_before() -> None:
    cache = PrefixCache(BlockAllocator(8, BS))
    a, b, c = seq(0, PREFIX + [1]), seq(1, PREFIX + [2]), seq(2, [999] + PREFIX[1:] + [1])
    ha, hb, hc = (cache.hashes(s, 3) for s in (a, b, c))
    assert ha == hb  # same first 12 tokens, whatever follows
    assert all(x != y for x, y in zip(ha, hc))  # one token differs in block 0: every later block differs
    assert len(set(ha)) == 3 and all(len(h) == 16 for h in ha)
    other = PrefixCache(BlockAllocator(8, BS), salt=b"adapter-1")
    assert other.hashes(seq(3, PREFIX + [1]), 3)[0] != ha[0]


def test_second_row_hits_exactly_the_three_prefix_blocks() -> None:
    sched = scheduler()
    first = seq(0, PREFIX + [1, 2])
    sched.add(first)
    run_forward(sched, sched.schedule())
    second = seq(1, PREFIX + [7, 8, 9])
    sched.add(second)
    plan = sched.schedule()
    assert second.num_cached_tokens == 12 and second.block_ids[:3] == first.block_ids[:3]
    item = next(i for i in plan.scheduled if i.seq is second)
    assert item.num_new == 3 and second.num_computed == 12
    assert [sched.allocator.ref_count(b) for b in first.block_ids[:3]] == [2, 2, 2]
    assert sched.cache.stats.hits == 12 and sched.cache.stats.queries == 14 + 15


def test_a_full_hit_still_computes_the_last_token() -> None:
    sched = scheduler()
    a = seq(0, PREFIX)
    sched.add(a)
    run_forward(sched, sched.schedule())
    run_forward(sched, sched.schedule())  # decode fills nothing new; a's 3 blocks are registered
    b = seq(1, PREFIX)  # the very same 12 tokens
    sched.add(b)
    plan = sched.schedule()
    item = next(i for i in plan.scheduled if i.seq is b)
    assert b.num_cached_tokens == 8 and item.num_new == 4 and item.samples
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]


def test_a_block_being_written_is_not_shared_until_its_forward_ends() -> None:
    sched = scheduler()
    a, b = seq(0, PREFIX + [1]), seq(1, PREFIX + [2])
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [i.seq for i in plan.scheduled] == [a]  # b waits a step rather than compute the prefix too
    assert sched.cache.stats.deferred == 1
    run_forward(sched, plan)
    plan = sched.schedule()
    assert b.num_cached_tokens == 12 and b.block_ids[:3] == a.block_ids[:3]
    run_forward(sched, plan)


def test_a_finished_rows_blocks_stay_cached_and_freed_cached_blocks_are_evicted_lru() -> None:
    sched = scheduler(num_blocks=8)
    alloc = sched.allocator
    rows = {}
    for i, first in enumerate((100, 200)):  # two distinct 2-block prefixes, A then B
        s = seq(i, list(range(first, first + 8)) + [1], max_tokens=1)
        sched.add(s)
        run_forward(sched, sched.schedule())
        rows[first] = s.block_ids[:2]
        finish(sched, s)
    assert alloc.num_free == 8 and alloc.num_cached == 4
    taken = alloc.allocate(4)  # the 4 plain free blocks go first
    assert not set(taken) & set(rows[100] + rows[200]) and alloc.num_cached == 4
    alloc.allocate(2)  # now A's blocks, freed first, are evicted; B's survive
    assert alloc.num_cached == 2 and alloc.evicted == 2
    assert alloc.lookup(PrefixCache(alloc).hashes(seq(9, list(range(200, 209))), 2)) == rows[200]
    assert alloc.lookup(PrefixCache(alloc).hashes(seq(9, list(range(100, 109))), 2)) == []


def test_a_shared_block_is_never_freed_while_held() -> None:
    sched = scheduler(num_blocks=10)
    alloc = sched.allocator
    a = seq(0, PREFIX + [1], max_tokens=8)
    sched.add(a)
    run_forward(sched, sched.schedule())
    b = seq(1, PREFIX + [2], max_tokens=8)
    sched.add(b)
    run_forward(sched, sched.schedule())
    shared = a.block_ids[:3]
    assert b.block_ids[:3] == shared
    finish(sched, a)  # a leaves; b still holds the prefix
    assert [alloc.ref_count(x) for x in shared] == [1, 1, 1]
    grabbed = alloc.allocate(alloc.num_free)  # take every block the pool would give away
    assert not set(grabbed) & set(shared)
    alloc.free(grabbed)
    for _ in range(3):  # b decodes on into its own blocks only (run_forward checks each write)
        run_forward(sched, sched.schedule())
    with pytest.raises(RuntimeError, match="freed more often"):
        alloc.free([grabbed[0]])


def test_preempted_row_recomputes_from_its_own_cached_blocks() -> None:
    sched = scheduler(num_blocks=64)
    a = seq(0, PREFIX + [1, 2, 3, 4, 5], max_tokens=12)
    sched.add(a)
    for _ in range(6):
        run_forward(sched, sched.schedule())
    tokens, computed = a.token_ids, a.num_computed
    sched.evict(a, "test")
    assert a.num_computed == 0 and not a.block_ids
    plan = sched.schedule()
    assert a.num_computed == (computed // BS) * BS and a.token_ids == tokens  # generated blocks hit too
    assert sched.cache.stats.hits == (computed // BS) * BS
    run_forward(sched, plan)


def test_registering_content_cached_elsewhere_keeps_the_block_private() -> None:
    alloc = BlockAllocator(4, BS)
    x, y = alloc.allocate(2)
    assert alloc.register(x, b"h" * 16) and not alloc.register(y, b"h" * 16)
    alloc.free([x, y])
    assert alloc.num_free == 4 and alloc.lookup([b"h" * 16]) == [x]
    with pytest.raises(RuntimeError, match="nobody holds"):
        alloc.register(y, b"g" * 16)


def test_cache_off_scheduler_is_unchanged() -> None:
    alloc = BlockAllocator(32, BS)
    sched = Scheduler(SchedulerConfig(), alloc)
    a, b = seq(0, PREFIX + [1]), seq(1, PREFIX + [2])
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [i.num_new for i in plan.scheduled] == [13, 13] and alloc.num_cached == 0


def groups_of(order: list[Sequence]) -> list[int]:
    return [s.prompt_ids[0] // 100 for s in order]


def interleaved(n: int, k: int) -> list[Sequence]:
    """Row i opens with instruction i % k (2 blocks), then 3 tokens of its own."""
    return [seq(i, [100 * (i % k + 1)] * 8 + [i, i, i]) for i in range(n)]


def test_prefix_order_groups_interleaved_rows_and_alternates_direction() -> None:
    cache = PrefixCache(BlockAllocator(8, BS))
    q = PrefixOrderedQueue(cache.sort_key)
    rows = interleaved(12, 3)
    for s in rows:
        q.append(s)
    first = [q.popleft() for _ in range(6)]
    late = interleaved(6, 3)
    for s in late:  # arrive mid-epoch: they wait for the next one
        q.append(s)
    rest = [q.popleft() for _ in range(6)]
    g = groups_of(first + rest)
    assert [g[i] for i in range(0, 12, 4)] == [g[i + 3] for i in range(0, 12, 4)]  # 3 runs of 4
    assert len(set(g)) == 3 and all(s in rows for s in first + rest)
    assert [s.seq_id for s in first + rest if groups_of([s])[0] == g[0]] == sorted(
        s.seq_id for s in rows if groups_of([s])[0] == g[0])  # arrival order within a group
    second = [q.popleft() for _ in range(6)]
    assert all(s in late for s in second) and q.epochs == 2 and not q
    assert groups_of(second)[0] == g[-1]  # the next epoch starts with the group just admitted


def test_prefix_order_puts_rows_put_back_first_and_supports_deque_ops() -> None:
    cache = PrefixCache(BlockAllocator(8, BS))
    q = PrefixOrderedQueue(cache.sort_key)
    rows = interleaved(4, 2)
    for s in rows:
        q.append(s)
    head = q.popleft()
    q.appendleft(head)
    assert q[0] is head and len(q) == 4 and head in q
    q.remove(rows[3])
    assert rows[3] not in q and len(list(q)) == 3
    with pytest.raises(ValueError):
        q.remove(rows[3])
    with pytest.raises(IndexError):
        _ = q[1]


def test_prefix_admission_runs_one_group_while_fifo_interleaves() -> None:
    for admission, distinct in (("prefix", 1), ("fifo", 3)):
        sched = scheduler(num_blocks=128, budget=1000, admission=admission, max_num_seqs=4)
        for s in interleaved(12, 3):
            sched.add(s)
        plan = sched.schedule()  # one leader computes its prefix; same-prefix rows wait a step
        run_forward(sched, plan)
        plan = sched.schedule()
        running = [groups_of([s])[0] for s in sched.running]
        assert len(set(running)) == distinct, (admission, running)
