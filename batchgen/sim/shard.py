"""One process's share of simulated fleets: its engines under each policy, run to each tick.

parallel.py gives each child process a shard: a contiguous share of the workers, for every
policy simulated at once (static, dynamic, batchgen side by side). Between two ticks the engines
do not interact, so a shard runs its engines to the tick and reports what the parent's policies
read: batchgen's engine loads, dynamic's (waiting, running) rows. The parent's decisions come
back as rows to add (dynamic's deal), coroutines to suspend and arrivals (batchgen's orders).
Static's engines never interact: the shard runs them a little at a time while it waits for the
parent, and to the end once the others are done.
"""
from __future__ import annotations

import collections.abc
import math
from typing import Any

import numpy as np

from ..policy.balance import CoroutineInfo, EngineLoad
from .cost import CostModel
from .engine import Arrival, SimEngine
from .engine_config import EngineSimConfig
from .partitions import give_rows, partitioned_engines, rows_as_sequences
from .reports import ReportedMovable
from .workload import Workload

# numeric fields of a load report, as they cross a pipe (float64 holds them exactly): the order of
# SimEngine.report's numbers
LOAD_FIELDS = ("waiting", "running", "remaining_tokens", "kv_used", "tokens_per_s", "speed")
# per engine: (rows finished, time of the last, rows failed, busy seconds, timeline)
EngineResult = tuple[int, float, int, float, tuple[tuple[float, float, int], ...]]


class Shard:
    """Engines named `names` under each policy kind in `kinds` ("static", "dynamic", "batchgen");
    static and batchgen start with the rows of `parts` (static's are added in the background,
    each engine's before it first runs), dynamic's with none."""

    def __init__(self, names: list[str], parts: list[np.ndarray], workload: Workload, cost: CostModel,
                 config: EngineSimConfig, kinds: tuple[str, ...], background_s: float = 0.0) -> None:
        self.workload, self.names = workload, names
        self.fleets: dict[str, list[SimEngine]] = {}
        # static's engines get their rows in the background (`_fill`), while the child waits for
        # the parent: making a fleet's Sequence objects took 0.3 s for 64 engines of 781 rows,
        # which the parent would otherwise wait for before the first tick
        self._unfilled: dict[int, np.ndarray] = {}
        for kind in kinds:
            if kind == "batchgen":
                self.fleets[kind] = partitioned_engines(names, parts, workload, cost, config)
            else:
                self.fleets[kind] = [SimEngine(name, cost, config) for name in names]
                if kind == "static":
                    self._unfilled = dict(enumerate(parts))
        self.by_name = {kind: {e.name: e for e in engines} for kind, engines in self.fleets.items()}
        self.movables: dict[str, collections.abc.Sequence[CoroutineInfo]] = {}  # of the last reports
        self.background_s = background_s  # simulated seconds a static engine advances per step of background
        self._next_static = 0

    def run(self, t: float | None, adds: list[tuple[str, np.ndarray]], arrivals: list[tuple[str, Arrival]],
            live: tuple[str, ...], dealt: bool = False) -> dict[str, Any]:
        """Deliver the last tick's decisions, run the tick-driven fleets to t (None: stay), and
        report: batchgen's loads [e, len(LOAD_FIELDS) + 1] (the last column: how many movable
        coroutines each lists), dynamic's occupancy [e, 2], and which fleets still have work.
        dealt: dynamic's last batch was dealt (its engines are sealed once `adds` are in)."""
        for name, rows in adds:
            e = self.by_name["dynamic"][name]
            for seq in rows_as_sequences(self.workload, rows):
                e.add(seq, e.tick)
        if dealt:
            for e in self.fleets.get("dynamic", []):
                e.sealed = True
        for name, arrival in arrivals:
            self.by_name["batchgen"][name].arrive(arrival)
        out: dict[str, Any] = {"work": {}}
        for kind in ("dynamic", "batchgen"):
            engines = self.fleets.get(kind)
            if engines is None or kind not in live:
                continue
            if t is not None:
                for e in engines:
                    e.run_until(t)
            out["work"][kind] = any(e.has_work for e in engines)
            if kind == "dynamic":
                out["occupancy"] = np.array([e.occupancy() for e in engines], dtype=np.int64).reshape(-1, 2)
            else:
                reports = [e.report() for e in engines]
                self.movables = {e.name: movable for e, (_, movable) in zip(engines, reports)}
                out["loads"] = np.array([numbers + (len(movable),) for numbers, movable in reports], dtype=np.float64)
        return out

    def template(self) -> list[EngineLoad]:
        """The batchgen engines' loads with their fixed fields (names, pools, device class)."""
        return [e.load() for e in self.fleets["batchgen"]]

    def movable(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The movable coroutines of `name`'s last report, packed (ReportedMovable.packed)."""
        movable = self.movables[name]
        if isinstance(movable, ReportedMovable):
            return movable.packed()
        rows = np.array([(c.seq_id, c.remaining, c.num_computed) for c in movable], dtype=np.int64).reshape(-1, 3)
        return rows, np.empty((0, 3), dtype=np.int64)

    def suspend(self, now: float, orders: list[tuple[str, tuple[int, ...]]]) -> list[list[tuple[float, Any, int]]]:
        """Per order (source, seq_ids): [(arrival time, seq, KV tokens it carries)]."""
        out = []
        for name, seq_ids in orders:
            src = self.by_name["batchgen"][name]
            out.append([(max(now, src.now) + src.transfer_seconds(kv), seq, kv) for seq, kv in src.suspend(seq_ids)])
        return out

    def background(self) -> bool:
        """Advance a static engine a little (work while the parent decides), one engine at a
        time (its rows stay in the CPU's caches); False: all done."""
        engines = self.fleets.get("static", [])
        while self._next_static < len(engines):
            if self._next_static in self._unfilled:
                self._fill(self._next_static)
                return True
            e = engines[self._next_static]
            if e.has_work:
                e.run_until(max(e.tick, e.now) + self.background_s if self.background_s > 0 else math.inf)
                return True
            self._next_static += 1
        return False

    def _fill(self, i: int) -> None:
        """Static's engine i gets its partition's rows (as partitioned_engines gives them)."""
        e = self.fleets["static"][i]
        give_rows(e, self.workload, self._unfilled.pop(i))
        e.sealed = True  # static's engines never get more rows

    def finish(self) -> None:
        for i, e in enumerate(self.fleets.get("static", [])):
            if i in self._unfilled:
                self._fill(i)
            e.run_until(math.inf)

    def results(self, keep_timelines: bool) -> dict[str, list[EngineResult]]:
        return {kind: [(len(e.finished), max((t for _, t in e.finished), default=0.0), len(e.errors), e.busy_s,
                        tuple(e.timeline) if keep_timelines else ()) for e in engines]
                for kind, engines in self.fleets.items()}
