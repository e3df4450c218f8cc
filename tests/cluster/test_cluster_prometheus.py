"""batchgen's per-worker metrics on the Dask scheduler's Prometheus endpoint, scraped over HTTP
from a real LocalCluster (2 worker processes) while and after a job runs."""
from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import dask.dataframe as dd
import pandas as pd
import pytest
from distributed import Client, LocalCluster

import batchgen
import batchgen.cluster as bc

pytestmark = pytest.mark.slow  # a real LocalCluster of worker processes


SAMPLE = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def scrape(client: Client) -> dict[tuple[str, str], float]:
    """{(metric name, labels text): value} from the scheduler's /metrics."""
    url = client.dashboard_link.rsplit("/", 1)[0] + "/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and not line.startswith("#"):
            out[(m["name"], m["labels"] or "")] = float(m["value"])
    return out


def per_worker(samples: dict[tuple[str, str], float], name: str) -> dict[str, float]:
    return {re.search(r'worker="([^"]+)"', labels)[1]: v for (n, labels), v in samples.items() if n == name}


def test_batchgen_metrics_on_the_scheduler_prometheus_endpoint(checkpoint_factory: Callable[..., Path]) -> None:
    ckpt = checkpoint_factory("mixtral")
    n = 64
    pdf = pd.DataFrame({"prompt": [f"row {i} says" for i in range(n)]})
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        before = scrape(client)
        assert ("dask_scheduler_workers", 'state="idle"') in before  # Dask's own series, same endpoint
        assert not per_worker(before, "batchgen_worker_coroutines")
        bc.connect(client=client, push_interval=0.1)
        workers = sorted(client.scheduler_info()["workers"])

        out = dd.from_pandas(pdf, npartitions=4).map_partitions(
            batchgen.generate, model=str(ckpt), temperature=0.0, ignore_eos=True, max_tokens=32,
            engine_options={"kv_cache_bytes": 16 << 20})
        future = client.compute(out)
        busy: dict[str, float] = {}
        while not future.done():  # while it runs: rows in flight on the workers
            busy = {w: v for w, v in per_worker(scrape(client), "batchgen_worker_coroutines").items() if v > 0}
            if busy:
                break
            time.sleep(0.05)
        result = future.result()
        assert busy and set(busy) <= set(workers)

        deadline = time.monotonic() + 10
        while True:  # the workers' last pushes land within a push interval or two
            samples = scrape(client)
            rows = per_worker(samples, "batchgen_worker_rows_total")
            if sum(rows.values()) >= n or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert sum(rows.values()) == n
        tokens = per_worker(samples, "batchgen_worker_generated_tokens_total")
        assert sum(tokens.values()) == result["num_generated_tokens"].sum() == 32 * n
        for name in ("batchgen_worker_tokens_per_second", "batchgen_worker_kv_used_ratio",
                     "batchgen_worker_expert_hit_ratio", "batchgen_worker_migrated_in_total"):
            assert set(per_worker(samples, name)) == set(rows), name
        assert per_worker(samples, "batchgen_worker_expert_hit_ratio")[workers[0]] == 1.0  # all resident
        assert 0.0 <= max(per_worker(samples, "batchgen_worker_kv_used_ratio").values()) <= 1.0
        assert ("batchgen_migrations_total", "") in samples

        bc.disconnect(client)  # the collector goes with the plugin
        after = scrape(client)
        assert not [k for k in after if k[0].startswith("batchgen_")]
        assert ("dask_scheduler_workers", 'state="idle"') in after
