"""batchgen on a real LocalCluster (2 worker processes x 1 thread, tiny Mixtral): results equal a
single engine's row for row, batchgen's metrics show on the scheduler's Prometheus endpoint,
long partitions migrate to the idle worker, a SIGKILLed worker loses and duplicates no row, and
the plugin's handlers come and go with it.

One cluster for the module; the worker-kill test runs after the others that need both workers.
"""
from __future__ import annotations

import io
import os
import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dask.dataframe as dd
import pandas as pd
import pytest
import torch
from distributed import Client, Future, LocalCluster
from distributed.utils import key_split_group

import batchgen.cluster as bc
from batchgen import Engine, SamplingParams
from batchgen.cluster.frame import OUTPUT_COLUMNS
from batchgen.cluster.plugin import PLUGIN_NAME, SCHEDULER_HANDLERS
from batchgen.cluster.worker import EXTENSION, HANDLERS, WORKER_PLUGIN

pytestmark = pytest.mark.slow  # a real LocalCluster of worker processes


OPTIONS = {"kv_cache_bytes": 16 << 20}
GREEDY = {"temperature": 0.0, "ignore_eos": True}
TEXTS = ["The quick brown fox", "def f(x):", "a", "Hello, world!", "x = 1\ny = 2", "import os", "# note", "if"]


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory: Callable[..., Path]) -> Path:
    return checkpoint_factory("mixtral")


@pytest.fixture(scope="module")
def client(ckpt: Path) -> Iterator[Client]:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        bc.connect(client=c, push_interval=0.1)
        # load the model on both workers, so that either can take migrated work from the start
        c.gather([submit(c, rows(1, lambda i: 1), ckpt, w) for w in workers(c)])
        yield c


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> Callable[[pd.DataFrame], list[str]]:
    engine = Engine(ckpt, **OPTIONS)

    def run(pdf: pd.DataFrame) -> list[str]:
        params = [SamplingParams(max_tokens=int(m), **GREEDY) for m in pdf["max_tokens"]]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # 2 OpenMP threads next to 2 busy workers on 2 cores crawl
        try:
            return [o.text for o in engine.generate(list(pdf["prompt"]), params)]
        finally:
            torch.set_num_threads(threads)
    return run


def rows(n: int, max_tokens: Callable[[int], int], start: int = 0) -> pd.DataFrame:
    prompts = [f"{TEXTS[i % len(TEXTS)]} {i}" for i in range(start, start + n)]
    return pd.DataFrame({"prompt": prompts, "max_tokens": [max_tokens(i) for i in range(n)]},
                        index=pd.RangeIndex(start, start + n))


def submit(client: Client, pdf: pd.DataFrame, model: Path, worker: str, loose: bool = False) -> Future:
    return client.submit(bc.generate, pdf, model=model, per_row={"max_tokens": "max_tokens"},
                         engine_options=OPTIONS, workers=[worker], allow_other_workers=loose, pure=False, **GREEDY)


def workers(client: Client) -> list[str]:
    return sorted(client.scheduler_info()["workers"])


def worker_metrics(client: Client) -> dict[str, dict[str, Any]]:
    return bc.metrics(client).get("workers", {})


def counter_on(client: Client, worker: str, name: str) -> int:
    """One of the worker's host counters (HostCounters)."""
    return client.run(lambda dask_worker: getattr(dask_worker.extensions[EXTENSION].host.counters, name),
                      workers=[worker])[worker]


def test_plugin_and_handlers_are_installed(client: Client) -> None:
    assert client.run_on_scheduler(lambda dask_scheduler: PLUGIN_NAME in dask_scheduler.plugins)
    assert client.run_on_scheduler(lambda dask_scheduler: sorted(h for h in dask_scheduler.handlers
                                                                 if h.startswith("batchgen"))) \
        == sorted(SCHEDULER_HANDLERS)
    per_worker = client.run(lambda dask_worker: (sorted(h for h in dask_worker.handlers if h.startswith("batchgen")),
                                                 WORKER_PLUGIN in dask_worker.plugins,
                                                 EXTENSION in dask_worker.extensions))
    assert list(per_worker.values()) == [(sorted(HANDLERS), True, True)] * 2


def test_map_partitions_equals_one_engine(client: Client, ckpt: Path, reference: Any) -> None:
    pdf = rows(20, lambda i: 2 + (7 * i) % 11)
    pdf.loc[7, "prompt"] = ""  # a bad row among good ones
    ddf = dd.from_pandas(pdf, npartitions=5)
    out = ddf.map_partitions(bc.generate, model=ckpt, per_row={"max_tokens": "max_tokens"},
                             engine_options=OPTIONS, **GREEDY).compute()
    assert list(out.index) == list(pdf.index) and list(out.columns) == [*pdf.columns, *OUTPUT_COLUMNS]
    good = pdf.drop(index=7)
    assert out.drop(index=7)["generated_text"].tolist() == reference(good)
    assert out.drop(index=7)["num_generated_tokens"].tolist() == good["max_tokens"].tolist()
    assert out.loc[7, "finish_reason"] == "error" and "row 7: prompt must not be empty" in out.loc[7, "error"]
    lazy = bc.generate_dataframe(dd.from_pandas(good, npartitions=3), model=ckpt,
                                 per_row={"max_tokens": "max_tokens"}, engine_options=OPTIONS, **GREEDY)
    log = io.StringIO()
    with bc.progress(client, total=len(good), mode="lines", file=log, interval=0.2):
        assert lazy.compute()["generated_text"].tolist() == reference(good)
    assert f"{len(good)}/{len(good)} rows (100%)" in log.getvalue().splitlines()[-1]


def _rows_done_unpushed(dask_worker: Any, n: int) -> None:
    """This worker has just finished n more rows, and its pushes leave them out until
    `_rows_pushed` (the plugin hears of a worker's rows a push later)."""
    host = dask_worker.extensions[EXTENSION].host
    host.counters.rows_done += n
    report = type(host).report

    def late(self: Any = host) -> dict[str, Any]:
        out = report(self)
        out["counters"]["rows_done"] -= n
        return out

    host.report = late


def _rows_pushed(dask_worker: Any) -> None:
    vars(dask_worker.extensions[EXTENSION].host).pop("report", None)


def test_progress_leaves_out_rows_done_before_it_started(client: Client) -> None:
    """Rows the workers finished just before the block, which the plugin hears of a push later,
    are not the block's: its count starts from the workers' own counters."""
    before = bc.metrics(client)["totals"]["rows_done"]
    client.run(_rows_done_unpushed, n=5)
    log = io.StringIO()
    try:
        with bc.progress(client, total=4, mode="lines", file=log, interval=0.05, settle=0.0):
            client.run(_rows_pushed)
            deadline = time.monotonic() + 10
            while bc.metrics(client)["totals"]["rows_done"] < before + 10 and time.monotonic() < deadline:
                time.sleep(0.05)  # the plugin now counts them
            time.sleep(0.2)  # and the bar has read it
        assert bc.metrics(client)["totals"]["rows_done"] == before + 10
        assert "0/4 rows (0%)" in log.getvalue().splitlines()[-1]
    finally:  # (the counters keep the 5 rows: they only grow, as later tests' deltas expect)
        client.run(_rows_pushed)


def _job_rows(dask_worker: Any) -> dict[str, list[int]]:
    return dask_worker.extensions[EXTENSION].host.report()["job_rows"]


def test_hosts_count_each_jobs_rows_and_error_rows(client: Client, ckpt: Path) -> None:
    """What the dashboard shows per job: each host counts the rows of its tasks by task group
    (done and failed), and the counts over the workers are the job's."""
    pdf = rows(6, lambda i: 2)
    pdf.loc[pdf.index[2], "prompt"] = ""  # fails alone (an empty prompt)
    out = dd.from_pandas(pdf, npartitions=2).map_partitions(
        bc.generate, model=ckpt, per_row={"max_tokens": "max_tokens"}, engine_options=OPTIONS, **GREEDY)
    group = key_split_group(out.__dask_keys__()[0])  # the partitions' task group, as the scheduler names it
    got = out.compute()
    assert got["error"].notna().sum() == 1
    reports = client.run(_job_rows)
    totals = [sum(r.get(group, [0, 0, 0])[i] for r in reports.values()) for i in range(3)]
    assert totals == [6, 6, 1], (group, reports)


SAMPLE = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def scrape(client: Client) -> dict[tuple[str, str], float]:
    """{(metric name, labels text): value} from the scheduler's Prometheus endpoint, over HTTP."""
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


def test_batchgen_metrics_on_the_scheduler_prometheus_endpoint(client: Client, ckpt: Path) -> None:
    """batchgen's per-worker series beside Dask's own on /metrics, while and after a job runs."""
    n = 64
    deadline = time.monotonic() + 10
    while True:  # the earlier tests' last rows reach the plugin's view with the workers' next pushes
        before = scrape(client)
        own = {w: float(n) for w, n in client.run(lambda dask_worker: dask_worker.extensions[EXTENSION]
                                                  .host.counters.rows_done).items()}
        settled = per_worker(before, "batchgen_worker_rows_total") == own
        if settled and not any(per_worker(before, "batchgen_worker_coroutines").values()) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert ("dask_scheduler_workers", 'state="idle"') in before  # Dask's own series, same endpoint
    assert not any(per_worker(before, "batchgen_worker_coroutines").values())  # nothing in flight
    rows_before = per_worker(before, "batchgen_worker_rows_total")
    tokens_before = per_worker(before, "batchgen_worker_generated_tokens_total")
    pdf = pd.DataFrame({"prompt": [f"row {i} says" for i in range(n)]})
    future = client.compute(dd.from_pandas(pdf, npartitions=4).map_partitions(
        bc.generate, model=ckpt, max_tokens=32, engine_options=OPTIONS, **GREEDY))
    busy: dict[str, float] = {}
    while not future.done():  # while it runs: rows in flight on the workers
        busy = {w: v for w, v in per_worker(scrape(client), "batchgen_worker_coroutines").items() if v > 0}
        if busy:
            break
        time.sleep(0.05)
    result = future.result()
    assert busy and set(busy) <= set(workers(client))

    def added(samples: dict[tuple[str, str], float], name: str, was: dict[str, float]) -> float:
        return sum(v - was.get(w, 0.0) for w, v in per_worker(samples, name).items())

    deadline = time.monotonic() + 10
    while True:  # the workers' last pushes land within a push interval or two
        samples = scrape(client)
        if added(samples, "batchgen_worker_rows_total", rows_before) >= n or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert added(samples, "batchgen_worker_rows_total", rows_before) == n
    assert added(samples, "batchgen_worker_generated_tokens_total", tokens_before) \
        == result["num_generated_tokens"].sum() == 32 * n
    rows = per_worker(samples, "batchgen_worker_rows_total")
    for name in ("batchgen_worker_tokens_per_second", "batchgen_worker_kv_used_ratio",
                 "batchgen_worker_expert_hit_ratio", "batchgen_worker_migrated_in_total"):
        assert set(per_worker(samples, name)) == set(rows), name
    assert per_worker(samples, "batchgen_worker_expert_hit_ratio")[workers(client)[0]] == 1.0  # all resident
    assert 0.0 <= max(per_worker(samples, "batchgen_worker_kv_used_ratio").values()) <= 1.0
    assert ("batchgen_migrations_total", "") in samples


def test_long_partitions_migrate_to_the_idle_worker(client: Client, ckpt: Path, reference: Any) -> None:
    busy, idle = workers(client)
    # long enough that the balancer acts before they end, on a busy machine and on a fast one (context 512)
    long_parts = [rows(8, lambda i: 400 + 10 * i, start=100 + 10 * k) for k in range(2)]
    short = rows(4, lambda i: 2, start=200)
    before = bc.metrics(client)["migrations"]
    futures = [submit(client, p, ckpt, busy) for p in long_parts] + [submit(client, short, ckpt, idle)]
    outs = client.gather(futures)
    for pdf, out in zip([*long_parts, short], outs):
        assert out["generated_text"].tolist() == reference(pdf)
        assert out["num_generated_tokens"].tolist() == pdf["max_tokens"].tolist()
    # both long partitions waited at once on a 1-thread worker: their tasks seceded
    assert client.run(lambda dask_worker: dask_worker.extensions[EXTENSION].host.peak_jobs, workers=[busy])[busy] >= 2
    time.sleep(0.5)  # the last counters arrive with the next pushes
    m = bc.metrics(client)
    why = {k: m[k] for k in ("orders", "ordered_coroutines", "by_reason")}
    assert m["migrations"] > before, (why, {w: {k: v for k, v in m["workers"][w].items() if k != "timeline"}
                                            for w in (busy, idle)})
    assert m["workers"][busy]["migrated_out"] > 0 and m["workers"][idle]["migrated_in"] > 0
    assert m["workers"][idle]["returned"] > 0


def test_worker_killed_mid_job_loses_and_duplicates_nothing(client: Client, ckpt: Path, reference: Any) -> None:
    owner, holder = workers(client)
    long_part = rows(8, lambda i: 400 + 10 * i, start=300)  # the tiny model's context is 512
    short = rows(4, lambda i: 2, start=400)
    before_sent, before_recovered = counter_on(client, owner, "migrated_out"), counter_on(client, owner, "recovered")
    futures = [submit(client, long_part, ckpt, owner, loose=True), submit(client, short, ckpt, holder, loose=True)]
    deadline = time.monotonic() + 60
    # kill as soon as the owner has sent coroutines to the holder: they are then in flight to it
    # or running there, and the owner holds their states (killed when the plugin has only ordered
    # the move, the owner may never send them, and nothing is left to recover)
    while counter_on(client, owner, "migrated_out") == before_sent:
        assert time.monotonic() < deadline and not futures[0].done(), "no coroutine was sent"
        time.sleep(0.02)
    pid = client.run(os.getpid, workers=[holder])[holder]
    os.kill(pid, signal.SIGKILL)
    outs = client.gather(futures)
    for pdf, out in zip([long_part, short], outs):
        assert list(out.index) == list(pdf.index)
        assert out["generated_text"].tolist() == reference(pdf)
        assert out["num_generated_tokens"].tolist() == pdf["max_tokens"].tolist()
    assert counter_on(client, owner, "recovered") > before_recovered


def engines_loaded(client: Client) -> list[int]:
    return list(client.run(lambda dask_worker: len(dask_worker.extensions[EXTENSION].host.loads())).values())


def test_graph_construction_prestarts_engines_and_jobs_report_their_fixed_costs(client: Client, ckpt: Path,
                                                                                   reference: Any) -> None:
    """map_partitions' meta call starts the engine on every worker before compute(); each
    worker's timeline (in metrics) then shows the job's task start, first and last token."""
    client.wait_for_workers(2, timeout=60)
    bc.release(client)
    assert engines_loaded(client) == [0, 0]
    pdf = rows(6, lambda i: 3 + i)
    lazy = dd.from_pandas(pdf, npartitions=2).map_partitions(bc.generate, model=ckpt, per_row={"max_tokens": "max_tokens"},
                                                              engine_options=OPTIONS, **GREEDY)
    deadline = time.monotonic() + 60
    while engines_loaded(client) != [1, 1] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engines_loaded(client) == [1, 1], "no engine started before compute()"
    before = time.time()
    assert lazy.compute()["generated_text"].tolist() == reference(pdf)
    time.sleep(0.4)  # the next load pushes carry the final timelines
    periods = [m["timeline"]["period"] for m in worker_metrics(client).values()]
    mine = [p for p in periods if p is not None and p["started"] >= before]
    assert mine, periods
    for p in mine:
        assert p["tasks"] >= 1 and p["ended"] is not None and p["engine_loading"] is None  # loaded ahead
        if p["tokens"]:
            assert p["started"] <= p["first_token"] <= p["last_token"]
    assert sum(p["tokens"] for p in mine) <= int(pdf["max_tokens"].sum())


def test_release_stops_idle_engines_and_keeps_the_plugin(client: Client, ckpt: Path, reference: Any) -> None:
    client.wait_for_workers(2, timeout=60)
    client.gather([submit(client, rows(1, lambda i: 1), ckpt, w) for w in workers(client)])
    assert engines_loaded(client) == [1, 1]
    assert bc.release(client, model="/not/this/model") == 0 and engines_loaded(client) == [1, 1]
    assert bc.release(client) == 2
    assert engines_loaded(client) == [0, 0] and bc.is_installed(client)
    assert bc.install(client) is False  # already there: kept, engines and all
    pdf = rows(3, lambda i: 4)
    for w in workers(client):  # an engine starts again on demand
        assert submit(client, pdf, ckpt, w).result()["generated_text"].tolist() == reference(pdf)
    assert engines_loaded(client) == [1, 1]


def test_disconnect_removes_plugin_and_handlers(client: Client) -> None:
    client.wait_for_workers(2, timeout=60)
    bc.disconnect(client)
    assert not client.run_on_scheduler(lambda dask_scheduler: PLUGIN_NAME in dask_scheduler.plugins
                                       or any(h.startswith("batchgen") for h in dask_scheduler.handlers))
    left = client.run(lambda dask_worker: (any(h.startswith("batchgen") for h in dask_worker.handlers),
                                           WORKER_PLUGIN in dask_worker.plugins, EXTENSION in dask_worker.extensions))
    assert list(left.values()) == [(False, False, False)] * 2
    after = scrape(client)  # the Prometheus collector goes with the plugin; Dask's own series stay
    assert not [k for k in after if k[0].startswith("batchgen_")]
    assert ("dask_scheduler_workers", 'state="idle"') in after
    bc.connect(client=client)
    assert bc.is_installed(client)
    assert bc.install(client, push_interval=0.1) is True  # new settings: re-registered


def test_connect_without_address_starts_a_local_cluster_with_the_plugin() -> None:
    own = bc.connect(n_workers=1)
    try:
        assert len(own.scheduler_info()["workers"]) == 1 and bc.is_installed(own)
        threads = own.run(lambda: os.environ.get("OMP_NUM_THREADS"))
        assert list(threads.values()) == [str(os.cpu_count() or 1)]  # one worker gets every core
    finally:
        cluster = own.cluster
        own.close()
        cluster.close()


def test_gpu_layout_gives_each_worker_its_own_device() -> None:
    from batchgen.cluster.client import gpu_worker_spec

    spec = gpu_worker_spec(3, gpus=2, cpu_threads=4)
    assert [s["options"]["env"]["CUDA_VISIBLE_DEVICES"] for s in spec.values()] == ["0", "1", "0"]
    assert all(s["options"]["nthreads"] == 1 for s in spec.values())
