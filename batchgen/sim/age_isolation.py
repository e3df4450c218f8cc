"""What acting on a row's age could buy: a fluid estimate of isolating rows that have grown long.

A policy that does not know output lengths still sees each running row's age (tokens generated
so far), and with heavy-tailed lengths an old row is likely to run much longer. `age_isolated_bct`
extends oblivious.fifo_bct's fluid model (rows start in a given order the moment a seat and KV
free; free, instant and perfect migration within a pool; free prefill) with two pools: rows start
on the `workers - isolated` shared workers; a row of at least `min_age` generated tokens moves at
once, for free, to the `isolated` workers of its own while they run fewer than `max_batch` rows
each and their KV pools hold it (the oldest such row first), and runs at the pace of that pool's
smaller batches. It is an estimate of the best such a policy could do,
not a bound (docs/benchmarks/sim.md, length-aware policy).
"""
from __future__ import annotations

import heapq

import numpy as np

from .cost import CostModel
from .engine_config import EngineSimConfig
from .workload import Workload


def age_isolated_bct(workload: Workload, cost: CostModel, engine: EngineSimConfig, workers: int, min_age: int,
                     isolated: int, max_batch: int = 16, order: np.ndarray | None = None) -> float:
    """Seconds until the last row ends when rows of age >= min_age run on `isolated` workers of
    their own, at most `max_batch` a worker (see the module docstring); rows start in `order`
    (default: input order)."""
    if not 0 < isolated < workers or max_batch < 1:
        raise ValueError(f"isolated must be in (0, {workers}) and max_batch >= 1, got {isolated}, {max_batch}")
    idx = np.arange(workload.rows) if order is None else np.asarray(order)
    prompts, lengths = workload.prompt_len[idx].tolist(), workload.output_len[idx].tolist()
    shared = workers - isolated
    pool, seats, room = float(cost.kv_capacity_tokens) * shared, engine.max_num_seqs * shared, isolated * max_batch
    iso_pool = float(cost.kv_capacity_tokens) * isolated
    inf = float("inf")
    # shared pool: v = tokens each of its rows has made since the pool began (all run at one pace)
    ends: list[tuple[float, int]] = []      # (v at which the row ends, row)
    ages: list[tuple[float, int]] = []      # (v at which the row reaches min_age, row): oldest first
    eligible: list[tuple[float, int]] = []  # (v it started at, row): old enough, waiting for room
    started: dict[int, float] = {}
    v = prompt_sum = started_sum = 0.0
    # isolated pool: u likewise; a row's context there is base + u, base = prompt + age - u at entry
    iso_ends: list[tuple[float, int]] = []
    iso_base: dict[int, float] = {}
    u = base_sum = 0.0
    now, nxt = 0.0, 0

    def admit() -> None:
        nonlocal nxt, prompt_sum, started_sum
        while nxt < len(lengths) and len(started) < seats and (
                not started or prompt_sum + len(started) * v - started_sum + prompts[nxt] <= pool):
            heapq.heappush(ends, (v + lengths[nxt], nxt))
            if lengths[nxt] > min_age:
                heapq.heappush(ages, (v + min_age, nxt))
            started[nxt] = v
            prompt_sum += prompts[nxt]
            started_sum += v
            nxt += 1

    def isolate() -> None:
        nonlocal prompt_sum, started_sum, base_sum
        while eligible and len(iso_base) < room:
            s0, row = eligible[0]
            if row not in started:
                heapq.heappop(eligible)
                continue
            age = v - s0
            if iso_base and base_sum + len(iso_base) * u + prompts[row] + age > iso_pool:
                break  # (contexts there grow: like fifo_bct, rows let in are let run)
            heapq.heappop(eligible)
            heapq.heappush(iso_ends, (u + lengths[row] - age, row))
            iso_base[row] = prompts[row] + age - u
            base_sum += iso_base[row]
            prompt_sum -= prompts[row]
            started_sum -= started.pop(row)
        admit()

    def step(rows: int, pool_workers: int, kv_sum: float) -> float:
        per_worker = -(-rows // pool_workers)
        kv = kv_sum / min(rows, pool_workers)
        return float(cost.step_seconds(per_worker, per_worker, kv, kv))

    admit()
    while started or iso_base:
        while ends and ends[0][1] not in started:  # moved to the isolated pool
            heapq.heappop(ends)
        while ages and ages[0][1] not in started:
            heapq.heappop(ages)
        r, ri = len(started), len(iso_base)
        dt_shared = dt_iso = inf
        target = inf
        if r:
            s = step(r, shared, prompt_sum + r * v - started_sum)
            target = min(ends[0][0], ages[0][0] if ages else inf)
            dt_shared = (target - v) * s
        if ri:
            si = step(ri, isolated, base_sum + ri * u)
            dt_iso = (iso_ends[0][0] - u) * si
        dt = min(dt_shared, dt_iso)
        now += dt
        if r:
            v = target if dt == dt_shared else v + dt / s
        if ri:
            u = iso_ends[0][0] if dt == dt_iso else u + dt / si
        if dt == dt_iso:
            row = heapq.heappop(iso_ends)[1]
            base_sum -= iso_base.pop(row)
        if r and dt == dt_shared:
            if ages and ages[0][0] <= v:
                row = heapq.heappop(ages)[1]
                heapq.heappush(eligible, (started[row], row))
            else:
                row = heapq.heappop(ends)[1]
                prompt_sum -= prompts[row]
                started_sum -= started.pop(row)
        isolate()
    return now
