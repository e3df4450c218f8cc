"""The migration protocol between two Hosts in one process (no Dask): an in-process bus stands in
for the RPC handlers. Moved rows come back to their owner exactly once, whether the holder
returns them, vanishes, hands them back on close, passes them on, or cannot be reached; a closed
job's rows stop wherever they run."""
from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen import Engine, SamplingParams
from batchgen.cluster.host import Host
from batchgen.cluster.job import PartitionJob
from batchgen.cluster.runner import EngineRunner, RowRef
from batchgen.cluster.spec import EngineSpec
from batchgen.policy.balance import Migration

OPTIONS = {"kv_cache_bytes": 16 << 20}
PARAMS = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
PROMPTS = ["The quick brown fox", "def f(x):", "Hello, world!", "import os"]


class Bus:
    """Delivers Host sends to the addressed Host on a fresh thread, like an RPC would."""

    def __init__(self) -> None:
        self.hosts: dict[str, Host] = {}
        self.down: set[str] = set()

    def deliver(self, src: str, dst: str, op: str, msg: dict[str, Any],
                on_error: Callable[[BaseException], None] | None) -> None:
        if src in self.down:
            return  # a dead worker sends nothing
        if dst in self.down or dst not in self.hosts:
            if on_error is not None:
                on_error(ConnectionError(f"{dst} is gone"))
            return
        host = self.hosts[dst]
        calls = {
            "batchgen_adopt": lambda: host.adopt(msg["owner"], EngineSpec.from_msg(msg["spec"]),
                                                 [tuple(item) for item in msg["items"]]),
            "batchgen_result": lambda: host.receive_results(msg["jobs"]),
            "batchgen_bounce": lambda: host.receive_bounce(msg["jobs"]),
            "batchgen_progress": lambda: host.receive_progress(msg["holder"], msg["jobs"]),
            "batchgen_forward": lambda: host.receive_forward(msg["holder"], msg["dst"], EngineSpec.from_msg(msg["spec"]),
                                                             msg["jobs"]),
            "batchgen_cancel": lambda: host.receive_cancel(msg["owner"], msg["job_id"], msg["rows"]),
        }
        threading.Thread(target=calls[op]).start()


class BusTransport:
    def __init__(self, bus: Bus, address: str) -> None:
        self.bus, self.address = bus, address

    def send(self, address: str, op: str, msg: dict[str, Any],
             on_error: Callable[[BaseException], None] | None = None) -> None:
        self.bus.deliver(self.address, address, op, msg, on_error)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # three engines on two shared cores: OpenMP threads would only fight
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def spec(checkpoint_factory: Callable[..., Path]) -> EngineSpec:
    return EngineSpec.make(checkpoint_factory("mixtral"), OPTIONS)


@pytest.fixture(scope="module")
def expected(spec: EngineSpec) -> list[list[int]]:
    return [o.token_ids for o in Engine(spec.model, **OPTIONS).generate(PROMPTS, PARAMS)]


@pytest.fixture
def pair() -> Iterator[tuple[Bus, Host, Host]]:
    bus = Bus()
    a, b = Host(BusTransport(bus, "A")), Host(BusTransport(bus, "B"))
    bus.hosts.update(A=a, B=b)
    yield bus, a, b
    for host in (a, b):
        host.close()


@pytest.fixture
def trio(pair: tuple[Bus, Host, Host]) -> Iterator[tuple[Bus, Host, Host, Host]]:
    bus, a, b = pair
    c = Host(BusTransport(bus, "C"))
    bus.hosts["C"] = c
    yield bus, a, b, c
    c.close()


def start(host: Host, spec: EngineSpec) -> PartitionJob:
    job = host.open_job(spec, [(p, PARAMS) for p in PROMPTS])
    deadline = time.monotonic() + 60
    while sum(c.is_started for c in host.runner(spec).load.movable) < len(PROMPTS):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return job


def move_two(host: Host, spec: EngineSpec, dst: str) -> Migration:
    seq_ids = tuple(c.seq_id for c in host.runner(spec).load.movable[:2])
    order = Migration("A", dst, spec.key, seq_ids, 0, "migrate")
    host.execute(order)
    return order


def wait_until(cond: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def finish(host: Host, job: PartitionJob) -> list[list[int]]:
    assert job.wait(120)
    host.close_job(job)
    return [o.token_ids for o in job.result()]


def test_moved_rows_come_back_from_the_holder(pair: tuple[Bus, Host, Host], spec: EngineSpec,
                                              expected: list[list[int]]) -> None:
    _, a, b = pair
    job = start(a, spec)
    # the report carries the pool and seats the balancer counts its orders into
    report = next(iter(a.report()["engines"].values()))
    engine = a.runner(spec).call(lambda e: e).result(timeout=30)
    assert report["kv_capacity_tokens"] == engine.allocator.capacity_tokens > 0
    assert report["max_num_seqs"] == engine.config.max_num_seqs > 0
    assert report["device"] == engine.device_class and "float32" in report["device"]  # equal classes, equal speed
    move_two(a, spec, "B")
    assert finish(a, job) == expected
    assert (a.counters.migrated_out, b.counters.migrated_in, b.counters.returned) == (2, 2, 2)
    assert a.counters.rows_done == len(PROMPTS) and a.counters.recovered == 0


def test_rows_of_a_vanished_holder_resume_at_the_owner(pair: tuple[Bus, Host, Host], spec: EngineSpec,
                                                       expected: list[list[int]]) -> None:
    bus, a, b = pair
    job = start(a, spec)
    move_two(a, spec, "B")
    wait_until(lambda: b.counters.migrated_in == 2)
    bus.down.add("B")  # B dies: it never answers
    assert a.recover(live={"A"}) == 2
    assert finish(a, job) == expected
    assert a.counters.recovered == 2 and a.counters.rows_done == len(PROMPTS)


def test_a_false_alarm_does_not_duplicate_rows(pair: tuple[Bus, Host, Host], spec: EngineSpec,
                                               expected: list[list[int]]) -> None:
    _, a, b = pair
    job = start(a, spec)
    move_two(a, spec, "B")
    wait_until(lambda: b.counters.migrated_in == 2)
    a.recover(live={"A"})  # A thinks B left, B goes on and answers too
    assert finish(a, job) == expected
    assert a.counters.rows_done == len(PROMPTS)


def test_a_closing_holder_hands_rows_back_with_their_progress(pair: tuple[Bus, Host, Host], spec: EngineSpec,
                                                              expected: list[list[int]]) -> None:
    _, a, b = pair
    job = start(a, spec)
    move_two(a, spec, "B")
    wait_until(lambda: b.counters.migrated_in == 2)
    b.close()
    assert finish(a, job) == expected
    assert b.counters.returned == 0 and a.counters.rows_done == len(PROMPTS)


def test_an_unreachable_destination_keeps_the_rows_home(pair: tuple[Bus, Host, Host], spec: EngineSpec,
                                                        expected: list[list[int]]) -> None:
    bus, a, _ = pair
    bus.down.add("B")
    job = start(a, spec)
    move_two(a, spec, "B")
    assert finish(a, job) == expected
    assert a.counters.migrated_out == 2 and a.counters.recovered == 2


def test_a_vanished_holder_s_rows_resume_from_their_last_progress(pair: tuple[Bus, Host, Host], spec: EngineSpec,
                                                                  expected: list[list[int]]) -> None:
    bus, a, b = pair
    job = start(a, spec)
    move_two(a, spec, "B")
    wait_until(lambda: b.counters.migrated_in == 2)
    at_migration = job.kept()
    assert len(at_migration) == 2
    resumed: list[int] = []  # output tokens of the states A resumes
    runner = a.runner(spec)
    adopt = runner.adopt
    runner.adopt = lambda items: (resumed.extend(len(pickle.loads(s)["seq"]["output_ids"]) for _, s in items),  # type: ignore[method-assign]
                                  adopt(items))[1]
    gate = threading.Event()
    try:
        def advanced() -> bool:
            b.push_progress(every=0)
            kept = job.kept()
            return all(kept[row] > at_migration[row] for row in at_migration)
        wait_until(advanced)  # A's kept states follow B's progress
        b.runner(spec).call(lambda engine: gate.wait(60))  # B stalls at its next yield point...
        bus.down.add("B")  # ...and dies: it never answers again
        time.sleep(0.2)  # progress already on its way lands
        kept = job.kept()
        assert len(kept) == 2 and all(kept[row] > at_migration[row] for row in at_migration)
        assert a.counters.refreshed >= 2 and b.counters.progress_sent >= 2
        assert a.recover(live={"A"}) == 2
        assert sorted(resumed) == sorted(kept.values())  # from the newest states, not the migrated ones
        assert finish(a, job) == expected
        assert a.counters.recovered == 2 and a.counters.rows_done == len(PROMPTS)
    finally:
        gate.set()


def held(host: Host, spec: EngineSpec) -> tuple[int, ...]:
    """Seq ids of the coroutines `host` holds for other workers."""
    refs = host.runner(spec).call(lambda engine: dict(host.runner(spec)._tickets)).result(10)
    return tuple(seq_id for seq_id, ref in refs.items() if not ref.is_local)


def test_held_rows_move_on_through_their_owner(trio: tuple[Bus, Host, Host, Host], spec: EngineSpec,
                                               expected: list[list[int]]) -> None:
    _, a, b, c = trio
    job = start(a, spec)
    move_two(a, spec, "B")
    wait_until(lambda: len(held(b, spec)) == 2)
    b.execute(Migration("B", "C", spec.key, held(b, spec), 0, "migrate"))
    wait_until(lambda: c.counters.migrated_in == 2)
    assert set(job.holders().values()) <= {"C"}  # the owner learnt the new holder first
    assert held(b, spec) == ()
    assert finish(a, job) == expected
    assert (b.counters.forwarded, b.counters.returned, c.counters.returned) == (2, 0, 2)
    assert a.counters.rows_done == len(PROMPTS) and a.counters.recovered == 0


def test_held_rows_moved_to_their_owner_resume_there(pair: tuple[Bus, Host, Host], spec: EngineSpec,
                                                     expected: list[list[int]]) -> None:
    _, a, b = pair
    job = start(a, spec)
    move_two(a, spec, "B")
    wait_until(lambda: len(held(b, spec)) == 2)
    b.execute(Migration("B", "A", spec.key, held(b, spec), 0, "migrate"))
    assert finish(a, job) == expected
    assert (b.counters.forwarded, b.counters.returned) == (2, 0)
    assert a.counters.rows_done == len(PROMPTS)


def test_a_forward_the_owner_cannot_get_keeps_the_rows_at_the_holder(pair: tuple[Bus, Host, Host], spec: EngineSpec,
                                                                      expected: list[list[int]]) -> None:
    bus, a, b = pair
    job = start(a, spec)
    move_two(a, spec, "B")
    wait_until(lambda: len(held(b, spec)) == 2)
    deliver = bus.deliver

    def drop_forwards(src: str, dst: str, op: str, msg: dict[str, Any], on_error: Any) -> None:
        if op == "batchgen_forward":
            on_error(ConnectionError("lost"))
        else:
            deliver(src, dst, op, msg, on_error)
    bus.deliver = drop_forwards  # type: ignore[method-assign]
    b.execute(Migration("B", "A", spec.key, held(b, spec), 0, "migrate"))
    assert finish(a, job) == expected
    assert (b.counters.forwarded, b.counters.returned) == (2, 2)


def test_a_closed_job_stops_its_rows_held_elsewhere(pair: tuple[Bus, Host, Host], spec: EngineSpec) -> None:
    _, a, b = pair
    job = start(a, spec)
    order = move_two(a, spec, "B")
    wait_until(lambda: len(held(b, spec)) == 2)
    job.fail(RuntimeError("the task was cancelled"))
    a.close_job(job)
    wait_until(lambda: b.counters.cancelled == 2)
    assert held(b, spec) == ()
    # coroutines of that job still in flight to B are refused
    b.adopt("A", spec, [(job.job_id, row, b"never resumed") for row in range(len(order.seq_ids))])
    assert held(b, spec) == () and b.counters.returned == 0


@pytest.mark.parametrize("max_num_seqs, measured", [(2, True), (64, False)])
def test_speed_is_measured_only_while_rows_queue(spec: EngineSpec, max_num_seqs: int, measured: bool) -> None:
    """A rate taken while the batch is short of rows says how much work there was, not how fast
    the engine is: speed counts only seconds in which rows waited for a place in the batch."""
    runner = EngineRunner(EngineSpec.make(spec.model, {**OPTIONS, "max_num_seqs": max_num_seqs}),
                          lambda done: None, lambda exc, refs: None)
    try:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        # 16 rows: at 2 seats, rows queue for several whole rate windows even on a fast machine
        runner.submit([(RowRef("job", i), p, params) for i, p in enumerate(PROMPTS * 4)]).result(60)
        wait_until(lambda: runner.load.speed > 0 or runner.load.generated_tokens == 16 * 400, timeout=120)
        assert (runner.load.speed > 0) == measured
    finally:
        runner.close()


def test_rows_queued_behind_an_engine_stop_run_on_a_fresh_engine(spec: EngineSpec, expected: list[list[int]]) -> None:
    """release_idle stops an idle engine on its loop thread; a task's rows that were queued right
    behind that stop are refused when the loop exits and go to a new engine, not into the
    stopped one (where their task would wait forever)."""
    host = Host(None)
    try:
        runner = host.runner(spec)
        wait_until(lambda: runner.load.ready)
        gate = threading.Event()
        runner.call(lambda engine: gate.wait(60))  # the loop thread is busy...
        stop = runner.close_if_idle()  # ...so the stop waits in the inbox, and the rows queue behind it
        job = host.open_job(spec, [(p, PARAMS) for p in PROMPTS])
        gate.set()
        assert stop.result(30) is True and runner.is_closed
        assert job.wait(120), "the rows went into the stopped engine"
        assert [o.token_ids for o in job.result()] == expected
        assert host.runner(spec) is not runner
        host.close_job(job)
    finally:
        host.close()


def test_release_idle_spares_busy_engines_and_stops_idle_ones(spec: EngineSpec) -> None:
    host = Host(None)
    try:
        job = host.open_job(spec, [(p, PARAMS) for p in PROMPTS])
        assert host.release_idle() == 0  # a task waits on it
        assert job.wait(120)
        host.close_job(job)
        assert host.release_idle(model="/another/model") == 0
        assert host.release_idle() == 1 and host.loads() == {}
    finally:
        host.close()
