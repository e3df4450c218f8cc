"""What a Host tells the scheduler plugin about itself: its counters and each engine's load, as
the plain values the load push carries (plugin.py and the dashboard read them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .runner import RunnerLoad


@dataclass(slots=True)
class HostCounters:
    rows_done: int = 0  # rows of this host's jobs that got their output
    generated_tokens: int = 0  # tokens of those rows
    migrated_out: int = 0  # coroutines sent to another worker
    migrated_in: int = 0  # coroutines adopted from another worker
    recovered: int = 0  # moved rows resumed here because their holder left
    returned: int = 0  # rows finished here for another worker's task
    progress_sent: int = 0  # snapshots of held rows sent to their owners
    refreshed: int = 0  # kept states of moved rows replaced by their holder's newer snapshot
    forwarded: int = 0  # coroutines held for others passed on to a third worker (via their owner)
    cancelled: int = 0  # coroutines held for others dropped because their owner's task ended
    delegated: int = 0  # rows of this host's tasks handed to a worker that may hold engines
    submitted_in: int = 0  # not-started rows taken from such a worker's tasks


def load_report(load: RunnerLoad) -> dict[str, Any]:
    """One engine's load as the report carries it."""
    return {
        "ready": load.ready, "waiting": load.waiting, "running": load.running,
        "kv_used": load.kv_used, "remaining_tokens": load.remaining_tokens,
        "tokens_per_s": load.tokens_per_s, "generated_tokens": load.generated_tokens, "speed": load.speed,
        "expert_hit_rate": load.expert_hit_rate, "kv_capacity_tokens": load.kv_capacity_tokens,
        "max_num_seqs": load.max_num_seqs, "adopted": load.adopted, "device": load.device,
        "movable": [[c.seq_id, c.remaining, c.num_computed] for c in load.movable],
    }
