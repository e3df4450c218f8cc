"""One decision of a simulated engine: `Scheduler.schedule()` on its running rows held as arrays.

The running rows' loop is computed in closed form over the batch (batch.py); the rows it
evicts go through the scheduler's own `evict` and the waiting rows through its own `admit`, so
every state change is the runtime's code. A decision that evicts under another policy than
"newest" (whose victims the closed form does not pick) is the real `schedule()` on synced rows.
"""
from __future__ import annotations

import numpy as np

from ..runtime.policy import Plan, Scheduler
from .batch import IntArray, RunningBatch


def schedule_batch(batch: RunningBatch, scheduler: Scheduler, lookahead: int,
                   closed_form: bool = True) -> tuple[RunningBatch, IntArray, np.ndarray | None, Plan]:
    """scheduler.schedule(lookahead) on `batch` (the scheduler's running rows, in its order):
    (the batch after it, holding the admitted rows at its end as the running list does; tokens
    each of its rows feeds; which rows are scheduled, None: every row (the common case); the
    plan of evictions and admissions). closed_form False: always the real call (tests)."""
    alloc, budget = scheduler.allocator, scheduler.config.max_num_batched_tokens
    if closed_form:
        fed, need, first, keep = batch.plan_running(budget, lookahead, alloc.block_size, alloc.num_free)
        if keep == len(batch) or scheduler.config.eviction == "newest":
            plan = Plan()
            if keep < len(batch):  # the loop evicts the last running row until the rest fit
                gone = list(range(len(batch) - 1, keep - 1, -1))
                batch.sync(gone)
                plan.evicted = [scheduler.evict(batch.seqs[i], "evict:kv-pool-full") for i in gone]
                batch.drop(gone[::-1])
                fed, need = fed[:keep], need[:keep]
            alloc.take(int(need.sum()))
            batch.blocks = batch.blocks + need
            if not plan.evicted:  # after an eviction, admitting would only thrash the pool
                scheduler.admit(plan, budget - int(fed.sum()))
            scheduled = None if first == len(batch) else np.arange(len(batch) + len(plan.scheduled)) < first
            if plan.scheduled:
                batch.extend([item.seq for item in plan.scheduled])
                fed = np.concatenate([fed, [item.num_new for item in plan.scheduled]])
                if scheduled is not None:
                    scheduled[-len(plan.scheduled):] = True
            return batch, fed, scheduled, plan
    batch.sync()
    plan = scheduler.schedule(lookahead)
    batch = RunningBatch(scheduler.running)
    num_new = {id(item.seq): item.num_new for item in plan.scheduled}
    fed = np.fromiter((num_new.get(id(q), 0) for q in batch.seqs), np.int64, len(batch))
    picked = np.fromiter((id(q) in num_new for q in batch.seqs), bool, len(batch))
    return batch, fed, None if picked.all() else picked, plan
