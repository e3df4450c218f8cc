"""The jobs whose owners cancelled them, as a holder remembers them: coroutines of theirs still in
transit to it are refused when they arrive."""
from __future__ import annotations

# Cancelled (owner, job) pairs a holder remembers, oldest forgotten first.
CANCELLED_KEPT = 1024


class CancelledJobs:
    """A set of (owner, job_id) that keeps the newest `kept` (not thread-safe: the host's lock)."""

    def __init__(self, kept: int = CANCELLED_KEPT) -> None:
        self.kept = kept
        self._jobs: dict[tuple[str, str], None] = {}  # insertion order: oldest first

    def add(self, owner: str, job_id: str) -> None:
        self._jobs[(owner, job_id)] = None
        while len(self._jobs) > self.kept:
            del self._jobs[next(iter(self._jobs))]

    def __contains__(self, key: object) -> bool:
        return key in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)
