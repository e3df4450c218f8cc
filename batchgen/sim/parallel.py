"""Simulated fleets spread over processes: every policy at once, the same result, several cores.

Between two ticks the engines of a simulated fleet do not interact: each runs the runtime's
scheduler on its own clock. Only the policies act at a tick: batchgen's balancer reads every
engine's load and moves coroutines, dynamic's deal hands batches to drained workers. So the
engines live in child processes (shard.py: each holds a contiguous share of the workers, under
every policy simulated) while the parent runs the policies. Per tick, one round trip to each
child delivers the last tick's decisions (rows dealt, arriving coroutines), runs its engines
to the tick and brings back their loads; a tick with balancing orders adds one round trip of
suspends. A load report's movable coroutines stay in the child until the balancer reads them
(its sources', a few a tick). Within a tick an engine is the source or destination of one
pusher's orders at most (both go into cooldown), so batching them changes no decision: every
engine sees the calls the serial run makes, in the same order, and the result is identical
(tests/sim/test_sim_parallel.py compares them). Static's engines run while a child waits for
the parent. Only the wall time changes.
"""
from __future__ import annotations

import collections.abc
import math
import multiprocessing as mp
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..errors import PlanError
from ..policy.balance import CoroutineInfo, EngineLoad, Migration
from .cost import CostModel
from .engine import Arrival
from .engine_config import EngineSimConfig
from .policies import deal
from .reports import ReportedMovable
from .shard import EngineResult, Shard
from .workload import Workload


class _Failed(str):
    """A child's traceback, sent instead of its answer."""


def _serve(conn: Connection, make: Callable[[], Shard]) -> None:
    """A child's loop: its shard, built as the serial run builds its engines; commands in,
    answers out; static's engines advance whenever no command waits."""
    try:
        shard = make()
        background = True
        while True:
            while background and not conn.poll():
                background = shard.background()
            cmd, arg = conn.recv()
            if cmd == "stop":
                return
            if cmd == "finish":
                shard.finish()
                answer = None
            else:
                answer = getattr(shard, cmd)(*arg)
            conn.send(answer)
    except BaseException:  # noqa: BLE001 - the parent raises it with the child's traceback
        conn.send(_Failed(traceback.format_exc()))


class _Children:
    """The child processes and which engine lives where."""

    def __init__(self, names: list[str], parts: list[np.ndarray], workload: Workload, cost: CostModel,
                 config: EngineSimConfig, kinds: tuple[str, ...], processes: int, background_s: float) -> None:
        # fork where there is one: spawn would re-run a calling script that lacks a main guard,
        # and the children touch nothing a parent's thread could hold (no Dask, no torch, no BLAS)
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self.shares = [share.tolist() for share in np.array_split(np.arange(len(names)), processes)]
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self.home: dict[str, int] = {}
        for i, share in enumerate(self.shares):
            mine = [names[j] for j in share]
            make = _ShardMaker(mine, [parts[j] for j in share], workload, cost, config, kinds, background_s)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, make), daemon=True)
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
            if isinstance(answer, _Failed):
                raise RuntimeError(f"simulation process {i} failed:\n{answer}")
            answers[i] = answer
        return answers

    def all(self, cmd: str, *arg: Any) -> list[Any]:
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


class _ShardMaker:
    """Builds a child's shard in the child (picklable for spawn; fork passes it as it is)."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __call__(self) -> Shard:
        return Shard(*self.args)


class _RemoteMovable(collections.abc.Sequence):
    """A load report's movable coroutines, fetched from the engine's child on first read."""

    __slots__ = ("_fetch", "_count", "_items")

    def __init__(self, fetch: Callable[[], tuple[np.ndarray, np.ndarray]], count: int) -> None:
        self._fetch, self._count = fetch, count
        self._items: tuple[CoroutineInfo, ...] | None = None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Any) -> Any:
        return self._infos()[index]

    def __iter__(self) -> Iterator[CoroutineInfo]:
        return iter(self._infos())

    def _infos(self) -> tuple[CoroutineInfo, ...]:
        if self._items is None:
            self._items = tuple(ReportedMovable(*self._fetch()))
        return self._items


def run_parallel(workload: Workload, cost: CostModel, config: EngineSimConfig, names: list[str],
                 parts: list[np.ndarray], kinds: tuple[str, ...], processes: int, tick_s: float,
                 balancer: Any | None, dynamic_batch_rows: int, keep_timelines: bool
                 ) -> tuple[dict[str, list[EngineResult]], int]:
    """Run the fleets of `kinds` at once in `processes` children; balancer: cluster._Balancer
    (batchgen's). -> (per kind, per engine in `names` order: EngineResult; coroutines moved)."""
    if processes < 2:
        raise PlanError(f"run_parallel needs at least 2 processes, got {processes}")
    kids = _Children(names, parts, workload, cost, config, kinds, min(processes, len(names)), 2 * tick_s)
    moved = 0
    batches: deque[np.ndarray] = deque(np.array_split(np.arange(workload.rows),
                                                      math.ceil(workload.rows / dynamic_batch_rows)))
    live = {kind for kind in kinds if kind != "static"}
    try:
        templates = [load for answer in kids.all("template") for load in answer] if "batchgen" in live else []
        adds: dict[int, list] = {}
        arrivals: dict[int, list] = {}
        now, t = 0.0, None
        while live:
            answers = kids.ask({i: ("run", (t, adds.get(i, []), arrivals.get(i, []), tuple(live), not batches))
                                for i in range(len(kids.conns))})
            adds, arrivals = {}, {}
            work = {kind: any(a["work"][kind] for a in answers.values()) for kind in live}
            if "dynamic" in live:
                occupancy = np.concatenate([answers[i]["occupancy"] for i in range(len(kids.conns))]).tolist()
                given = deal([tuple(o) for o in occupancy], batches, config.max_num_seqs)
                for name, mine in zip(names, given):
                    adds.setdefault(kids.home[name], []).extend((name, rows) for rows in mine)
                if not batches and not work["dynamic"] and not any(given):
                    live.discard("dynamic")
            if "batchgen" in live:
                loads = _loads(kids, templates, answers)
                orders: list[Migration] = []
                balancer.tick(now, loads, lambda order, _now: orders.append(order))  # noqa: B023 - called inside tick()
                if orders:
                    moved += _suspend(kids, orders, now, arrivals)
                if not work["batchgen"]:  # moves keep the fleet's work (in flight counts at the destination)
                    live.discard("batchgen")
            now += tick_s
            t = now
        kids.all("finish")
        per_kind: dict[str, list[EngineResult]] = {kind: [] for kind in kinds}
        for answer in kids.all("results", keep_timelines):
            for kind, rows in answer.items():
                per_kind[kind].extend(rows)
    finally:
        kids.close()
    return per_kind, moved


def _loads(kids: _Children, templates: list[EngineLoad], answers: dict[int, Any]) -> dict[str, EngineLoad]:
    """EngineLoads from the children's numbers; each one's movable list fetched on first read."""
    numbers = np.concatenate([answers[i]["loads"] for i in range(len(kids.conns))]).tolist()
    out = {}
    for load, row in zip(templates, numbers):
        waiting, running, remaining, kv_used, tokens_per_s, speed, count = row  # shard.LOAD_FIELDS, then the count
        fetch = _fetcher(kids, load.worker)
        out[load.worker] = EngineLoad(load.worker, load.model, load.ready, int(waiting), int(running), int(remaining),
                                      kv_used, tokens_per_s, _RemoteMovable(fetch, int(count)),  # type: ignore[arg-type]
                                      speed, load.kv_capacity_tokens, load.max_num_seqs, load.device)
    return out


def _fetcher(kids: _Children, name: str) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    return lambda: kids.ask({kids.home[name]: ("movable", (name,))})[kids.home[name]]


def _suspend(kids: _Children, orders: list[Migration], now: float, arrivals: dict[int, list]) -> int:
    """The tick's orders: suspends at the sources' children now; the arrivals go to the
    destinations' children with the next tick's run (before it, as the serial run has them)."""
    by_child: dict[int, list[int]] = {}
    for k, order in enumerate(orders):
        by_child.setdefault(kids.home[order.src], []).append(k)
    answers = kids.ask({i: ("suspend", (now, [(orders[k].src, orders[k].seq_ids) for k in ks]))
                        for i, ks in by_child.items()})
    moved = 0
    for i, ks in by_child.items():
        for k, suspended in zip(ks, answers[i]):
            dst = orders[k].dst
            for at, seq, kv in suspended:
                arrivals.setdefault(kids.home[dst], []).append((dst, Arrival(at, seq, kv)))
                moved += 1
    return moved
