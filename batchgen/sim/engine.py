"""A simulated engine: the runtime's own Scheduler (and its allocator, counting blocks), with a cost
model for time.

Every scheduling decision is `Scheduler.schedule()`'s (admission, chunked prefill, eviction by
the configured policy) on real `Sequence` objects whose token lists are `range`s: the policy
reads only lengths. The running rows' counters are held in arrays between decisions
(batch.py), and a decision computes the scheduler's loop over them in closed form, its
admissions and evictions the scheduler's own `admit` and `evict` (decision.py). Between decisions the engine advances in
slices:

- a forward that prefills, swaps in, or leaves a running sequence out is one step, as planned;
- a pure decode forward is extended to k steps at once, in closed form (slices.py: numpy over
  the batch). Within those k steps nothing the policy reads changes its answer: no eviction (k
  is cut where the KV pool would run out), no admission (the pool only fills, the seat count is
  fixed), no arrival (a slice ends at the first forward past a pending arrival, and an order
  from the cluster cuts it). So k calls of `schedule()` would return the same plans;
  tests/sim/test_sim_engine.py checks this against the real calls.
  `exact` also cuts k at the first row that finishes. Otherwise (the default for fleet runs)
  rows that finish inside a slice give their seat and blocks back at its end: while rows wait
  for a seat (or a coroutine is due) a slice ends once `finish_fraction` of its batch has
  finished, and is at most `quantum_steps` long. Once the engine is `sealed` (no row will be
  added and no coroutine will arrive: static's engines, dynamic's once its batches are dealt) a
  slice with none waiting runs until its last row finishes or the pool runs out: with no row to
  admit, what a `schedule()` call between could change is only when the pool evicts (its step
  times are computed only as far as they are read: step_clock.py). An engine that may still get
  work keeps the 1/8 rule: there a call's fresh KV reservation changes the free blocks that later
  admissions and arrivals see. Its decision is
  `schedule(lookahead=k)`, which gives every row the KV of the whole slice up front (at most
  `reserve_fraction` of the pool) and evicts now what those steps would evict, so a KV-bound
  engine decides once a slice instead of each time its pool runs out. The tests bound the
  effect on completion time against the exact mode.

A slice is not cut at the cluster's ticks: the engine reports its load at a tick from the
slice's arrays (what closing it there would leave), and closes it there only when the cluster
acts on it (new rows, a suspend, an arriving coroutine).
"""
from __future__ import annotations

import collections.abc
import functools
import heapq
import math
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..policy.balance import MAX_REPORTED, CoroutineInfo, EngineLoad
from ..policy.speed import SpeedMeter
from ..runtime.policy import Plan, Scheduler, prefer_transfer
from ..runtime.sequence import SeqStatus, Sequence
from .batch import BLOCKS, COMPUTED, OUT, PROMPT, STOP_AT, IntArray, RunningBatch
from .blocks import BlockCounter
from .cost import CostModel, recompute_tokens_per_s
from .decision import schedule_batch
from .engine_config import EngineSimConfig
from .reports import ReportedMovable
from .seqs import SimRequest, row_group
from .slices import DecodeSlice
from .step_clock import StepClock
from .waiting import LengthWaitingQueue, WaitingQueue

# what a load report says that changes (shard.LOAD_FIELDS): waiting, running, remaining tokens,
# KV used, tokens/s, speed
LoadNumbers = tuple[int, int, int, float, float, float]


@dataclass(slots=True)
class Arrival:
    at: float
    seq: Sequence
    kv_tokens: int  # 0: it recomputes its KV here


class SimEngine:
    """One worker's engine for one model, on a simulated clock."""

    # the running rows' part of a decision in closed form (batch.py); False: every decision is a
    # Scheduler.schedule() call on the synced rows (the tests compare both)
    closed_form: bool = True

    def __init__(self, name: str, cost: CostModel, config: EngineSimConfig, device: str | None = None) -> None:
        """device: its class for the balancer (equal classes count as equally fast); default:
        one class for every engine of this cost model's kind (a simulated fleet shares one cost
        model; the name must not depend on the process, parallel.py runs engines in several)."""
        num_blocks = cost.kv_capacity_tokens // config.block_size
        if num_blocks < 1:
            raise PlanError(f"the KV pool holds {cost.kv_capacity_tokens} tokens: less than one block")
        self.name, self.cost, self.config = name, cost, config
        self.device = device or f"simulated {type(cost).__name__}"
        self.allocator = BlockCounter(num_blocks, config.block_size)
        self.scheduler = Scheduler(config.scheduler_config(), self.allocator, group_of=row_group)
        lengths = self.scheduler.lengths
        self.waiting: WaitingQueue | LengthWaitingQueue = WaitingQueue() if lengths is None else \
            LengthWaitingQueue(lengths, row_group)
        self.scheduler.waiting = self.waiting
        self.now = 0.0
        self.generated = 0
        self.busy_s = 0.0
        self.meter = SpeedMeter(0.0)
        self.timeline: list[tuple[float, float, int]] = []  # (start, end, tokens generated) of busy slices
        self.finished: list[tuple[int, float]] = []  # (row, time)
        self.errors: list[tuple[int, str]] = []
        self.swapped_tokens = 0
        self.swap_space_tokens = config.swap_space_bytes // cost.kv_bytes_per_token
        self.preemptions = 0
        self.resumed = {"with-kv": 0, "kv-to-host": 0, "recompute": 0}  # how arriving coroutines resumed
        self.arrivals: list[tuple[float, int, Arrival]] = []
        self.recompute_rate = recompute_tokens_per_s(cost, config.max_num_batched_tokens)
        self.version = 0  # bumped by every change of state: a load report is reused until then
        self._report: tuple[tuple[int, float], LoadNumbers, collections.abc.Sequence[CoroutineInfo]] | None = None
        self._load: tuple[LoadNumbers, EngineLoad] | None = None  # (the report it was made from, it)
        self.slice: DecodeSlice | None = None  # a decode slice running past the last tick
        self.tick = 0.0  # the time the engine was last run to: where a report or a cut refers to
        self.sealed = False  # no row will be added and no coroutine will arrive (see the docstring)
        self.batch = RunningBatch([])  # the scheduler's running rows' counters (batch.py)

    # -- work in ----------------------------------------------------------------------------------
    def add(self, seq: Sequence, at: float = 0.0) -> None:
        """A new row, handed over at time `at` (an idle engine's clock waits until then)."""
        if self.sealed:
            raise PlanError(f"{self.name}: a row added to a sealed engine")
        self.cut()
        if not self.scheduler.has_work:
            self.now = max(self.now, at)
        self.scheduler.add(seq)
        self.version += 1

    def arrive(self, arrival: Arrival) -> None:
        if self.sealed:
            raise PlanError(f"{self.name}: a coroutine sent to a sealed engine")
        self.cut()
        heapq.heappush(self.arrivals, (arrival.at, int(arrival.seq.seq_id), arrival))
        self.version += 1

    @property
    def has_work(self) -> bool:
        return self.slice is not None or self.scheduler.has_work or bool(self.arrivals)

    def _take_arrivals(self) -> None:
        """Engine.resume's choices: straight into the batch with its KV when there is room, else
        wait in host memory, else recompute from the back of the queue."""
        while self.arrivals and self.arrivals[0][0] <= self.now:
            a = heapq.heappop(self.arrivals)[2]
            seq, n = a.seq, a.kv_tokens
            if n and self.allocator.can_allocate(self.allocator.extra_blocks(0, n + 1)) \
                    and len(self.scheduler.running) < self.config.max_num_seqs:
                seq.block_ids = self.allocator.allocate(self.allocator.extra_blocks(0, n))
                seq.num_computed = n
                seq.transition(SeqStatus.RUNNING, "resume:with-kv")
                self.scheduler.running.append(seq)
                self.batch.extend([seq])
                self.resumed["with-kv"] += 1
                continue
            if n and self.swapped_tokens + n <= self.swap_space_tokens:
                seq.num_swapped = n
                self.swapped_tokens += n
                seq.transition(SeqStatus.SWAPPED, "resume:kv-to-host")
                self.resumed["kv-to-host"] += 1
            else:
                seq.transition(SeqStatus.WAITING, "resume:recompute")
                self.resumed["recompute"] += int(n > 0 or len(seq.output_ids) > 0)  # started: its KV is lost
            seq.num_computed = 0
            self.scheduler.add(seq)

    # -- work out ---------------------------------------------------------------------------------
    def suspend(self, seq_ids: tuple[int, ...]) -> list[tuple[Sequence, int]]:
        """Take coroutines out at the yield point between forwards: [(seq, KV tokens it carries)]."""
        self.cut()
        self.batch.sync()
        wanted = set(seq_ids)
        self.version += 1
        picked = [s for s in list(self.scheduler.running) + list(self.scheduler.waiting) if int(s.seq_id) in wanted]
        out = []
        kv_bytes = self.cost.kv_bytes_per_token
        for seq in picked:
            n = seq.num_computed or seq.num_swapped
            carry = n if prefer_transfer(n, n * kv_bytes, self.cost.network_bytes_per_s, self.recompute_rate) else 0
            if seq.num_swapped:
                self.swapped_tokens -= seq.num_swapped
                seq.num_swapped = 0
            self.scheduler.release(seq)
            out.append((seq, carry))
        self.batch = RunningBatch(self.scheduler.running)
        return out

    def transfer_seconds(self, kv_tokens: int) -> float:
        return self.config.migration_latency_s + kv_tokens * self.cost.kv_bytes_per_token / self.cost.network_bytes_per_s

    def load(self) -> EngineLoad:
        """What the runner reports to the plugin (runner.py `_snapshot`), on simulated state: at
        the last tick, as closing a running slice there would leave it (`cut`). The same report
        as long as nothing changed since the last one (an idle engine)."""
        numbers, movable = self.report()
        if self._load is not None and self._load[0] is numbers:
            return self._load[1]
        waiting, running, remaining, kv_used, tokens_per_s, speed = numbers
        load = EngineLoad(self.name, "model", True, waiting, running, remaining, kv_used, tokens_per_s,
                          movable, speed, self.allocator.capacity_tokens,  # type: ignore[arg-type]
                          self.config.max_num_seqs, self.device)
        self._load = (numbers, load)
        return load

    def report(self) -> tuple[LoadNumbers, collections.abc.Sequence[CoroutineInfo]]:
        """`load`'s fields that change (shard.LOAD_FIELDS: waiting, running, remaining tokens,
        KV used, tokens/s, speed) and its movable coroutines, without an EngineLoad: a child
        process sends only the numbers (parallel.py), 128 engines a tick."""
        key = (self.version, self.tick if self.slice is not None else -1.0)
        if self._report is not None and self._report[0] == key:
            return self._report[1], self._report[2]
        # the runner lists waiting rows, then running ones, and keeps the first MAX_REPORTED of
        # a stable sort, not-started first; waiting rows are not started, so only their top
        # MAX_REPORTED can make it, and when there are that many no running row does
        top = self.waiting.most_remaining(MAX_REPORTED)
        free = self.allocator.num_free
        if self.slice is not None:
            running, remaining, taken, rows = self.slice.report(self.slice.position(self.tick))
            free -= taken
        else:
            b = self.batch
            running = len(b)
            left = b.remaining()  # a running row finishes (and leaves) once it reaches max_tokens
            remaining = int(left.sum())
            rows = functools.partial(_rows, b.ids, left, b.computed)  # (the batch's arrays are replaced, never written)
        movable = tuple(top) if len(top) >= MAX_REPORTED else ReportedMovable(top, rows, running)
        numbers = (len(self.waiting), running, self.waiting.remaining_tokens + remaining,
                   1 - free / self.allocator.num_blocks, self.meter.tokens_per_s, self.meter.speed)
        self._report = (key, numbers, movable)
        return numbers, movable

    def occupancy(self) -> tuple[int, int]:
        """(waiting, running) rows at the last tick, as `load` reports them."""
        piece = self.slice
        running = len(self.scheduler.running) if piece is None else \
            len(piece.c0) - piece.finished_by(piece.position(self.tick))
        return len(self.waiting), running

    # -- time -------------------------------------------------------------------------------------
    def run_until(self, t_end: float) -> None:
        """Advance to t_end (or a little past: a forward is not cut), or until out of work. A
        decode slice that runs past t_end stays open (`slice`) until its end or a `cut`."""
        self.tick = t_end
        if self.slice is not None:
            if self.slice.ends_after(t_end):
                return
            self._close(self.slice.k)
        while self.now < t_end:
            self.version += 1
            self._take_arrivals()
            if not self.scheduler.has_work:
                if not self.arrivals:  # idle: the clock stays at the last forward's end
                    break
                self.now = max(self.now, min(self.arrivals[0][0], t_end))
                continue
            start, generated = self.now, self.generated
            self.batch, fed, scheduled, plan = schedule_batch(self.batch, self.scheduler, self._lookahead(),
                                                              self.closed_form)
            self.preemptions += len(plan.evicted)
            extra = sum(self._swap_out(ev.seq, ev.num_computed) for ev in plan.evicted)
            if not len(fed) or (scheduled is not None and not scheduled.any()):  # nothing to run
                self._unblock()
                self.now += extra
            elif self._decode_only(fed, scheduled, plan):
                piece = self.slice = self._decode(extra)
                if piece.ends_after(t_end):
                    return
                self._close(piece.k)
                continue
            else:
                self._step(fed, scheduled, plan, extra)
            self._account(start, generated)

    def cut(self) -> None:
        """Close a running slice after the forward in flight at the last tick: the cluster is
        about to act on this engine's state."""
        if self.slice is not None:
            self._close(self.slice.position(self.tick))

    def settle(self) -> None:
        """`cut`, and write the running rows' counters into their Sequence objects: the state a
        caller reads off `scheduler` is then the runtime's."""
        self.cut()
        self.batch.sync()

    def _account(self, start: float, generated: int) -> None:
        self.busy_s += self.now - start
        if self.now > start:
            self.timeline.append((start, self.now, self.generated - generated))
        self.meter.observe(self.now, self.generated, len(self.scheduler.waiting))

    def _lookahead(self) -> int:
        """Coarse slices reserve KV for the coming slice up front (Scheduler.schedule's
        lookahead: one decision per slice instead of one each time the pool runs out), at most
        `reserve_fraction` of the pool over the batch; exact ones decide step by step."""
        if self.config.exact:
            return 1
        per_row = self.config.reserve_fraction * self.allocator.capacity_tokens / max(1, len(self.scheduler.running))
        return max(1, min(self.config.quantum_steps, int(per_row)))

    def _swap_out(self, seq: Sequence, num_computed: int) -> float:
        """Engine._maybe_swap_out: keep the KV in host memory when that beats recomputing it."""
        nbytes = num_computed * self.cost.kv_bytes_per_token
        if self.swapped_tokens + num_computed > self.swap_space_tokens or not prefer_transfer(
                num_computed, nbytes, self.cost.host_bytes_per_s, self.recompute_rate):
            return 0.0
        seq.num_swapped = num_computed
        self.swapped_tokens += num_computed
        seq.transition(SeqStatus.SWAPPED, "evict:swap-out")
        return nbytes / self.cost.host_bytes_per_s

    def _unblock(self) -> None:
        s = self.scheduler
        if s.running or not s.waiting:
            return
        seq = s.waiting[0]
        s.release(seq)
        seq.finish("error", f"sequence of {seq.num_tokens} tokens does not fit the KV pool "
                            f"({self.allocator.capacity_tokens} tokens)")
        self.errors.append((int(seq.request_index), seq.error or ""))

    def _decode_only(self, fed: IntArray, scheduled: np.ndarray | None, plan: Plan) -> bool:
        """Does every running row feed one token and sample (a pure decode forward)?"""
        if plan.swapped_in or scheduled is not None or (fed != 1).any():
            return False  # a 1-token chunk may still not sample:
        b = self.batch
        return len(b) < self.config.max_num_batched_tokens or bool((b.computed + 1 == b.prompt + b.out).all())

    def _step(self, fed: IntArray, scheduled: np.ndarray | None, plan: Plan, extra_s: float) -> None:
        """One forward as planned (prefill chunks, swap-ins, a partial batch)."""
        for seq in plan.swapped_in:
            self.swapped_tokens -= seq.num_computed
            extra_s += seq.num_computed * self.cost.kv_bytes_per_token / self.cost.host_bytes_per_s
        b = self.batch
        state = b.state.copy()
        c, n = (state[COMPUTED], fed) if scheduled is None else (state[COMPUTED][scheduled], fed[scheduled])
        # attention pairs sum n * (c + (n + 1) / 2): half-integers, summed exactly as integers
        pairs = int((n * (2 * c + n + 1)).sum()) / 2
        self.now += float(self.cost.step_seconds(int(n.sum()), len(n), int((c + n).sum()), pairs)) + extra_s
        state[COMPUTED] += fed  # (after the sums above: c may be a view of it)
        sampled = state[COMPUTED] == state[PROMPT] + state[OUT]  # ScheduledSeq.samples: it reached its last token
        if scheduled is not None:
            sampled &= scheduled
        state[OUT] += sampled
        b.state = state
        self.generated += int(np.count_nonzero(sampled))
        self._finish_rows(np.flatnonzero(sampled & (state[OUT] >= state[STOP_AT])))

    def _finish_rows(self, rows: IntArray) -> None:
        """The batch's rows at `rows` reached where they stop: they finish, give their seats and
        blocks back, and leave the batch."""
        if not len(rows):
            return
        index = rows.tolist()
        b = self.batch
        b.sync(index, finishing=True)
        seqs, running = b.seqs, self.scheduler.running
        for i in index:
            seq = seqs[i]
            if running[i] is not seq:  # (a pointer comparison: the batch mirrors the running list)
                raise AssertionError(f"{self.name}: the batch's row {i} is not the scheduler's")
            p: SimRequest = seq.params
            n = len(seq.output_ids)
            if n < p.output_len and n < p.max_tokens:
                raise AssertionError(f"{self.name}: row {seq.seq_id} stopped before its end")
            seq.finish("stop" if n < p.max_tokens else "length")
            self.finished.append((int(seq.request_index), self.now))
        self.scheduler.release_running(index)  # (the batch's positions are the running list's)
        b.drop(index)

    def _decode(self, extra_s: float) -> DecodeSlice:
        """k >= 1 decode steps of the whole batch in closed form (see the module docstring)."""
        b = self.batch
        n = len(b)
        c0, out0, have = b.computed, b.out, b.blocks
        left = b.stop_at - out0
        order = np.argsort(left, kind="stable")
        left_sorted, c_sorted = left[order], c0[order]
        config = self.config
        queued = bool(self.scheduler.waiting or self.arrivals)
        if config.exact:
            nth = 0
        elif queued or not self.sealed:
            nth = max(0, math.ceil(config.finish_fraction * n) - 1)
        else:  # nothing waits and nothing will come: no admission depends on when rows finish
            nth = n - 1
        horizon = max(1, int(left_sorted[nth]))
        if config.exact or queued:
            horizon = min(config.quantum_steps, horizon)
        clock = StepClock(self.cost, left_sorted, c_sorted, extra_s, horizon)
        if self.arrivals:  # end at the first forward past the next arrival: it joins then
            cum = clock.upto(horizon)
            horizon = min(horizon, int(np.searchsorted(cum, self.arrivals[0][0] - self.now, side="left")) + 1)
        piece = DecodeSlice(b.ids, b.max_tokens, self.now, self.generated, c0, out0, left, have, left_sorted, clock,
                            horizon, self.allocator.block_size)
        piece.fit(self.allocator.num_free)
        return piece

    def _close(self, k: int) -> None:
        """Write the open slice's first k steps into the batch; rows that stopped leave."""
        piece, self.slice = self.slice, None
        assert piece is not None
        self.version += 1
        self.now = piece.at(k)
        left = piece.left
        steps = np.minimum(left, k)
        self.generated += int(steps.sum())
        need = piece.blocks_needed(k)  # (cached for k = piece.k)
        self.allocator.take(int(need.sum()))  # the blocks of every row at once
        b = self.batch  # the slice's rows, in its order: nothing changes the batch while it is open
        state = b.state.copy()
        state[COMPUTED] += steps
        state[OUT] += steps
        state[BLOCKS] += need
        b.state = state
        self._finish_rows(np.flatnonzero(steps == left))
        self._account(piece.start, piece.generated)


def _rows(ids: IntArray, remaining: IntArray, computed: IntArray) -> np.ndarray:
    """[r, 3] (seq_id, remaining, num_computed) of running rows, as a report lists them."""
    return np.stack([ids, remaining, computed], axis=1)
