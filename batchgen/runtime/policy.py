"""Scheduling policy: which coroutines run in the next forward, and who is evicted. No torch.

State in (waiting/running coroutines, free KV blocks), decisions out (a Plan). The engine, the
cluster simulator and the Dask scheduler plugin all drive this same code.
"""
from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from ..policy.length_prediction import LengthPredictor
from .kv_cache import BlockAllocator
from .length_order import GroupOf, LengthOrderedQueue, no_group, row_key
from .prefix_cache import PrefixCache
from .prefix_order import PrefixOrderedQueue
from .sequence import SeqStatus, Sequence

Eviction = Literal["newest", "fewest_computed", "most_remaining"]
Admission = Literal["prefix", "fifo", "length"]
# Admissions one step may put off while their prefix is being computed; past it, admission waits.
MAX_DEFERRED = 256


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # newest: vLLM's choice (last admitted, least progress lost); fewest_computed: cheapest to
    # recompute; most_remaining: the one that would hold its blocks longest
    eviction: Eviction = "newest"
    # with a prefix cache: "prefix" admits waiting rows grouped by shared prefix (prefix_order.py),
    # "fifo" in arrival order; without one, arrival order. "length": the rows predicted longest
    # first, learned from the rows that finish here (length_order.py; until the predictions beat
    # the pooled mean, the order "prefix" would give: prefix order with a cache, else arrival)
    admission: Admission = "prefix"
    # Share of the pool an admission leaves free (vLLM's `watermark`): a row admitted into the
    # last free blocks is evicted again by the running rows' next blocks, and re-admitted, and
    # evicted (the simulator saw rows evicted up to 13 times each). int(watermark * blocks):
    # 0 for pools under 100 blocks.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        if self.eviction not in ("newest", "fewest_computed", "most_remaining"):
            raise ValueError(f"unknown eviction policy {self.eviction!r}")
        if self.admission not in ("prefix", "fifo", "length"):
            raise ValueError(f"unknown admission order {self.admission!r}")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens fed this forward, starting at seq.num_computed

    @property
    def samples(self) -> bool:
        """Does this forward reach the sequence's last token (so a new token is sampled)?"""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


@dataclass(slots=True)
class Evicted:
    """A sequence pushed out of the pool this step; its KV still sits in `blocks` until the
    next forward writes there, so the engine may copy it to host memory first."""

    seq: Sequence
    blocks: list[int]
    num_computed: int


@dataclass(slots=True)
class Plan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    evicted: list[Evicted] = field(default_factory=list)
    swapped_in: list[Sequence] = field(default_factory=list)  # need their host KV written back

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)

    def __bool__(self) -> bool:
        """A plan with evictions only (nothing to run) is empty."""
        return bool(self.scheduled)


def pick_victim(candidates: list[Sequence], eviction: Eviction) -> Sequence:
    """candidates are in admission order."""
    if eviction == "newest":
        return candidates[-1]
    if eviction == "fewest_computed":
        return min(reversed(candidates), key=lambda s: s.num_computed)
    return max(reversed(candidates), key=lambda s: s.remaining_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator,
                 prefix_cache: PrefixCache | None = None, group_of: GroupOf = no_group) -> None:
        """prefix_cache: reuse cached full blocks at admission (None: every row computes all).
        group_of: a row's group for length-aware admission (None: its prompt-length bucket)."""
        self.config, self.allocator, self.cache = config, allocator, prefix_cache
        self.group_of = group_of
        self.lengths: LengthPredictor | None = None  # learns from finished rows ("length" admission)
        self.waiting: deque[Sequence] | PrefixOrderedQueue | LengthOrderedQueue = deque()
        if config.admission == "length":  # today's order (prefix with a cache) until predictions are used
            self.lengths = LengthPredictor()
            today = PrefixOrderedQueue(prefix_cache.sort_key) if prefix_cache is not None else None
            self.waiting = LengthOrderedQueue(self.lengths, group_of, today)
        elif prefix_cache is not None and config.admission == "prefix":
            self.waiting = PrefixOrderedQueue(prefix_cache.sort_key)
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, seq: Sequence) -> None:
        """A finished (or removed) sequence gives its blocks back at once (cached ones stay
        findable until the pool needs them)."""
        try:  # one scan of the running list, not a membership test and then a removal
            self.running.remove(seq)
        except ValueError:
            if seq in self.waiting:
                self.waiting.remove(seq)
        self._give_back(seq)

    def release_running(self, positions: list[int]) -> None:
        """`release` of the running rows at `positions` (ascending), in that order, deleting
        them from the running list by position: no scan, and no other row touched (the
        simulator finishes rows of 128 engines' batches this way)."""
        running = self.running
        if positions and (positions[0] < 0 or positions[-1] >= len(running)
                          or not all(map(operator.lt, positions, positions[1:]))):  # (half a generator's time)
            raise ValueError(f"release_running needs ascending positions in 0..{len(running) - 1}, got {positions}")
        seqs = [running[i] for i in positions]
        for i in reversed(positions):
            del running[i]
        for seq in seqs:
            self._give_back(seq)

    def _give_back(self, seq: Sequence) -> None:
        """What `release` does after taking seq out of its queue."""
        if self.cache is not None:
            self.cache.register(seq)
        if self.lengths is not None and seq.is_finished and seq.finish_reason in ("stop", "length"):
            self.lengths.observe(row_key(seq, self.group_of), len(seq.output_ids))
        self.allocator.free(seq.drop_kv())

    def evict(self, seq: Sequence, reason: str) -> Evicted:
        self.running.remove(seq)
        if self.cache is not None:  # its recompute may find its own blocks still cached
            self.cache.register(seq)
        computed = seq.num_computed
        blocks = seq.drop_kv()
        self.allocator.free(blocks)
        seq.num_preemptions += 1
        seq.transition(SeqStatus.WAITING, reason)
        self.waiting.appendleft(seq)
        return Evicted(seq, blocks, computed)

    def schedule(self, lookahead: int = 1) -> Plan:
        """The next forward. lookahead k > 1 (vLLM's lookahead slots, multi-step scheduling):
        every running sequence that samples in this forward also gets KV blocks for its next
        k - 1 decode steps (at most its remaining_tokens), evicting now what those steps would
        evict, so k forwards of the same batch can follow without another decision. The engine
        uses 1; the simulator plans decode slices of k steps with it."""
        plan = Plan()
        budget = self._schedule_running(plan, lookahead)
        if not plan.evicted:  # after an eviction, admitting now would only thrash the pool
            self.admit(plan, budget)
        return plan

    def _schedule_running(self, plan: Plan, lookahead: int) -> int:
        """The running rows' part of `schedule`: each in order feeds what it has left (within
        the token budget) and gets its blocks, evicting when the pool runs out. Returns the
        budget left. (sim/batch.py computes this loop in closed form; tests/sim/test_sim_batch.py
        holds the two equal.)"""
        budget = self.config.max_num_batched_tokens
        cache = self.cache
        if cache is not None:  # the last forward filled these blocks: shareable from now on
            for seq in self.running:
                cache.register(seq)
        alloc, running, ahead = self.allocator, self.running, lookahead - 1
        bs = alloc.block_size
        scheduled, can_allocate, allocate = plan.scheduled, alloc.can_allocate, alloc.allocate
        i, num_running = 0, len(running)
        while i < num_running and budget > 0:
            seq = running[i]
            # Sequence.num_tokens / remaining_tokens inlined, names bound locally: this loop
            # visits every running row each forward (and each simulated slice)
            computed, out = seq.num_computed, len(seq.output_ids)
            uncomputed = len(seq.prompt_ids) + out - computed
            if uncomputed < budget:
                n = uncomputed
                end = computed + n
                if ahead > 0:
                    later = seq.params.max_tokens - out - 1  # tokens it may still feed after this one
                    if later > 0:
                        end += ahead if ahead < later else later
            else:
                n = budget
                end = computed + n
                if ahead > 0 and n == uncomputed:
                    later = seq.params.max_tokens - out - 1
                    if later > 0:
                        end += ahead if ahead < later else later
            need = -(-end // bs) - len(seq.block_ids)
            if need > 0:  # most decode steps need no new block: skip the pool entirely (hot loop)
                while not can_allocate(need):
                    unscheduled = running[i:]
                    victim = pick_victim(unscheduled, self.config.eviction) if len(unscheduled) > 1 else seq
                    plan.evicted.append(self.evict(victim, "evict:kv-pool-full"))
                    num_running -= 1
                    if victim is seq:
                        break
                if seq.status is not SeqStatus.RUNNING:
                    continue
                seq.block_ids += allocate(need)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        return budget

    def admit(self, plan: Plan, budget: int) -> None:
        """The waiting rows' part of `schedule`: admit them in queue order into `plan` while
        seats, `budget` tokens and the pool (less its watermark) allow."""
        cache = self.cache
        alloc = self.allocator
        pending = self._pending(plan) if cache is not None and self.waiting else set()
        deferred: list[Sequence] = []
        headroom = int(self.config.watermark * alloc.num_blocks)  # free blocks an admission leaves
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            restored = seq.num_swapped  # tokens whose KV comes back from host memory
            hits: list[int] = []
            if cache is not None and not restored:
                hits = cache.match(seq)
                if pending and cache.waits_for(seq, len(hits), pending):
                    if len(deferred) == MAX_DEFERRED:
                        break
                    deferred.append(self.waiting.popleft())
                    cache.stats.deferred += 1
                    continue
            if deferred:  # rows behind them would start other prefixes beside this one: next step
                break
            computed = restored or len(hits) * self.allocator.block_size
            n = min(seq.num_tokens - computed, budget)
            need = self.allocator.extra_blocks(len(hits), computed + n)
            if not self.allocator.can_allocate(need + self.allocator.num_idle(hits)
                                               + (headroom if self.running else 0)):
                break  # (an empty batch admits into any room: the watermark must not starve it)
            self.waiting.popleft()
            if cache is not None and not restored:
                self.allocator.share(hits)
                seq.block_ids, seq.num_computed, seq.num_registered_blocks = hits, computed, len(hits)
                cache.admitted(seq, computed)
            seq.block_ids += self.allocator.allocate(need)
            if restored:
                seq.num_computed, seq.num_swapped = restored, 0
                plan.swapped_in.append(seq)
            if cache is not None and self.waiting:
                pending.update(cache.completing(seq, n))
            seq.transition(SeqStatus.RUNNING, "admit:swap-in" if restored else "admit")
            self.running.append(seq)
            plan.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        for seq in reversed(deferred):  # first in line next step, in their order
            self.waiting.appendleft(seq)

    def _pending(self, plan: Plan) -> set[bytes]:
        """Hashes of the blocks this plan's forward fills (not shareable before it ends)."""
        assert self.cache is not None
        out: set[bytes] = set()
        for item in plan.scheduled:
            out.update(self.cache.completing(item.seq, item.num_new))
        return out


def split_micro_batches(scheduled: list[ScheduledSeq], kv_token_budget: int | None) -> list[list[ScheduledSeq]]:
    """Pack a forward into attention micro-batches of at most kv_token_budget KV tokens each.

    A sequence's attention touches its whole context (num_computed + num_new tokens). A sequence
    larger than the budget alone gets a micro-batch of its own. Order is kept.
    """
    if kv_token_budget is None:
        return [scheduled] if scheduled else []
    groups: list[list[ScheduledSeq]] = []
    current: list[ScheduledSeq] = []
    used = 0
    for item in scheduled:
        kv = item.seq.num_computed + item.num_new
        if current and used + kv > kv_token_budget:
            groups.append(current)
            current, used = [], 0
        current.append(item)
        used += kv
    if current:
        groups.append(current)
    return groups


def prefer_transfer(num_tokens: int, kv_bytes: int, link_bytes_per_s: float, recompute_tokens_per_s: float) -> bool:
    """Move a coroutine's KV (to host memory, or to another engine) rather than recompute it?

    Compares the time to move kv_bytes over the link with the time to recompute num_tokens at
    the engine's measured rate; with nothing measured yet, moving wins (it is at worst a copy).
    """
    if num_tokens == 0:
        return False
    if recompute_tokens_per_s <= 0:
        return True
    return kv_bytes / link_bytes_per_s < num_tokens / recompute_tokens_per_s
