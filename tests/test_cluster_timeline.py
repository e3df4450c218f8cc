"""The host timeline of a job's fixed costs (pure, with a fake clock)."""
from __future__ import annotations

from batchgen.cluster.timeline import BusyPeriod, Timeline


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_busy_period_runs_from_the_first_task_to_the_last_return() -> None:
    clock = Clock()
    t = Timeline(clock)
    t.tokens(5)  # before any task: only the host-wide last token moves
    assert t.as_dict() == {"period": None, "last_token": 100.0, "engine_ready": None}
    clock.now = 101.0
    t.task_opened()
    clock.now = 101.5
    t.engine_loading()
    clock.now = 103.0
    t.engine_loaded()
    t.task_opened()  # a second partition joins the same period
    clock.now = 104.0
    t.tokens(0)  # a step that generated nothing (prefill chunk) is no token
    t.tokens(3)
    clock.now = 109.0
    t.tokens(2)
    t.task_closed()
    assert t.current is not None and t.current.ended is None  # one task still waits
    clock.now = 110.0
    t.task_closed()
    assert t.current == BusyPeriod(started=101.0, engine_loading=101.5, engine_ready=103.0, first_token=104.0,
                                   last_token=109.0, ended=110.0, tasks=2, tokens=5)
    clock.now = 112.0
    t.tokens(4)  # rows held for another worker's task, after this host's own tasks returned
    assert t.as_dict()["last_token"] == 112.0 and t.as_dict()["period"]["last_token"] == 109.0
    clock.now = 120.0
    t.engine_loading()  # an engine prestarted between jobs belongs to no period
    t.engine_loaded()
    t.task_opened()
    assert t.current == BusyPeriod(started=120.0, tasks=1)
    assert t.as_dict()["engine_ready"] == 120.0
