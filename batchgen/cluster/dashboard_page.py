"""The live `batchgen` page: a Bokeh document per browser session that redraws the balance
plugin's load view once a second. Everything runs in that session's periodic callback on the
scheduler's event loop, so with no browser connected nothing runs at all. Needs bokeh.
Design: docs/guides/dashboard.md.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from bokeh.document import Document
from distributed.dashboard.components.scheduler import BOKEH_THEME, env

from . import dashboard_charts
from .dashboard_data import (
    History,
    JobProgress,
    LoadView,
    job_progress,
    job_rows,
    migration_events,
    model_columns,
    period_columns,
    summary,
    worker_columns,
)

if TYPE_CHECKING:
    from distributed import Scheduler

REFRESH_MS = 1000
MAX_JOBS = 8  # progress bars kept on the page (the newest jobs)


class PageState:
    """What the page's sessions share: the plugin, the tokens/s history, and the task groups
    seen to be batchgen jobs (groups with a task seceded on a worker that reports batchgen
    jobs: batchgen partition tasks secede while their rows run)."""

    def __init__(self, plugin: LoadView) -> None:
        self.plugin = plugin
        self.history = History()
        self.jobs: dict[str, JobProgress] = {}  # group name -> last progress seen, oldest first
        # the scheduler thread's CPU time in the sessions' refreshes (reading, drawing, sending)
        self.refresh_cpu_s = 0.0
        self.refreshes = 0

    def _see_jobs(self, scheduler: Scheduler) -> list[JobProgress]:
        for addr, ws in scheduler.workers.items():
            view = self.plugin.views.get(addr)
            if view is None or not view.report.get("jobs", 0):
                continue
            for ts in ws.long_running:
                name = ts.group.name
                if name not in self.jobs:
                    self.jobs[name] = JobProgress(name, len(ts.group), 0, 0, 0)
        rows = job_rows(view.report for view in self.plugin.views.values())
        for progress in job_progress(scheduler.task_groups, list(self.jobs), rows):
            self.jobs[progress.name] = progress
        for name in list(self.jobs)[:-MAX_JOBS]:
            del self.jobs[name]
        for name, progress in self.jobs.items():
            if name not in scheduler.task_groups and not progress.erred:  # its results were released: done
                progress.done, progress.running = progress.total, 0
            if name in rows:  # rows are counted on the workers, after the task group is gone too
                progress.rows_total, progress.rows_done, progress.rows_failed = rows[name]
        return list(self.jobs.values())

    def snapshot(self) -> dict[str, Any]:
        """Everything `dashboard_charts.fill` takes, read now."""
        plugin = self.plugin
        view = plugin.metrics()
        self.history.sample(view)
        jobs = self._see_jobs(plugin.scheduler) if plugin.scheduler is not None else list(self.jobs.values())
        return {"summary": summary(view), "jobs": jobs, "workers": worker_columns(view),
                "models": model_columns({w: v.report for w, v in plugin.views.items()}),
                "history": self.history.lines(),
                "migrations": migration_events(plugin.log, time.monotonic(), time.time()),
                "periods": period_columns(view)}


def batchgen_doc(state: PageState, scheduler: Scheduler, extra: dict[str, Any], doc: Document) -> None:
    """The Bokeh application function (distributed's BokehApplication passes `scheduler` and
    the dashboard's template variables, so the page carries Dask's navigation bar)."""
    charts = dashboard_charts.build(live=True)

    def refresh() -> None:
        started = time.thread_time()
        doc.hold("combine")  # one patch message per refresh, not one per changed property
        try:
            dashboard_charts.fill(charts, **state.snapshot())
        finally:
            doc.unhold()  # serializes the patch and queues it on the session's websocket
            state.refresh_cpu_s += time.thread_time() - started
            state.refreshes += 1

    refresh()
    doc.add_periodic_callback(refresh, REFRESH_MS)
    doc.title = "Dask: batchgen"
    doc.add_root(charts.layout)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME
