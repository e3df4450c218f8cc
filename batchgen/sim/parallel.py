"""The simulated fleet spread over processes: the same simulation on several cores.

Between two ticks the engines of a simulated fleet do not interact: each runs the runtime's
scheduler on its own clock. Only the balancer, once a tick, reads every engine's load and moves
coroutines. So the engines can live in child processes (each holding a contiguous share of the
workers) while the parent runs the balancer: per tick, one round trip to each child runs its
engines to the tick and brings back their loads; the tick's orders then go out as one batch of
suspends (to the sources' children) and one of arrivals (to the destinations'). Within a tick
an engine is the source or destination of one pusher's orders at most (both go into cooldown),
so batching them changes no decision: every engine sees the calls the serial run makes, in the
same order, and the result is identical (tests/test_sim_parallel.py compares them). Only the
wall time changes. Static runs its shares to the end, with no ticks.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import math
import multiprocessing as mp
import traceback
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..errors import PlanError
from ..policy.balance import CoroutineInfo, EngineLoad, Migration
from .cost import CostModel
from .engine import Arrival, EngineSimConfig
from .partitions import partitioned_engines
from .workload import Workload


def _serve(conn: Connection, names: list[str], parts: list[np.ndarray], workload: Workload, cost: CostModel,
           config: EngineSimConfig) -> None:
    """A child's loop: its engines, built and filled as simulate() builds them; commands in,
    answers out."""
    try:
        engines = {e.name: e for e in partitioned_engines(names, parts, workload, cost, config)}
        while True:
            cmd, arg = conn.recv()
            if cmd == "run":  # arg: the tick to run to (None: the loads as they are)
                if arg is not None:
                    for e in engines.values():
                        e.run_until(arg)
                conn.send(({n: _packed(e.load()) for n, e in engines.items()},
                           any(e.has_work for e in engines.values())))
            elif cmd == "suspend":  # arg: (now, [(source, seq_ids)]) -> per order [(at, seq, kv_tokens)]
                now, orders = arg
                out = []
                for name, seq_ids in orders:
                    src = engines[name]
                    out.append([(max(now, src.now) + src.transfer_seconds(kv), seq, kv)
                                for seq, kv in src.suspend(seq_ids)])
                conn.send(out)
            elif cmd == "arrive":  # arg: [(destination, at, seq, kv_tokens)]
                for name, at, seq, kv in arg:
                    engines[name].arrive(Arrival(at, seq, kv))
                conn.send(None)
            elif cmd == "finish":  # run to the end (Static: the shares never interact)
                for e in engines.values():
                    e.run_until(math.inf)
                conn.send(None)
            elif cmd == "result":  # arg: keep timelines
                conn.send([(e.name, e.finished, len(e.errors), e.busy_s, tuple(e.timeline) if arg else ())
                           for e in engines.values()])
            elif cmd == "stop":
                return
    except BaseException:  # noqa: BLE001 - the parent raises it with the child's traceback
        conn.send(("error", traceback.format_exc()))


class _Children:
    """The child processes and which engine lives where."""

    def __init__(self, names: list[str], parts: list[np.ndarray], workload: Workload, cost: CostModel,
                 config: EngineSimConfig, processes: int) -> None:
        # fork where there is one: spawn would re-run a calling script that lacks a main guard,
        # and the children touch nothing a parent's thread could hold (no Dask, no torch, no BLAS)
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        shares = np.array_split(np.arange(len(names)), processes)
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self.home: dict[str, int] = {}
        for i, share in enumerate(shares):
            mine = [names[j] for j in share.tolist()]
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, mine, [parts[j] for j in share.tolist()], workload, cost,
                                                    config), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
            self.home.update({name: i for name in mine})

    def ask(self, messages: dict[int, tuple[str, Any]]) -> dict[int, Any]:
        """Send each child its message, then collect the answers (the children work meanwhile)."""
        for i, msg in messages.items():
            self.conns[i].send(msg)
        answers = {}
        for i in messages:
            try:
                answer = self.conns[i].recv()
            except EOFError:
                self.procs[i].join(1)
                raise RuntimeError(f"simulation process {i} exited (exit code {self.procs[i].exitcode}); "
                                   "run with processes=1 to see the error") from None
            if isinstance(answer, tuple) and len(answer) == 2 and answer[0] == "error":
                raise RuntimeError(f"simulation process {i} failed:\n{answer[1]}")
            answers[i] = answer
        return answers

    def all(self, cmd: str, arg: Any = None) -> list[Any]:
        return list(self.ask({i: (cmd, arg) for i in range(len(self.conns))}).values())

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()


def run_parallel(workload: Workload, cost: CostModel, engine: EngineSimConfig, names: list[str],
                 parts: list[np.ndarray], processes: int, balancer: Any | None, tick_s: float,
                 keep_timelines: bool) -> tuple[list[tuple[str, list[tuple[int, float]], int, float, tuple]], int]:
    """Run the fleet in `processes` children; balancer: cluster._Balancer (None: Static).
    -> (per engine in `names` order: (name, finished, errors, busy_s, timeline), coroutines moved)."""
    if processes < 2:
        raise PlanError(f"run_parallel needs at least 2 processes, got {processes}")
    kids = _Children(names, parts, workload, cost, engine, min(processes, len(names)))
    moved = 0
    try:
        if balancer is None:
            kids.all("finish")
        else:
            now = 0.0
            loads, work = _gather(kids.all("run", None))
            while True:
                orders: list[Migration] = []
                balancer.tick(now, loads, lambda order, _now: orders.append(order))  # noqa: B023 - called inside tick()
                if orders:
                    moved += _carry_out(kids, orders, now)
                if not work:  # moves keep the fleet's work (in flight counts at the destination)
                    break
                now += tick_s
                loads, work = _gather(kids.all("run", now))
        per_engine = {r[0]: r for answer in kids.all("result", keep_timelines) for r in answer}
    finally:
        kids.close()
    return [per_engine[name] for name in names], moved


class ReportedCoroutines(collections.abc.Sequence):
    """A load report's movable coroutines as they cross a pipe: an int array [k, 3] of (seq_id,
    remaining, num_computed), made CoroutineInfo only if the balancer reads them (it reads only
    its sources', a few engines a tick). Pickling 256 CoroutineInfo objects per engine per tick
    had cost the parent more CPU than the children's simulation saved."""

    __slots__ = ("_rows", "_items")

    def __init__(self, rows: np.ndarray) -> None:
        self._rows = rows
        self._items: tuple[CoroutineInfo, ...] | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: Any) -> Any:
        return self._infos()[index]

    def __iter__(self) -> Iterator[CoroutineInfo]:
        return iter(self._infos())

    def _infos(self) -> tuple[CoroutineInfo, ...]:
        if self._items is None:
            self._items = tuple(CoroutineInfo(*row) for row in self._rows.tolist())
        return self._items


def _packed(load: EngineLoad) -> tuple[EngineLoad, np.ndarray]:
    rows = np.array([(c.seq_id, c.remaining, c.num_computed) for c in load.movable], dtype=np.int64).reshape(-1, 3)
    return dataclasses.replace(load, movable=()), rows


def _gather(answers: Seq[tuple[dict[str, tuple[EngineLoad, np.ndarray]], bool]]) -> tuple[dict[str, EngineLoad], bool]:
    loads: dict[str, EngineLoad] = {}
    for part, _ in answers:
        for name, (load, rows) in part.items():
            loads[name] = dataclasses.replace(load, movable=ReportedCoroutines(rows))  # type: ignore[arg-type]
    return loads, any(work for _, work in answers)


def _carry_out(kids: _Children, orders: list[Migration], now: float) -> int:
    """The tick's orders: suspends at the sources' children, then arrivals at the destinations'."""
    by_child: dict[int, list[int]] = {}
    for k, order in enumerate(orders):
        by_child.setdefault(kids.home[order.src], []).append(k)
    answers = kids.ask({i: ("suspend", (now, [(orders[k].src, orders[k].seq_ids) for k in ks]))
                        for i, ks in by_child.items()})
    arrivals: dict[int, list[tuple[str, float, Any, int]]] = {}
    moved = 0
    for i, ks in by_child.items():
        for k, suspended in zip(ks, answers[i]):
            dst = orders[k].dst
            for at, seq, kv in suspended:
                arrivals.setdefault(kids.home[dst], []).append((dst, at, seq, kv))
                moved += 1
    if arrivals:
        kids.ask({i: ("arrive", items) for i, items in arrivals.items()})
    return moved

