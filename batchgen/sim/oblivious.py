"""What not knowing output lengths costs: a fluid estimate of the best length-oblivious BCT.

`ideal_bound` spreads all work perfectly, as if the long rows had started first. A policy that
sees only max_tokens starts rows in an order unrelated to their lengths, and a row that starts
late and turns out long runs its tail at the pace of the batch it shares. This estimate keeps
that one constraint and grants everything else: migration is free and instant, so the R running
rows always sit evenly on the W workers (the busiest holding ceil(R / W), every row at that
batch's decode rate), prefill is free, and a row starts the moment a seat and KV free, in a
given order. It is a fluid model, not a strict bound (a simulated run whose rows happen to sit
unevenly can come in slightly under it: 0.4% on one small seed); the gap from it to
`ideal_bound` is the price of not knowing lengths. A policy that preempted old rows for new ones,
or ran rows that have grown long alone, could go under it; none here does.

What knowing the lengths would buy, in the same fluid model: `length_aware_bct` starts the
longest rows first; `isolated_bct` also gives the rows of at least `min_len` tokens their own
workers (smaller batches, faster steps), the rest sharing the others. On the simulated fleet
neither comes near `ideal_bound` (README, simulated fleet): the bound's "longest row alone"
term holds for one row, while a heavy tail has hundreds that would each need a GPU to itself.
`tail_need` / `tail_bound` turn that into a lower bound on every schedule's BCT.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from .cost import CostModel
from .engine_config import EngineSimConfig
from .workload import Workload


def start_orders(rows: int, workers: int) -> list[np.ndarray]:
    """The orders in which the policies here start rows: input order (a shared queue), and the
    partitions' heads first (row i of every partition before row i + 1 of any: partitioned
    placement, as static and batchgen deal the rows)."""
    parts = np.array_split(np.arange(rows), workers)
    depth = np.concatenate([np.arange(len(part)) for part in parts])
    return [np.arange(rows), np.concatenate(parts)[np.argsort(depth, kind="stable")]]


def oblivious_bct(workload: Workload, cost: CostModel, engine: EngineSimConfig, workers: int) -> float:
    """The smaller fifo_bct over the start orders the policies use (start_orders)."""
    return min(fifo_bct(workload, cost, engine, workers, order) for order in start_orders(workload.rows, workers))


def length_aware_bct(workload: Workload, cost: CostModel, engine: EngineSimConfig, workers: int) -> float:
    """fifo_bct with the longest rows started first (an oracle: no policy here knows lengths)."""
    return fifo_bct(workload, cost, engine, workers, np.argsort(-workload.output_len, kind="stable"))


def isolated_bct(workload: Workload, cost: CostModel, engine: EngineSimConfig, workers: int, min_len: int,
                 isolated_workers: int) -> float:
    """length_aware_bct when the rows of at least `min_len` output tokens run on `isolated_workers`
    workers of their own and the others on the rest: the later of the two pools' ends."""
    if not 0 <= isolated_workers < workers:
        raise ValueError(f"isolated_workers must be in [0, {workers}), got {isolated_workers}")
    long = workload.output_len >= min_len
    if not long.any() or isolated_workers == 0:
        return length_aware_bct(workload, cost, engine, workers)

    def part(mask: np.ndarray, w: int) -> float:
        return length_aware_bct(workload.take(mask), cost, engine, w) if mask.any() else 0.0

    return max(part(long, isolated_workers), part(~long, workers - isolated_workers))


@dataclass(frozen=True, slots=True)
class TailNeed:
    """What ending a job by `bct_s` takes, given its longest rows (tail_need)."""

    rows: int                # rows at the longest length
    length: int              # their output tokens
    max_step_s: float        # the mean step time that lets each end in time
    gpu_seconds: float       # the least device time the whole job takes then (inf: none is fast enough)
    fleet_seconds: float     # workers x bct_s

    @property
    def feasible(self) -> bool:
        return self.gpu_seconds <= self.fleet_seconds


def tail_need(workload: Workload, cost: CostModel, engine: EngineSimConfig, workers: int, bct_s: float,
              buckets: int = 8) -> TailNeed:
    """A counting argument against ending by `bct_s`, whatever the schedule (a linear program,
    scipy's HiGHS). Each of the n rows at the longest length L runs its L steps one after
    another, at contexts that grow by one a step whatever the schedule, so its steps' times may
    add up to at most bct_s. A step of k such rows and m others lasts at least
    a(k + m) + c x (its KV tokens): step_seconds at no KV plus its slope there (the cost is convex
    in KV, so this tangent is under it). Variables x[k, m, b]: the long rows' steps taken in steps
    of k long rows and m others while their own context is in bucket b (of `buckets` along L;
    the bucket's least context, from the shortest long prompt); z: the other rows' tokens made
    without long rows, each at least a full batch's per-token time at the shortest other prompt.
    Mates' KV is counted through the k-weighted sum of the long rows' own contexts (each unit of
    x adds k x its context to the time the k rows spend, and its context once to the device time),
    the others' at their shortest prompt; no prefill, no KV limit. Constraints: each bucket's
    n L / buckets steps, the long rows' total time <= n x bct_s, z >= the other rows' tokens
    minus those made beside long rows. A least device time above workers x bct_s means no
    schedule ends by bct_s."""
    from scipy.optimize import linprog
    from scipy.sparse import csr_matrix, vstack

    longest = int(workload.output_len.max())
    tail = workload.output_len == longest
    n = int(tail.sum())
    others = workload.output_len[~tail]
    rest = float(others.sum())
    seats = engine.max_num_seqs
    short = float(workload.prompt_len[~tail].min()) if len(others) else 0.0
    k, m = np.meshgrid(np.arange(1, min(n, seats) + 1), np.arange(0, seats), indexing="ij")
    ok = (k + m <= seats) & (m <= len(others))
    k, m = k[ok].astype(np.float64), m[ok].astype(np.float64)
    rows = k + m
    base = np.asarray(cost.step_seconds(rows, rows, 0.0, 0.0), dtype=np.float64)        # a(k + m)
    # c: the chord over the first KV token; convexity keeps a + c x KV under the cost for KV >= 1
    slope = np.maximum(np.asarray(cost.step_seconds(rows, rows, 1.0, 1.0), dtype=np.float64) - base, 0.0)
    first = float(workload.prompt_len[tail].min())
    ctx = first + np.arange(buckets) * (longest / buckets)                               # [B]
    per_bucket = n * longest / buckets
    p_count = len(k)
    # x laid out bucket-major: x[b * P + j]
    kk, mm, bb, sl = np.tile(k, buckets), np.tile(m, buckets), np.repeat(ctx, p_count), np.tile(slope, buckets)
    base_b = np.tile(base, buckets)
    mate_kv = mm * short
    time_coef = base_b + sl * (mate_kv + kk * bb)           # this unit's step time, mates' long KV via k x ctx
    device_coef = (base_b + sl * mate_kv) / kk + sl * bb    # its share of the step's device time
    made = mm / kk                                          # other rows' tokens made in its step, per unit
    rate = float(cost.step_seconds(seats, seats, seats * short, seats * short)) / seats
    objective = np.append(device_coef, rate)
    a_ub = csr_matrix(np.vstack([np.append(time_coef, 0.0), np.append(-made, -1.0)]))
    b_ub = [n * bct_s, -rest]
    cols = np.arange(buckets * p_count)
    a_eq = csr_matrix((np.ones(len(cols)), (cols // p_count, cols)), shape=(buckets, buckets * p_count + 1))
    res = linprog(objective, A_ub=a_ub, b_ub=b_ub, A_eq=vstack([a_eq]), b_eq=np.full(buckets, per_bucket),
                  bounds=(0, None), method="highs")
    need = float(res.fun) if res.status == 0 else float("inf")
    return TailNeed(n, longest, bct_s / longest, need, workers * bct_s)


def tail_bound(workload: Workload, cost: CostModel, engine: EngineSimConfig, workers: int, upper_s: float,
               rel: float = 1e-3) -> float:
    """The least BCT that tail_need does not rule out, up to `upper_s` (bisection to `rel`): a lower
    bound on every schedule's BCT, beside ideal_bound's."""
    lo, hi = 0.0, upper_s
    if not tail_need(workload, cost, engine, workers, hi).feasible:
        return hi
    while hi - lo > rel * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if tail_need(workload, cost, engine, workers, mid).feasible else (mid, hi)
    return hi


def fifo_bct(workload: Workload, cost: CostModel, engine: EngineSimConfig, workers: int,
               order: np.ndarray | None = None) -> float:
    """Seconds until the last row ends when rows start in `order` (default: input order; see
    the module docstring). KV: a row joins when the contexts of the running rows plus its
    prompt fit the fleet's pools (rows growing past them later are let run: generous), and at
    most max_num_seqs rows per worker run."""
    idx = np.arange(workload.rows) if order is None else np.asarray(order)
    prompts, lengths = workload.prompt_len[idx].tolist(), workload.output_len[idx].tolist()
    pool = float(cost.kv_capacity_tokens) * workers
    seats = engine.max_num_seqs * workers
    done_at: list[tuple[float, int]] = []  # heap: (virtual progress at which a row ends, row)
    started_at: dict[int, float] = {}
    virtual = now = 0.0
    prompt_sum = started_sum = 0.0  # running rows' contexts = prompt_sum + R * virtual - started_sum
    nxt = 0

    def admit() -> None:
        nonlocal nxt, prompt_sum, started_sum
        while nxt < len(lengths) and len(done_at) < seats and (
                not done_at or prompt_sum + len(done_at) * virtual - started_sum + prompts[nxt] <= pool):
            heapq.heappush(done_at, (virtual + lengths[nxt], nxt))
            started_at[nxt] = virtual
            prompt_sum += prompts[nxt]
            started_sum += virtual
            nxt += 1

    admit()
    while done_at:
        end, row = done_at[0]
        running = len(done_at)
        per_worker = -(-running // workers)  # the busiest worker's rows set the pace
        kv = (prompt_sum + running * (virtual + end) / 2 - started_sum) / min(running, workers)
        step = float(cost.step_seconds(per_worker, per_worker, kv, kv))
        now += (end - virtual) * step
        virtual = end
        heapq.heappop(done_at)
        prompt_sum -= prompts[row]
        started_sum -= started_at.pop(row)
        admit()
    return now
