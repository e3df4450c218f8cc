"""What an engine reports about itself: its load for the cluster's balancer, the stats summary,
and the progress line's engine figures (prefix-cache hit rate, expert tiers).
"""
from __future__ import annotations

from typing import Any

from ..offload import ExpertStore
from ..runtime.kv_cache import BlockAllocator
from ..runtime.policy import Scheduler
from ..runtime.prefix_cache import PrefixCache
from ..runtime.stats import RuntimeStats
from .protocol import LoadReport


def load_report(scheduler: Scheduler, allocator: BlockAllocator, max_num_seqs: int, device_class: str,
                experts: ExpertStore | None) -> LoadReport:
    """What the cluster layer needs to balance work: queue, running, KV use, tokens left."""
    unfinished = list(scheduler.waiting) + scheduler.running
    remaining = {int(s.seq_id): s.remaining_tokens for s in unfinished}
    hit_rate = 1.0
    if experts is not None and experts.stats.experts_needed:
        hit_rate = experts.stats.device_hits / experts.stats.experts_needed
    return LoadReport(len(scheduler.waiting), len(scheduler.running), 1 - allocator.num_free / allocator.num_blocks,
                      allocator.capacity_tokens, max_num_seqs, device_class, sum(remaining.values()), remaining,
                      {int(s.seq_id): s.num_computed for s in unfinished}, hit_rate)


def load_dict(load: LoadReport) -> dict[str, Any]:
    """The load as `Engine.load()` has always given it (a dict)."""
    return {"waiting": load.waiting, "running": load.running, "kv_used_fraction": load.kv_used_fraction,
            "kv_capacity_tokens": load.kv_capacity_tokens, "max_num_seqs": load.max_num_seqs,
            "device_class": load.device_class, "remaining_tokens": load.remaining,
            "remaining_by_seq": load.remaining_by_id}


def stats_summary(stats: RuntimeStats, experts: ExpertStore | None, prefix_cache: PrefixCache | None,
                  busy_s: float) -> dict[str, float]:
    summary = stats.summary()
    if experts is not None:  # experts tiered over device / host / disk
        summary.update(experts.summary(stats.generated_tokens))
        summary["expert_fetch_wait_fraction"] = summary["expert_fetch_wait_s"] / busy_s if busy_s > 0 else 0.0
    if prefix_cache is not None:
        summary.update(prefix_cache.summary())
    return summary


def progress_status(prefix_cache: PrefixCache | None, expert_text: str) -> str:
    """The progress line's engine figures: prefix-cache hit rate, expert tiers."""
    parts = [prefix_cache.status() if prefix_cache is not None else "", expert_text]
    return ", ".join(p for p in parts if p)


def expert_status(experts: ExpertStore | None, generated_tokens: int) -> str:
    """The progress line's expert figures: hit rate per tier ('' with every expert resident)."""
    if experts is None or not experts.stats.experts_needed:
        return ""
    s = experts.summary(generated_tokens)
    text = f"experts: {100 * s['expert_hit_rate_device']:.0f}% in pool"
    if experts.plan.from_disk and not experts.plan.shared:
        text += f", {100 * s['expert_hit_rate_host']:.0f}% of misses in host memory"
    per_token = s["expert_bytes_from_disk"] + s["expert_bytes_from_host"]
    return text + f", {per_token / 2**20:,.1f} MiB/token moved"
