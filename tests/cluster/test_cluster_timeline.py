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


def test_engine_thread_time_is_split_by_kind_within_a_period() -> None:
    clock = Clock()
    t = Timeline(clock)
    t.stepped(9.0)  # no period yet: not counted
    t.spent("idle", 9.0)
    t.task_opened()
    clock.now = 100.5
    t.rows_queued()
    t.spent("idle", 0.25)
    t.stepped(0.5)  # the first step (prefill)
    t.stepped(0.1)
    t.spent("command", 0.05)
    t.spent("snapshot", 0.01)
    clock.now = 102.0
    t.rows_queued()  # a second task's rows: the first time is kept
    t.rows_back()
    clock.now = 102.5
    t.task_closed()
    t.stepped(7.0)  # after the period ended: not counted
    p = t.current
    assert p is not None
    assert (p.rows_queued, p.rows_back, p.ended, p.steps) == (100.5, 102.0, 102.5, 2)
    assert (p.first_step_s, p.step_s, p.command_s, p.snapshot_s, p.idle_s) == (0.5, 0.6, 0.05, 0.01, 0.25)
