"""BalancePlugin waits for an order to show in the reports before planning on them again
(no cluster: its load handler is called directly)."""
from __future__ import annotations

import time

from batchgen.cluster.plugin import BalancePlugin

M = "model"


def report(coroutines: list[tuple[int, int, int]], adopted: int = 0) -> dict:
    """coroutines: (seq_id, remaining, num_computed)."""
    return {"engines": {M: {"ready": True, "waiting": 0, "running": len(coroutines),
                            "remaining_tokens": sum(r for _, r, _ in coroutines), "kv_used": 0.1,
                            "tokens_per_s": 0.0, "speed": 0.0, "kv_capacity_tokens": 100_000, "adopted": adopted,
                            "movable": [list(c) for c in coroutines]}},
            "counters": {}}


def test_an_order_is_not_repeated_until_both_reports_show_it() -> None:
    plugin = BalancePlugin(cooldown=0.0, stale_after=0.5)
    tail = [(i, 100, 40) for i in range(6)]
    plugin.handle_load("b", report([]), 0)
    [order] = plugin.handle_load("a", report(tail), 0)["orders"]
    moved = set(order["seq_ids"])
    assert order["dst"] == "b" and len(moved) == 3
    # the cooldown is over, but a's report still lists the rows it was ordered to send and b has
    # not adopted them: the same move must not be ordered again
    plugin.handle_load("b", report([]), 0)
    assert plugin.handle_load("a", report(tail), 0)["orders"] == []
    # a sent them; b has not reported them yet: still waiting for b
    kept = [c for c in tail if c[0] not in moved]
    sent = {**report(kept), "counters": {"migrated_out": 3}}
    assert plugin.handle_load("a", sent, 0)["orders"] == []
    assert plugin.views["a"].leaving == {} and plugin.views["b"].arriving == {M: 0}
    # b adopted them: both settled, and balanced
    arrived = [(100 + i, 100, 40) for i in range(3)]
    plugin.handle_load("b", report(arrived, adopted=3), 0)
    assert plugin.views["b"].arriving == {} and plugin.views["b"].settled(time.monotonic())
    assert plugin.handle_load("a", sent, 0)["orders"] == []
    assert plugin.counters.orders == 1


def test_an_order_that_never_shows_stops_blocking_after_stale_after() -> None:
    plugin = BalancePlugin(cooldown=0.0, stale_after=0.3)
    tail = [(i, 100, 40) for i in range(6)]
    plugin.handle_load("b", report([]), 0)
    assert len(plugin.handle_load("a", report(tail), 0)["orders"]) == 1
    assert plugin.handle_load("a", report(tail), 0)["orders"] == []
    time.sleep(0.35)  # e.g. the rows finished before the order reached a: nothing will ever show
    plugin.handle_load("b", report([]), 0)
    assert len(plugin.handle_load("a", report(tail), 0)["orders"]) == 1


def test_a_report_that_leaves_out_rows_being_submitted_is_not_planned_on() -> None:
    # b's task has handed its partition to the engine thread, which has not added it yet: b's
    # report shows no work, and a split planned on it would send a's rows to a worker about to
    # get its own (then move them back)
    plugin = BalancePlugin(cooldown=0.0, stale_after=0.3)
    tail = [(i, 100, 0) for i in range(6)]
    plugin.handle_load("b", {**report([]), "jobs": 1, "submitting_rows": 128}, 0)
    assert plugin.handle_load("a", report(tail), 0)["orders"] == []
    # its next report shows them in the engine: planned on again
    plugin.handle_load("b", {**report([]), "jobs": 1, "submitting_rows": 0}, 0)
    assert len(plugin.handle_load("a", report(tail), 0)["orders"]) == 1


def test_a_report_still_behind_after_stale_after_is_planned_on() -> None:
    plugin = BalancePlugin(cooldown=0.0, stale_after=0.2)
    tail = [(i, 100, 0) for i in range(6)]
    plugin.handle_load("b", {**report([]), "submitting_rows": 5}, 0)
    assert plugin.handle_load("a", report(tail), 0)["orders"] == []
    time.sleep(0.25)  # a submission that never ends must not stop balancing for good
    plugin.handle_load("b", {**report([]), "submitting_rows": 5}, 0)
    assert len(plugin.handle_load("a", report(tail), 0)["orders"]) == 1


def test_an_order_whose_rows_finished_before_moving_does_not_keep_its_destination_waiting() -> None:
    plugin = BalancePlugin(cooldown=0.0, stale_after=30.0)
    tail = [(i, 100, 40) for i in range(6)]
    plugin.handle_load("b", report([]), 0)
    [order] = plugin.handle_load("a", report(tail), 0)["orders"]
    assert plugin.views["b"].arriving == {M: 0}
    # all of a's rows finished before it could send any (its migrated_out did not move): b gets
    # nothing, so it stops waiting at once instead of after stale_after
    plugin.handle_load("a", {**report([]), "counters": {"migrated_out": 0}}, 0)
    assert plugin.views["b"].arriving == {} and plugin.views["b"].settled(time.monotonic())
    # a new job on a is balanced onto b straight away
    plugin.handle_load("b", report([]), 0)
    assert len(plugin.handle_load("a", report([(50 + i, 100, 40) for i in range(6)]), 0)["orders"]) == 1


def test_an_order_that_was_sent_still_waits_for_the_destination() -> None:
    plugin = BalancePlugin(cooldown=0.0, stale_after=30.0)
    tail = [(i, 100, 40) for i in range(6)]
    plugin.handle_load("b", report([]), 0)
    [order] = plugin.handle_load("a", report(tail), 0)["orders"]
    kept = [c for c in tail if c[0] not in set(order["seq_ids"])]
    plugin.handle_load("a", {**report(kept), "counters": {"migrated_out": 3}}, 0)  # sent, in flight
    assert plugin.views["b"].arriving == {M: 0}
