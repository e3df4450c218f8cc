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


MAX_GROUPS = 16  # task groups whose row counts a host reports (the dashboard shows the newest jobs)


class GroupRows:
    """Per Dask task group (a job's partitions): [rows, rows done, rows failed] of its tasks
    here, the newest MAX_GROUPS groups; the dashboard sums them over workers (dashboard_data.py).
    Not thread-safe: the host's lock."""

    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = {}  # newest group last

    def opened(self, group: str, rows: int) -> None:
        counts = self._counts.pop(group, [0, 0, 0])
        counts[0] += rows
        self._counts[group] = counts  # (re-inserted: the newest group last)
        for old in list(self._counts)[:-MAX_GROUPS]:
            del self._counts[old]

    def finished(self, group: str, failed: bool) -> None:
        counts = self._counts.get(group)
        if counts is not None:  # (a group already forgotten is not counted)
            counts[1] += 1
            counts[2] += failed

    def as_dict(self) -> dict[str, list[int]]:
        return {group: list(counts) for group, counts in self._counts.items()}


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
