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
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from .cost import CostModel
from .engine import EngineSimConfig
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
        sub = Workload(workload.name, workload.prompt_len[mask], workload.output_len[mask], workload.max_tokens[mask])
        return length_aware_bct(sub, cost, engine, w) if mask.any() else 0.0

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


def tail_need(workload: Workload, cost: CostModel, engine: EngineSimConfig, workers: int, bct_s: float) -> TailNeed:
    """A counting argument against ending by `bct_s`, whatever the schedule (a linear program,
    scipy's HiGHS). Each of the n rows at the longest length L runs L steps one after another, so
    their steps may average at most bct_s / L. Variables: y[k, m], how many steps hold k of them and
    m other rows, each lasting d[k, m] = step_seconds(k + m rows; KV: k at the long rows' mean
    context, m at the shortest prompt of the others), and z, the other rows' tokens made in steps
    without long rows, each at least a full batch's per-token time at that shortest prompt. Then
    sum k y = n L, sum k d y <= n bct_s, z >= (the other rows' tokens) - sum m y, and the device
    time sum d y + z x that rate is at least the LP's minimum. Every choice under-prices (mates at
    their shortest context, no prefill, no KV limit; the step cost is convex in context, so the
    long rows' mean context under-prices theirs): a minimum over the fleet's workers x bct_s means
    no schedule ends by bct_s."""
    from scipy.optimize import linprog

    longest = int(workload.output_len.max())
    tail = workload.output_len == longest
    n = int(tail.sum())
    others = workload.output_len[~tail]
    rest = float(others.sum())
    ctx = float(workload.prompt_len[tail].mean()) + longest / 2
    seats = engine.max_num_seqs
    short = float(workload.prompt_len[~tail].min()) if len(others) else 1.0
    k, m = np.meshgrid(np.arange(1, min(n, seats) + 1), np.arange(0, seats), indexing="ij")
    ok = (k + m <= seats) & (m <= len(others))
    k, m = k[ok].astype(np.float64), m[ok].astype(np.float64)
    kv = k * ctx + m * short
    d = np.asarray(cost.step_seconds(k + m, k + m, kv, kv), dtype=np.float64)
    rate = float(cost.step_seconds(seats, seats, seats * short, seats * short)) / seats
    allowed = bct_s / longest
    # variables: y (one per step kind), then z
    objective = np.append(d, rate)
    a_ub = np.vstack([np.append(k * d, 0.0), np.append(-m, -1.0)])
    b_ub = [n * bct_s, -rest]
    a_eq = np.append(k, 0.0)[None]
    res = linprog(objective, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=[n * longest], bounds=(0, None), method="highs")
    need = float(res.fun) if res.status == 0 else float("inf")
    return TailNeed(n, longest, allowed, need, workers * bct_s)


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
