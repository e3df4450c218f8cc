"""Which workers may hold engines: a Dask worker resource (e.g. `GPU`) or an explicit list.

On a mixed cluster (many CPU workers for ETL, a few GPU workers for the model) only the
workers this rule admits ever start an engine or take a coroutine. Tasks that land elsewhere
hand their rows to an admitted worker's host (host.py, the `batchgen_submit` message), so the
rest of the user's graph stays free to run anywhere. With no rule every worker is admitted
(the behaviour without one). See docs/guides/gpu-clusters.md.

Dask config: `batchgen.worker-resource` (a resource name) and `batchgen.engine-workers` (a list
of worker addresses or names), read on the client when the plugin is installed.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

RESOURCE_KEY = "batchgen.worker-resource"
WORKERS_KEY = "batchgen.engine-workers"


@dataclass(frozen=True, slots=True)
class EngineWorkers:
    """resource: a worker needs a positive amount of this Dask resource; workers: or its address
    or name in this set. Both None: every worker may hold engines."""

    resource: str | None = None
    workers: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.resource is not None and (not isinstance(self.resource, str) or not self.resource):
            raise ValueError(f"worker resource must be a non-empty resource name, got {self.resource!r}")
        if self.workers is not None and not self.workers:
            raise ValueError("engine workers: an empty list admits no worker; leave it unset to admit all")

    @classmethod
    def make(cls, resource: str | None = None, workers: Iterable[str] | None = None) -> EngineWorkers:
        """From explicit values, each falling back to its dask config key."""
        import dask.config

        if resource is None:
            resource = dask.config.get(RESOURCE_KEY, default=None) or None
        if workers is None:
            workers = dask.config.get(WORKERS_KEY, default=None) or None
        if isinstance(workers, str):
            workers = [w.strip() for w in workers.split(",") if w.strip()]
        return cls(resource, frozenset(str(w) for w in workers) if workers is not None else None)

    @property
    def is_restricted(self) -> bool:
        return self.resource is not None or self.workers is not None

    def admits(self, address: str, name: Any = None, resources: Mapping[str, float] | None = None) -> bool:
        if not self.is_restricted:
            return True
        if self.workers is not None and (address in self.workers or (name is not None and str(name) in self.workers)):
            return True
        return self.resource is not None and float((resources or {}).get(self.resource, 0)) > 0

    def describe(self) -> str:
        """The rule in words, for errors that say why no worker qualifies."""
        parts = []
        if self.resource is not None:
            parts.append(f"the Dask worker resource {self.resource!r} (dask config {RESOURCE_KEY})")
        if self.workers is not None:
            parts.append(f"a name or address in {sorted(self.workers)} (dask config {WORKERS_KEY})")
        return " or ".join(parts) or "any worker"

    def to_msg(self) -> dict[str, Any]:
        return {"resource": self.resource, "workers": sorted(self.workers) if self.workers is not None else None}

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any] | None) -> EngineWorkers:
        if not msg:
            return cls()
        workers = msg.get("workers")
        return cls(msg.get("resource"), frozenset(workers) if workers is not None else None)


def no_engine_worker_message(rule: EngineWorkers) -> str:
    return (f"no worker of this cluster may run a batchgen engine: engines run only on workers with "
            f"{rule.describe()}, and none has joined. Start workers with it (e.g. "
            f"`dask worker ... --resources {rule.resource or 'GPU'}=1`) or unset the restriction.")
