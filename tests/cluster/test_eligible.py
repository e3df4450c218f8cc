"""Where engines may run, without a cluster: the rule (resource, worker list, dask config), the
scheduler plugin's destinations, and a host that may hold no engine handing its rows on."""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import dask.config
import pytest

from batchgen.cluster.eligibility import EngineWorkers
from batchgen.cluster.host import Host
from batchgen.cluster.plugin import BalancePlugin
from batchgen.cluster.spec import EngineSpec
from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams

SPEC = EngineSpec.make("/models/tiny")


def test_rule_from_arguments_and_dask_config() -> None:
    assert not EngineWorkers.make().is_restricted  # unset: every worker, as without the rule
    assert EngineWorkers.make().admits("tcp://a:1")
    with dask.config.set({"batchgen.worker-resource": "GPU", "batchgen.engine-workers": "w1, tcp://b:2"}):
        rule = EngineWorkers.make()
    assert rule.resource == "GPU" and rule.workers == frozenset({"w1", "tcp://b:2"})
    assert rule.admits("tcp://x:1", resources={"GPU": 1})
    assert not rule.admits("tcp://x:1", resources={"GPU": 0, "CPU": 4})
    assert rule.admits("tcp://x:1", name="w1") and rule.admits("tcp://b:2")
    assert EngineWorkers.from_msg(rule.to_msg()) == rule
    assert EngineWorkers.make("TPU").resource == "TPU"
    with pytest.raises(ValueError):
        EngineWorkers(workers=frozenset())


@dataclass
class FakeWorkerState:
    name: str
    resources: dict[str, float]
    processing: set[Any] = field(default_factory=set)
    long_running: set[Any] = field(default_factory=set)


class FakeScheduler:
    def __init__(self, workers: dict[str, FakeWorkerState]) -> None:
        self.workers = workers
        self.queued: list[Any] = []
        self.unrunnable: dict[Any, Any] = {}


def _report(rows: int) -> dict[str, Any]:
    if not rows:
        return {"engines": {}, "counters": {}, "jobs": 0}
    engine = {"ready": True, "waiting": rows, "running": 0, "remaining_tokens": 200 * rows, "kv_used": 0.1,
              "tokens_per_s": 50.0, "movable": [[i, 200, 0] for i in range(rows)], "kv_capacity_tokens": 0,
              "max_num_seqs": 0, "adopted": 0, "device": ""}
    return {"engines": {SPEC.key: engine}, "counters": {}, "jobs": 1}


def _destinations(rule: EngineWorkers | None) -> set[str]:
    plugin = BalancePlugin(engine_workers=rule, cooldown=0.0)
    plugin.scheduler = FakeScheduler({"a": FakeWorkerState("gpu-a", {"GPU": 1}),
                                      "b": FakeWorkerState("gpu-b", {"GPU": 1}),
                                      "c": FakeWorkerState("cpu-c", {})})
    assert plugin.handle_load("b", _report(0), -1)["orders"] == []
    reply = plugin.handle_load("c", _report(0), -1)
    expected = ["a", "b"] if rule is not None else ["a", "b", "c"]
    assert sorted(reply["engine_workers"]) == expected
    orders = plugin.handle_load("a", _report(64), -1)["orders"]
    return {o["dst"] for o in orders}


def test_balancer_sends_rows_only_to_workers_that_may_hold_engines() -> None:
    assert _destinations(None) == {"b", "c"}  # without a rule the CPU worker is a destination too
    assert _destinations(EngineWorkers("GPU")) == {"b"}


class FakeTransport:
    address = "tcp://cpu:1"

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, dict[str, Any], Any]] = []

    def send(self, address: str, op: str, msg: dict[str, Any], on_error: Any = None) -> None:
        self.sent.append((address, op, msg, on_error))


def _out(row: int) -> bytes:
    return pickle.dumps(RequestOutput(row, [1], [2, 3], f"text {row}", "length"))


def _host(holders: list[str]) -> tuple[Host, FakeTransport]:
    transport = FakeTransport()
    host = Host(transport)
    host.hold_no_engines(EngineWorkers("GPU"), lambda: list(holders))
    return host, transport


def test_a_host_without_engines_hands_rows_on_and_gets_results_back() -> None:
    holders = ["tcp://g1:1", "tcp://g2:1"]
    host, transport = _host(holders)
    host.prestart(SPEC)
    params = SamplingParams(max_tokens=2)
    job = host.open_job(SPEC, [("p0", params), ("p1", params), ("p2", params)])
    dst, op, msg, on_error = transport.sent[-1]
    assert (dst, op, msg["owner"], msg["job_id"]) == ("tcp://g1:1", "batchgen_submit", transport.address, job.job_id)
    assert [pickle.loads(blob)[0] for _, blob in msg["rows"]] == ["p0", "p1", "p2"]
    on_error(ConnectionError("g1 gone"))  # the send failed: the rows go to the other worker
    assert transport.sent[-1][:2] == ("tcp://g2:1", "batchgen_submit") and job.holders() == {0: "tcp://g2:1",
                                                                                             1: "tcp://g2:1",
                                                                                             2: "tcp://g2:1"}
    host.receive_bounce({job.job_id: [[1, b"suspended-state"]]})  # g2 gives one row back, with its state
    dst, op, msg, _ = transport.sent[-1]
    assert op == "batchgen_adopt" and msg["items"] == [[job.job_id, 1, b"suspended-state"]]
    holders.remove("tcp://g2:1")
    host.recover({"tcp://g1:1", transport.address})  # g2 left: its rows are sent on, never run here
    assert {h for h in job.holders().values()} == {"tcp://g1:1"}
    host.receive_results({job.job_id: [[r, _out(r)] for r in range(3)]})
    assert job.wait(5) and [o.text for o in job.result()] == ["text 0", "text 1", "text 2"]
    host.close_job(job)
    assert host.engines.specs() == []  # no engine was ever started here
    assert host.counters.delegated == 3 and host.counters.migrated_in == 0


def test_a_host_without_engines_bounces_coroutines_sent_to_it() -> None:
    host, transport = _host(["tcp://g1:1"])
    host.adopt("tcp://g1:1", SPEC, [("j", 0, b"state")])
    host.receive_submit("tcp://g1:1", SPEC, "j2", [(0, "p", SamplingParams())])
    assert [(op, msg["jobs"]) for _, op, msg, _ in transport.sent] == [
        ("batchgen_bounce", {"j": [[0, b"state"]]}), ("batchgen_bounce", {"j2": [[0, None]]})]
    assert host.engines.specs() == [] and host.counters.migrated_in == 0


def test_no_worker_may_hold_engines_fails_the_job_naming_the_resource() -> None:
    host, _ = _host([])
    t0 = time.monotonic()
    job = host.open_job(SPEC, [("p", SamplingParams())])
    assert job.wait(1) and time.monotonic() - t0 < 1
    with pytest.raises(Exception, match="'GPU'"):
        job.result()
