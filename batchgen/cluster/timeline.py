"""A host's timeline of a job's fixed costs: when its tasks started, when an engine loaded,
when the rows reached the engine, when the first and the last token came, when the tasks' rows
were all back and when the last task returned (wall clock, so a client can set them against its
own `compute()` time on the same machine or NTP-synced ones); and where the engine thread's time
went meanwhile: forwards, commands (rows added, coroutines suspended / resumed for migration,
progress snapshots), load snapshots for the balancer, and waiting with nothing to run.

A *busy period* runs from the first task that opens on an idle host to the return of the last
one; one `compute()` of a batchgen job is one busy period per worker. Tokens generated after
it (rows held for other workers' tasks) still move `last_token`. Torch-free; thread-safe (tasks,
the engine thread and the event loop all report here).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class BusyPeriod:
    started: float  # the period's first task opened its job here
    engine_loading: float | None = None  # an engine began loading during the period
    engine_ready: float | None = None  # ...and had loaded
    first_token: float | None = None  # first step that generated tokens in the period
    last_token: float | None = None
    ended: float | None = None  # the last task of the period returned
    tasks: int = 0
    tokens: int = 0
    rows_queued: float | None = None  # the first task's rows were in the engine
    rows_back: float | None = None  # the last task had all its rows' outputs (then: assembly, return)
    steps: int = 0  # engine steps in the period
    step_s: float = 0.0  # engine thread: inside step() (forwards, sampling)
    first_step_s: float = 0.0  # the period's first step (the prefill of the first rows)
    command_s: float = 0.0  # engine thread: commands (add rows, suspend / resume, snapshots for owners)
    snapshot_s: float = 0.0  # engine thread: load snapshots for the balancer
    idle_s: float = 0.0  # engine thread: nothing to run while the period was open


class Timeline:
    def __init__(self, clock: Any = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._open = 0
        self.current: BusyPeriod | None = None  # the running period, or the last one
        self.last_token: float | None = None  # last step with tokens, in a period or not
        self.engine_ready: float | None = None  # last engine load that finished, whenever

    def _running(self) -> BusyPeriod | None:
        p = self.current
        return p if p is not None and p.ended is None else None

    def task_opened(self) -> None:
        with self._lock:
            now = self._clock()
            if self._open == 0:
                self.current = BusyPeriod(now)
            self._open += 1
            assert self.current is not None
            self.current.tasks += 1

    def rows_queued(self) -> None:
        with self._lock:
            p = self._running()
            if p is not None and p.rows_queued is None:
                p.rows_queued = self._clock()

    def rows_back(self) -> None:
        with self._lock:
            p = self._running()
            if p is not None:
                p.rows_back = self._clock()

    def task_closed(self) -> None:
        with self._lock:
            self._open = max(0, self._open - 1)
            if self._open == 0 and self.current is not None:
                self.current.ended = self._clock()

    def engine_loading(self) -> None:
        with self._lock:
            if self.current is not None and self.current.ended is None and self.current.engine_loading is None:
                self.current.engine_loading = self._clock()

    def engine_loaded(self) -> None:
        with self._lock:
            now = self.engine_ready = self._clock()
            if self.current is not None and self.current.ended is None:
                self.current.engine_ready = now

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        with self._lock:
            now = self.last_token = self._clock()
            p = self.current
            if p is not None and p.ended is None:
                if p.first_token is None:
                    p.first_token = now
                p.last_token = now
                p.tokens += n

    def stepped(self, seconds: float) -> None:
        """One engine step took `seconds` (its tokens go to `tokens`)."""
        with self._lock:
            p = self._running()
            if p is not None:
                if p.steps == 0:
                    p.first_step_s = seconds
                p.steps += 1
                p.step_s += seconds

    def spent(self, kind: str, seconds: float) -> None:
        """Engine-thread time outside steps: kind "command", "snapshot" or "idle"."""
        with self._lock:
            p = self._running()
            if p is not None:
                name = f"{kind}_s"
                setattr(p, name, getattr(p, name) + seconds)

    def as_dict(self) -> dict[str, Any]:
        """{"period": the current or last busy period (None before any), "last_token", "engine_ready"}."""
        with self._lock:
            period = dataclasses.asdict(self.current) if self.current is not None else None
            return {"period": period, "last_token": self.last_token, "engine_ready": self.engine_ready}
