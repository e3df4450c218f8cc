"""The dashboard's figures from the plugin's load view, without a browser: the
straggler, the ETA, the job bars, the migration events and the tokens/s history; and the
plugin on a cluster when the page cannot be registered (no dashboard, or no bokeh)."""
from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest

from batchgen.cluster import dashboard
from batchgen.cluster.dashboard_data import (
    History,
    bar_columns,
    job_progress,
    job_rows,
    migration_events,
    period_columns,
    summary,
    worker_columns,
)
from batchgen.policy.balance import Migration


def view(**left: int) -> dict[str, Any]:
    workers = {w: {"coroutines": 2, "waiting": 1, "running": 1, "remaining_tokens": n, "tokens_per_s": 10.0,
                   "rows_done": 3, "migrated_in": 0, "migrated_out": 1} for w, n in left.items()}
    return {"workers": workers, "totals": {"rows_done": 3 * len(left), "tokens_per_s": 10.0 * len(left)},
            "migrations": 1, "orders": 1}


def test_the_straggler_is_the_worker_with_most_tokens_left() -> None:
    cols = worker_columns(view(b=30, a=500, c=7))
    assert cols["worker"] == ["a", "b", "c"] and cols["straggler"] == [True, False, False]
    assert cols["remaining_tokens"] == [500.0, 30.0, 7.0]
    assert worker_columns(view(a=0, b=0))["straggler"] == [False, False]  # nothing left: no straggler


def test_bars_are_shares_of_each_figures_largest_value() -> None:
    bars = bar_columns(worker_columns(view(a=500, b=125)))
    left = {y[1]: (f, label) for y, f, label in zip(bars["y"], bars["fraction"], bars["label"]) if y[0] == "tokens left"}
    assert left == {"a": (1.0, "500"), "b": (0.25, "125")}
    assert bars["y"][-1] == ("waiting", "a")  # drawn bottom up: the first figure's first worker on top
    assert bars["straggler"][-1] and not bars["straggler"][-2]


def test_summary_eta_is_tokens_left_over_the_cluster_speed() -> None:
    s = summary(view(a=300, b=100))
    assert s["eta_s"] == pytest.approx(400 / 20.0) and s["rows_in_flight"] == 4 and s["rows_done"] == 6
    idle = view(a=5)
    idle["totals"]["tokens_per_s"] = 0.0
    assert summary(idle)["eta_s"] == float("inf") and summary({})["eta_s"] == 0.0


class Group:  # the part of distributed's TaskGroup the page reads
    def __init__(self, states: dict[str, int], n: int) -> None:
        self.states, self.n = states, n

    def __len__(self) -> int:
        return self.n


def test_job_progress_counts_finished_and_failed_partitions() -> None:
    states = {"memory": 2, "released": 1, "processing": 3, "erred": 1, "waiting": 1}
    groups = {"generate-x": Group(states, 8)}
    (job,) = job_progress(groups, ["generate-x", "gone"])
    assert (job.total, job.done, job.erred, job.running, job.fraction) == (8, 3, 1, 3, 3 / 8)


def test_job_rows_sum_the_workers_counts_and_label_the_errors() -> None:
    reports = [{"job_rows": {"generate-x": [10, 7, 1], "other": [3, 3, 0]}}, {"job_rows": {"generate-x": [6, 6, 2]}},
               {}]  # a worker with no batchgen task reports none
    rows = job_rows(reports)
    assert rows == {"generate-x": [16, 13, 3], "other": [3, 3, 0]}
    groups = {"generate-x": Group({"memory": 3, "processing": 1}, 4)}
    (job,) = job_progress(groups, ["generate-x"], rows)
    assert (job.rows_total, job.rows_done, job.rows_failed) == (16, 13, 3)
    assert job.label() == "generate-x: 13/16 rows, 3/4 partitions, 3 error rows"
    (bare,) = job_progress(groups, ["generate-x"])  # no reports yet: partitions only
    assert bare.label() == "generate-x: 3/4 partitions"


def test_migration_events_are_wall_clock_milliseconds() -> None:
    order = Migration("w1", "w2", "m", (1, 2, 3), 90, "migrate")
    ev = migration_events([(100.0, order)], now_monotonic=110.0, now_wall=1000.0)
    assert ev["t"] == [990_000.0] and ev["rows"] == [3] and (ev["src"], ev["dst"]) == (["w1"], ["w2"])


def test_history_keeps_a_window_and_one_sample_per_gap() -> None:
    h = History(window_s=10.0, min_gap_s=1.0)
    for t in (0.0, 0.5, 1.0, 5.0, 12.0):
        h.sample(view(a=1), now=t)
    assert [t for t, _ in h.as_list()] == [5.0, 12.0]  # 0.5 too soon; 0 and 1 older than the window
    assert h.lines() == {"worker": ["a"], "t": [[5000.0, 12000.0]], "tokens_per_s": [[10.0, 10.0]]}


def test_period_columns_split_a_busy_period_into_phases() -> None:
    v = {"workers": {"a": {"timeline": {"period": {"started": 1.0, "first_token": 2.0, "last_token": 5.0,
                                                   "ended": 6.0, "tokens": 40}}}, "b": {"timeline": None}}}
    cols = period_columns(v)
    assert cols["phase"] == ["fixed costs", "generating", "assembly"]
    assert cols["start"] == [1000.0, 2000.0, 5000.0] and cols["end"] == [2000.0, 5000.0, 6000.0]


def test_no_page_without_a_dashboard_or_without_bokeh(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin: Any = SimpleNamespace(scheduler=None, views={}, log=[], metrics=dict)
    no_http: Any = SimpleNamespace(http_application=None)
    assert dashboard.register(no_http, plugin) is None
    monkeypatch.delitem(sys.modules, "distributed.dashboard.scheduler", raising=False)
    assert dashboard.register(SimpleNamespace(http_application=object()), plugin) is None  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "distributed.dashboard.scheduler", SimpleNamespace())
    monkeypatch.setitem(sys.modules, "bokeh.server.server", None)  # importing it raises ImportError
    assert dashboard.register(SimpleNamespace(http_application=object()), plugin) is None  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_the_plugin_runs_without_the_page_when_bokeh_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import dask
    from distributed import Client, LocalCluster

    import batchgen.cluster as bc
    from batchgen.cluster.plugin import PLUGIN_NAME

    monkeypatch.setitem(sys.modules, "bokeh.server.server", None)
    # A scheduler that finds no bokeh appends its "missing bokeh" route to the list in Dask's
    # config itself (distributed's Scheduler.__init__), so every later scheduler in this process
    # would serve that page instead of the dashboard: give it a copy of the list to spoil.
    routes = list(dask.config.get("distributed.scheduler.http.routes"))
    with dask.config.set({"distributed.scheduler.http.routes": routes}), \
            LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        bc.connect(client=client, push_interval=0.1)
        assert client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins[PLUGIN_NAME].page) is None
        assert "workers" in bc.metrics(client)
        bc.disconnect(client)
    assert "distributed.http.scheduler.missing_bokeh" not in dask.config.get("distributed.scheduler.http.routes")


def test_the_grafana_dashboard_reads_only_series_the_scheduler_exports() -> None:
    import json
    import re
    from pathlib import Path

    from batchgen.cluster.prometheus import BatchgenCollector

    path = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "batchgen.json"
    board = json.loads(path.read_text())
    used = {name for p in board["panels"] for t in p["targets"] for name in re.findall(r"batchgen_\w+", t["expr"])}
    exported = {s.name for family in BatchgenCollector(lambda: view(a=1)).collect() for s in family.samples}
    assert used and used <= exported, used - exported
