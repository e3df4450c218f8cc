"""What the dashboard page and the HTML report draw, as plain columns: built from the balance
plugin's load view (`BalancePlugin.metrics()`, its per-model reports and its order log) and
from the scheduler's own task groups, with no Bokeh and no I/O, so tests can check the figures
without a browser. Design: docs/guides/dashboard.md.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


class LoadView(Protocol):
    """What the page reads from the balance plugin (BalancePlugin satisfies it)."""

    scheduler: Any  # distributed.Scheduler, or None once closed
    views: Mapping[str, Any]  # worker -> WorkerView (`.report`: the worker's last load push)
    log: list[tuple[float, Any]]  # (monotonic time, Migration) of recent orders

    def metrics(self) -> dict[str, Any]: ...


# the worker bars, in the order the page draws them: (metrics key, label)
WORKER_FIELDS = (
    ("waiting", "waiting"), ("running", "running"), ("tokens_per_s", "tokens/s"), ("kv_used", "KV used"),
    ("expert_hit_rate", "expert hits"), ("migrated_in", "migrated in"), ("migrated_out", "migrated out"),
    ("rows_done", "rows done"), ("remaining_tokens", "tokens left"),
)
DONE_STATES = ("memory", "released", "forgotten")  # a task group's tasks that finished


def worker_columns(view: Mapping[str, Any]) -> dict[str, list[Any]]:
    """One row per worker: {"worker": [...], <each WORKER_FIELDS key>: [...], "straggler": [...]}.

    The straggler is the worker with the most tokens left (the one the job waits for), marked
    so the bars can colour it."""
    workers: Mapping[str, Mapping[str, Any]] = view.get("workers", {})
    names = sorted(workers)
    cols: dict[str, list[Any]] = {"worker": names}
    for key, _ in WORKER_FIELDS:
        cols[key] = [float(workers[w].get(key, 0.0) or 0.0) for w in names]
    left = cols["remaining_tokens"]
    worst = max(range(len(names)), key=lambda i: left[i]) if names and max(left) > 0 else -1
    cols["straggler"] = [i == worst for i in range(len(names))]
    return cols


def bar_columns(workers: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
    """`worker_columns` as one bar per (figure, worker): its length a fraction of that figure's
    largest value (so one chart holds every figure), its label the value itself. Listed bottom
    up, as Bokeh stacks factors: the first figure and the first worker come out on top."""
    cols: dict[str, list[Any]] = {"y": [], "fraction": [], "label": [], "straggler": []}
    for key, label in reversed(WORKER_FIELDS):
        values = workers[key]
        top = max([*values, 0.0])
        for i in reversed(range(len(workers["worker"]))):
            w = workers["worker"][i]
            cols["y"].append((label, w))
            cols["fraction"].append(values[i] / top if top > 0 else 0.0)
            cols["label"].append(f"{values[i]:.0f}" if float(values[i]).is_integer() or values[i] >= 100
                                 else f"{values[i]:.2f}")
            cols["straggler"].append(workers["straggler"][i])
    return cols


def model_columns(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, list[Any]]:
    """One row per (worker, engine): the same load per model, from each worker's last report
    (`WorkerView.report`). Image engines count work in image-token steps, text engines in tokens."""
    cols: dict[str, list[Any]] = {k: [] for k in ("worker", "model", "waiting", "running", "tokens_per_s",
                                                  "kv_used", "remaining_tokens")}
    for worker in sorted(reports):
        for model, e in sorted(reports[worker].get("engines", {}).items()):
            cols["worker"].append(worker)
            cols["model"].append(model)
            for key in ("waiting", "running", "tokens_per_s", "kv_used", "remaining_tokens"):
                cols[key].append(float(e.get(key, 0.0)))
    return cols


@dataclass(slots=True)
class JobProgress:
    """One batchgen job as the scheduler sees it: a task group of partition tasks."""

    name: str
    total: int  # partitions
    done: int
    erred: int
    running: int
    rows_total: int = 0  # rows of the partitions started so far (the workers' reports)
    rows_done: int = 0
    rows_failed: int = 0  # rows that ended in an error (their error column says why)

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 0.0

    def label(self) -> str:
        rows = f"{self.rows_done}/{self.rows_total} rows, " if self.rows_total else ""
        failed = f", {self.rows_failed} error rows" if self.rows_failed else ""
        erred = f", {self.erred} failed" if self.erred else ""
        return f"{self.name}: {rows}{self.done}/{self.total} partitions{erred}{failed}"


def job_rows(reports: Iterable[Mapping[str, Any]]) -> dict[str, list[int]]:
    """Task group -> [rows, rows done, rows failed], summed over the workers' load reports
    (each host counts the rows of its tasks: host.py `job_rows`)."""
    out: dict[str, list[int]] = {}
    for report in reports:
        for group, counts in (report.get("job_rows") or {}).items():
            total = out.setdefault(group, [0, 0, 0])
            for i, n in enumerate(counts[:3]):
                total[i] += int(n)
    return out


def job_progress(groups: Mapping[str, Any], names: Iterable[str],
                 rows: Mapping[str, list[int]] | None = None) -> list[JobProgress]:
    """The progress of the task groups `names` (distributed TaskGroup objects: `states`, `len`),
    with their rows from `rows` (job_rows)."""
    out = []
    for name in names:
        tg = groups.get(name)
        if tg is None:
            continue
        states: Mapping[str, int] = tg.states
        r = (rows or {}).get(name, [0, 0, 0])
        out.append(JobProgress(name, len(tg), sum(states.get(s, 0) for s in DONE_STATES),
                               states.get("erred", 0), states.get("processing", 0), r[0], r[1], r[2]))
    return out


def summary(view: Mapping[str, Any]) -> dict[str, float]:
    """Cluster totals: rows done, rows in flight, tokens, tokens/s, tokens left, ETA (seconds at
    the current speed; inf while nothing generates)."""
    workers: Mapping[str, Mapping[str, Any]] = view.get("workers", {})
    totals: Mapping[str, float] = view.get("totals", {})
    speed = float(totals.get("tokens_per_s", 0.0))
    left = float(sum(w.get("remaining_tokens", 0) for w in workers.values()))
    return {"rows_done": float(totals.get("rows_done", 0)),
            "rows_in_flight": float(sum(w.get("coroutines", 0) for w in workers.values())),
            "generated_tokens": float(totals.get("generated_tokens", 0)), "tokens_per_s": speed,
            "remaining_tokens": left, "eta_s": left / speed if speed > 0 else (0.0 if left == 0 else float("inf")),
            "migrations": float(view.get("migrations", 0)), "orders": float(view.get("orders", 0))}


def migration_events(log: Iterable[tuple[float, Any]], now_monotonic: float, now_wall: float) -> dict[str, list[Any]]:
    """The plugin's order log (monotonic time, Migration) as wall-clock events in milliseconds
    (Bokeh's datetime axis unit)."""
    cols: dict[str, list[Any]] = {"t": [], "src": [], "dst": [], "rows": [], "reason": [], "model": []}
    for t, order in log:
        cols["t"].append((now_wall - (now_monotonic - t)) * 1000.0)
        cols["src"].append(order.src)
        cols["dst"].append(order.dst)
        cols["rows"].append(len(order.seq_ids))
        cols["reason"].append(order.reason)
        cols["model"].append(order.model)
    return cols


@dataclass(slots=True)
class History:
    """tokens/s per worker over the last `window_s`, sampled only when a page refreshes (so it
    costs nothing while no browser is connected), at most once per `min_gap_s` whichever
    page asks."""

    window_s: float = 600.0
    min_gap_s: float = 0.9
    samples: deque[tuple[float, dict[str, float]]] = field(default_factory=deque)

    def sample(self, view: Mapping[str, Any], now: float | None = None) -> None:
        now = time.time() if now is None else now
        if self.samples and now - self.samples[-1][0] < self.min_gap_s:
            return
        speeds = {w: float(v.get("tokens_per_s", 0.0)) for w, v in view.get("workers", {}).items()}
        self.samples.append((now, speeds))
        while self.samples and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()

    def lines(self) -> dict[str, list[Any]]:
        """{"worker": [...], "t": [[ms, ...] per worker], "tokens_per_s": [[...] per worker]}."""
        workers = sorted({w for _, s in self.samples for w in s})
        xs: list[list[float]] = [[] for _ in workers]
        ys: list[list[float]] = [[] for _ in workers]
        for t, speeds in self.samples:
            for i, w in enumerate(workers):
                if w in speeds:
                    xs[i].append(t * 1000.0)
                    ys[i].append(speeds[w])
        return {"worker": workers, "t": xs, "tokens_per_s": ys}

    def as_list(self) -> list[tuple[float, dict[str, float]]]:
        return list(self.samples)


def period_columns(view: Mapping[str, Any]) -> dict[str, list[Any]]:
    """Each worker's last busy period (timeline.py) as bars on a wall-clock axis, in ms:
    start -> first token (fixed costs), first -> last token (generating), last token -> end."""
    cols: dict[str, list[Any]] = {"worker": [], "phase": [], "start": [], "end": [], "tokens": []}
    for worker, w in sorted(view.get("workers", {}).items()):
        period = (w.get("timeline") or {}).get("period")
        if not period:
            continue
        start, first, last, end = (period.get(k) for k in ("started", "first_token", "last_token", "ended"))
        phases = [("fixed costs", start, first or last or end), ("generating", first, last),
                  ("assembly", last, end)]
        for phase, a, b in phases:
            if a is not None and b is not None and b >= a:
                cols["worker"].append(worker)
                cols["phase"].append(phase)
                cols["start"].append(a * 1000.0)
                cols["end"].append(b * 1000.0)
                cols["tokens"].append(int(period.get("tokens", 0)))
    return cols
