"""batchgen's per-worker figures on the Dask scheduler's Prometheus endpoint (`/metrics`).

The scheduler's dashboard serves `prometheus_client.REGISTRY`; the balance plugin registers one
collector there in `start()` and removes it in `close()`, so a running job shows up next to
Dask's own `dask_scheduler_*` series in an existing Grafana. Read at scrape time from the
plugin's load view (no thread, nothing cached here):

    batchgen_worker_coroutines{worker}         waiting + running rows in the worker's engines
    batchgen_worker_tokens_per_second{worker}  recent generation speed
    batchgen_worker_kv_used_ratio{worker}      KV cache blocks in use (fullest engine)
    batchgen_worker_expert_hit_ratio{worker}   routed experts found in device memory (worst engine)
    batchgen_worker_{rows,generated_tokens,migrated_in,migrated_out,recovered}_total{worker}
    batchgen_migrations_total                  coroutines moved between workers (departed included)
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# (metric name, help, key in the plugin's per-worker metrics)
GAUGES = (
    ("coroutines", "batchgen coroutines (rows) waiting or running in the worker's engines", "coroutines"),
    ("waiting", "batchgen rows waiting for a batch slot", "waiting"),
    ("running", "batchgen rows in the running batch", "running"),
    ("remaining_tokens", "tokens still to generate for the rows in the worker's engines", "remaining_tokens"),
    ("tokens_per_second", "tokens generated per second, recently", "tokens_per_s"),
    ("kv_used_ratio", "fraction of KV cache blocks in use (fullest engine)", "kv_used"),
    ("expert_hit_ratio", "fraction of routed experts found in device memory (worst engine; 1 when all "
                         "are resident)", "expert_hit_rate"),
    ("jobs", "batchgen partitions (tasks) in flight on the worker", "jobs"),
)
COUNTERS = (
    ("rows", "rows of this worker's tasks that got their output", "rows_done"),
    ("generated_tokens", "tokens generated for those rows", "generated_tokens"),
    ("migrated_in", "coroutines adopted from another worker", "migrated_in"),
    ("migrated_out", "coroutines sent to another worker", "migrated_out"),
    ("recovered", "moved rows resumed here because their holder left", "recovered"),
)


class BatchgenCollector:
    """A prometheus_client custom collector over `metrics()` (BalancePlugin.metrics)."""

    def __init__(self, metrics: Callable[[], dict[str, Any]], namespace: str = "batchgen") -> None:
        self._metrics, self.namespace = metrics, namespace

    def describe(self) -> list[Metric]:
        # Registering calls collect() without this; the plugin's view may not exist yet then.
        return []

    def collect(self) -> Iterator[Metric]:
        view = self._metrics()
        workers: dict[str, dict[str, Any]] = view.get("workers", {})
        ns = self.namespace
        for name, doc, key in GAUGES:
            family = GaugeMetricFamily(f"{ns}_worker_{name}", doc, labels=["worker"])
            for addr, w in workers.items():
                family.add_metric([addr], float(w.get(key, 0.0)))
            yield family
        for name, doc, key in COUNTERS:
            family = CounterMetricFamily(f"{ns}_worker_{name}", doc, labels=["worker"])
            for addr, w in workers.items():
                family.add_metric([addr], float(w.get(key, 0)))
            yield family
        yield CounterMetricFamily(f"{ns}_migrations", "coroutines moved between workers (workers that "
                                  "left included)", value=float(view.get("migrations", 0)))
        yield CounterMetricFamily(f"{ns}_migration_orders", "migration orders the scheduler gave",
                                  value=float(view.get("orders", 0)))


def register(collector: BatchgenCollector) -> bool:
    """Add to the default registry (the one the dashboard serves); False if one of the same
    names is there already (a second scheduler in one process: the first keeps the names)."""
    try:
        REGISTRY.register(collector)  # type: ignore[arg-type]
    except ValueError:  # duplicated timeseries
        return False
    return True


def unregister(collector: BatchgenCollector) -> None:
    try:
        REGISTRY.unregister(collector)  # type: ignore[arg-type]
    except KeyError:
        pass
