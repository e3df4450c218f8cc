"""The Bokeh figures of batchgen's dashboard page and of its HTML report, over the plain
columns of dashboard_data.py. Both the live page (dashboard_page.py) and the offline report
(report.py) build their layout here, so they show the same charts. Needs bokeh.
"""
from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bokeh.layouts import column
from bokeh.models import ColumnDataSource, DatetimeTickFormatter, FactorRange, HoverTool, LayoutDOM, Range1d
from bokeh.models.widgets import Div
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from .dashboard_data import WORKER_FIELDS, JobProgress, bar_columns

STRAGGLER, NORMAL = "#d62728", "#1f77b4"
HISTORY_POINTS = 600  # per worker line: 10 minutes at one refresh a second
BAR_MIN_H, BAR_PX = 240, 11  # the per-worker chart's height: at least, and per bar


@dataclass(slots=True)
class Charts:
    """The page's models; `refresh` in dashboard_page.py sets their data."""

    layout: LayoutDOM
    summary: Div
    jobs: ColumnDataSource
    job_range: FactorRange
    workers: ColumnDataSource
    bars: ColumnDataSource
    bar_figure: Any
    worker_range: FactorRange
    worker_table: Div
    models: Div
    timeseries: Any  # the tokens/s figure: one line per worker, added as workers appear
    migrations: ColumnDataSource
    periods: ColumnDataSource
    period_range: FactorRange
    # Ranges the server sets: a browser auto-ranging a DataRange1d sends every new start/end
    # back to the scheduler, which then costs more than drawing the page
    time_range: Range1d
    speed_range: Range1d
    period_time: Range1d
    lines: dict[str, ColumnDataSource] = field(default_factory=dict)
    # what this document last got, per model: a refresh sends only what changed (Bokeh sends a
    # source's whole data on every assignment, equal or not)
    sent: dict[str, Any] = field(default_factory=dict)


def build(live: bool = True) -> Charts:
    """The whole layout, empty; names on the sources let a browser test find them in the page."""
    summary = Div(name="batchgen-summary", text="", width=1100)
    jobs = ColumnDataSource({"name": [], "fraction": [], "label": []}, name="batchgen-jobs")
    job_range = FactorRange(factors=[])
    jf = figure(title="Jobs (rows and partitions done / total)", y_range=job_range, x_range=Range1d(start=0, end=1),
                height=130, width=1100, toolbar_location=None, tools="")
    jf.hbar(y="name", right=1.0, height=0.7, source=jobs, color="#eeeeee")
    jf.hbar(y="name", right="fraction", height=0.7, source=jobs, color="#2ca02c")
    jf.text(x=0.01, y="name", text="label", source=jobs, text_baseline="middle", text_font_size="11px")

    # the raw per-worker numbers (what a test or a hover reads), and the bars drawn from them
    workers = ColumnDataSource({"worker": [], **{k: [] for k, _ in WORKER_FIELDS}}, name="batchgen-workers")
    bars = ColumnDataSource({"y": [], "fraction": [], "label": [], "color": []}, name="batchgen-bars")
    worker_range = FactorRange(factors=[], group_padding=0.8)
    bf = figure(title="per worker (bar: share of the largest; red: the straggler, most tokens left)",
                y_range=worker_range, x_range=Range1d(start=0, end=1.25), width=1100, height=BAR_MIN_H,
                toolbar_location=None, tools="")
    bf.hbar(y="y", right="fraction", height=0.8, source=bars, color="color")
    bf.text(x="fraction", y="y", text="label", source=bars, x_offset=4, text_baseline="middle",
            text_font_size="10px")
    bf.xaxis.visible = False
    bf.yaxis.major_label_text_font_size = "9px"
    bf.yaxis.group_label_orientation = "horizontal"  # type: ignore[attr-defined]
    bf.tags = [workers]  # no glyph draws it; this keeps it in the document for readers of the page
    worker_table = Div(name="batchgen-worker-table", text="", width=1100)
    models = Div(name="batchgen-models", text="", width=1100)

    migrations = ColumnDataSource({"t": [], "src": [], "dst": [], "rows": [], "reason": [], "model": [], "y": []},
                                  name="batchgen-migrations")
    time_range, speed_range, period_time = Range1d(start=0, end=1), Range1d(start=0, end=1), Range1d(start=0, end=1)
    ts = figure(title="tokens/s per worker, migrations (triangles)" + (" — last 10 minutes" if live else ""),
                x_axis_type="datetime", x_range=time_range, y_range=speed_range, width=1100, height=260,
                tools="xpan,xwheel_zoom,reset")
    marks = ts.scatter(x="t", y="y", marker="triangle", size=12, color="#ff7f0e", source=migrations)
    ts.add_tools(HoverTool(renderers=[marks], tooltips=[("rows", "@rows"), ("from", "@src"), ("to", "@dst"),
                                                       ("reason", "@reason")]))
    ts.xaxis.formatter = DatetimeTickFormatter(seconds="%H:%M:%S", minsec="%H:%M:%S", minutes="%H:%M")

    periods = ColumnDataSource({"worker": [], "phase": [], "start": [], "end": [], "tokens": [], "color": []},
                               name="batchgen-periods")
    period_range = FactorRange(factors=[])
    pf = figure(title="each worker's last busy period: fixed costs, generating, assembly", x_axis_type="datetime",
                x_range=period_time, y_range=period_range, width=1100, height=160, tools="xpan,xwheel_zoom,reset")
    pf.hbar(y="worker", left="start", right="end", height=0.6, color="color", source=periods, legend_field="phase")
    pf.legend.location = "top_left"
    pf.legend.orientation = "horizontal"

    layout = column(summary, jf, bf, worker_table, ts, pf, models)
    return Charts(layout, summary, jobs, job_range, workers, bars, bf, worker_range, worker_table, models, ts,
                  migrations, periods, period_range, time_range, speed_range, period_time)


def fill(c: Charts, summary: Mapping[str, float], jobs: Sequence[JobProgress], workers: Mapping[str, list[Any]],
         models: Mapping[str, list[Any]], history: Mapping[str, list[Any]], migrations: Mapping[str, list[Any]],
         periods: Mapping[str, list[Any]]) -> None:
    """Set every model's data (the page calls this each refresh, the report once)."""
    _set(c, "summary", c.summary, "text", summary_html(summary, jobs))
    names = [j.name for j in jobs]
    _set(c, "job_range", c.job_range, "factors", names)
    _set(c, "jobs", c.jobs, "data", {
        "name": names, "fraction": [j.fraction for j in jobs],
        "label": [j.label() for j in jobs]})
    _set(c, "workers", c.workers, "data", {k: workers[k] for k in ("worker", *(k for k, _ in WORKER_FIELDS))})
    bars = bar_columns(workers)
    _set(c, "worker_range", c.worker_range, "factors", bars["y"])
    _set(c, "bar height", c.bar_figure, "height", max(BAR_MIN_H, BAR_PX * len(bars["y"]) + 60))
    _set(c, "bars", c.bars, "data", {"y": bars["y"], "fraction": bars["fraction"], "label": bars["label"],
                                     "color": [STRAGGLER if s else NORMAL for s in bars["straggler"]]})
    _set(c, "worker_table", c.worker_table, "text", table_html(workers))
    _set(c, "models", c.models, "text", models_html(models))
    _extend_lines(c, history)
    times = [x for xs in history["t"] for x in xs] + list(migrations["t"])
    if times:
        _set(c, "time start", c.time_range, "start", min(times) - 1000.0)
        _set(c, "time end", c.time_range, "end", max(times) + 1000.0)
    top = max((max(ys) for ys in history["tokens_per_s"] if ys), default=0.0)
    _set(c, "speed end", c.speed_range, "end", top * 1.1 or 1.0)
    _set(c, "migrations", c.migrations, "data", {**migrations, "y": [0.0] * len(migrations["t"])})
    _set(c, "period_range", c.period_range, "factors", sorted(set(periods["worker"])))
    if periods["start"]:
        pad = max(1000.0, 0.02 * (max(periods["end"]) - min(periods["start"])))
        _set(c, "period start", c.period_time, "start", min(periods["start"]) - pad)
        _set(c, "period end", c.period_time, "end", max(periods["end"]) + pad)
    phase_colors = {"fixed costs": "#bbbbbb", "generating": "#2ca02c", "assembly": "#9467bd"}
    _set(c, "periods", c.periods, "data", {**periods, "color": [phase_colors[p] for p in periods["phase"]]})


def _set(c: Charts, key: str, model: Any, attr: str, value: Any) -> None:
    if c.sent.get(key) != value:
        c.sent[key] = value
        setattr(model, attr, value)


def _extend_lines(c: Charts, history: Mapping[str, list[Any]]) -> None:
    """Stream each worker's new points onto its line (a refresh sends seconds, not minutes)."""
    for i, worker in enumerate(history["worker"]):
        t, y = history["t"][i], history["tokens_per_s"][i]
        src = c.lines.get(worker)
        if src is None:
            src = c.lines[worker] = ColumnDataSource({"t": list(t), "tokens_per_s": list(y)},
                                                     name=f"batchgen-history {worker}")
            c.timeseries.line(x="t", y="tokens_per_s", source=src, legend_label=worker, line_width=2,
                              color=Category10_10[(len(c.lines) - 1) % 10])
            c.timeseries.legend.location = "top_left"
            continue
        last = src.data["t"][-1] if len(src.data["t"]) else -math.inf
        new = [k for k, x in enumerate(t) if x > last]
        if new:
            src.stream({"t": [t[k] for k in new], "tokens_per_s": [y[k] for k in new]}, rollover=HISTORY_POINTS)


def eta_text(seconds: float) -> str:
    if math.isinf(seconds):
        return "–"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m {s:02d}s" if m else f"{s}s"


def summary_html(s: Mapping[str, float], jobs: Sequence[JobProgress]) -> str:
    failed = sum(j.erred for j in jobs)
    error_rows = sum(j.rows_failed for j in jobs)
    items = [("rows done", f"{int(s['rows_done'])}"), ("rows in flight", f"{int(s['rows_in_flight'])}"),
             ("tokens/s", f"{s['tokens_per_s']:.1f}"), ("ETA (rows in flight)", eta_text(s["eta_s"])),
             ("migrations", f"{int(s['migrations'])}"), ("error rows", f"{error_rows}"),
             ("failed partitions", f"{failed}")]
    cells = "".join(f'<td style="padding:0 18px 0 0"><div style="color:#666;font-size:11px">{k}</div>'
                    f'<div style="font-size:20px" data-key="{k}">{v}</div></td>' for k, v in items)
    return f'<table id="batchgen-summary"><tr>{cells}</tr></table>'


def table_html(workers: Mapping[str, list[Any]]) -> str:
    head = "".join(f"<th style='padding:0 8px'>{label}</th>" for _, label in WORKER_FIELDS)
    body = []
    for i, w in enumerate(workers["worker"]):
        cells = "".join(f"<td style='padding:0 8px;text-align:right' data-key='{key}'>{_num(workers[key][i])}</td>"
                        for key, _ in WORKER_FIELDS)
        mark = " (straggler)" if workers["straggler"][i] else ""
        body.append(f"<tr data-worker='{html.escape(w)}'><td>{html.escape(w)}{mark}</td>{cells}</tr>")
    return (f"<table id='batchgen-worker-table' style='font-size:12px'><tr><th>worker</th>{head}</tr>"
            + "".join(body) + "</table>")


def models_html(models: Mapping[str, list[Any]]) -> str:
    if len(set(models["model"])) < 2:  # one model: the worker bars already say it all
        return ""
    keys = ("waiting", "running", "tokens_per_s", "kv_used", "remaining_tokens")
    head = "".join(f"<th style='padding:0 8px'>{k}</th>" for k in keys)
    body = "".join(
        f"<tr><td>{html.escape(models['worker'][i])}</td><td>{html.escape(models['model'][i][-60:])}</td>"
        + "".join(f"<td style='padding:0 8px;text-align:right'>{_num(models[k][i])}</td>" for k in keys) + "</tr>"
        for i in range(len(models["worker"])))
    return ("<b>per model</b> (work counted in each engine's units: tokens, or image-token steps)"
            f"<table id='batchgen-models' style='font-size:12px'><tr><th>worker</th><th>model</th>{head}</tr>"
            f"{body}</table>")


def _num(x: float) -> str:
    return f"{int(x)}" if float(x).is_integer() else f"{x:.2f}"

