"""A finished job as one self-contained HTML file: the dashboard page's charts, drawn once from
what the scheduler recorded (the plugin's load view with each worker's busy-period timeline,
its migration orders, and the page's tokens/s history when a browser watched the job), with
BokehJS inlined so the file opens with no network and no cluster.

    rec = batchgen.cluster.record(client)           # before the cluster goes
    batchgen.cluster.report("run.html", recorded=rec)
    batchgen.cluster.report("run.html", client)     # both at once

Needs bokeh. Design: docs/guides/dashboard.md.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bokeh.io import save
from bokeh.resources import INLINE

from . import dashboard_charts
from .dashboard_data import JobProgress, migration_events, model_columns, period_columns, summary, worker_columns
from .plugin import PLUGIN_NAME

if TYPE_CHECKING:
    from distributed import Client


def record(client: Client) -> dict[str, Any]:
    """What the report draws, as plain data read on the scheduler now; {} without the plugin."""
    return client.run_on_scheduler(_record)


def _record(dask_scheduler: Any) -> dict[str, Any]:
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    if plugin is None:
        return {}
    state = plugin.page.state if plugin.page is not None else None
    return {
        "metrics": plugin.metrics(),
        "models": {w: v.report for w, v in plugin.views.items()},
        "migrations": migration_events(plugin.log, time.monotonic(), time.time()),
        "history": state.history.lines() if state is not None else None,
        "jobs": [dataclasses.asdict(j) for j in state.jobs.values()] if state is not None else [],
        "recorded_at": time.time(),
    }


def speed_lines(view: dict[str, Any]) -> dict[str, list[Any]]:
    """Without a watched page's history: each worker's mean tokens/s over its busy period's
    generating phase (first to last token), as a flat segment."""
    out: dict[str, list[Any]] = {"worker": [], "t": [], "tokens_per_s": []}
    for worker, w in sorted(view.get("workers", {}).items()):
        p = (w.get("timeline") or {}).get("period") or {}
        first, last, tokens = p.get("first_token"), p.get("last_token"), p.get("tokens", 0)
        if first is None or last is None or last <= first:
            continue
        out["worker"].append(worker)
        out["t"].append([first * 1000.0, last * 1000.0])
        out["tokens_per_s"].append([tokens / (last - first)] * 2)
    return out


def report(path: str | Path, client: Client | None = None, *, recorded: dict[str, Any] | None = None,
           title: str = "batchgen job") -> Path:
    """Write the job's charts to `path` (one HTML file, resources inlined); -> the path.

    Reads `recorded` (from `record`) or, when not given, records from `client` now."""
    if recorded is None:
        if client is None:
            raise ValueError("report needs a client or recorded=record(client)")
        recorded = record(client)
    view = recorded.get("metrics", {})
    history = recorded.get("history") or speed_lines(view)
    jobs = [JobProgress(**j) for j in recorded.get("jobs", [])]
    charts = dashboard_charts.build(live=False)
    dashboard_charts.fill(
        charts, summary=summary(view), jobs=jobs, workers=worker_columns(view),
        models=model_columns(recorded.get("models", {})), history=history,
        migrations=recorded.get("migrations") or migration_events([], 0.0, 0.0), periods=period_columns(view))
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(recorded.get("recorded_at", time.time())))
    charts.summary.text = f"<h3>{title} — recorded {when}</h3>" + charts.summary.text
    out = Path(path)
    save(charts.layout, filename=str(out), resources=INLINE, title=title)
    return out
