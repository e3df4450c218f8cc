"""One round of the cluster's elastic schedule: which trajectories are admitted where, which run
in which groups of workers, at what sequence-parallel degree. Torch-free, state in, plan out;
every worker of a job runs it on the same state and so reaches the same plan (elastic_loop.py).

A round advances every running trajectory by one step; its time is the slowest worker's sum of
forwards (the cost model's step time of each forward it takes part in). The plan

  1. admits waiting requests in the job policy's priority order (policy.priority) while a worker
     has room, each onto the worker whose round would be shortest with it;
  2. then moves trajectories between groups (a different worker = migration, more workers = a
     higher degree, fewer = a lower one) while a move cuts the estimated round time (or, at an
     equal round time, the total work) by more than `switch_gain` of it, or, where other workers
     are within that gain of the slowest, takes the slowest out of that band and puts no one in
     (two near-equal stragglers: spreading either alone barely shortens the round). Trajectories
     on the slowest worker are tried in priority order; a trajectory with one step left is not
     spread.
     The search starts from the current groups and, separately, from every trajectory at degree
     1 on its owner (no single move leaves a poor spread); the second wins only by the gain.

The cost model's step times are multiplied by the measured ratios in the state (Measured), so
the plan follows what forwards really take on these workers.

So a large image spreads over workers that would otherwise wait for it, and comes back to one
worker when queued work fills them; where the calibrated all-to-all cost makes degree 2 slower
than degree 1 for a size (2 shared CPU cores), it is never chosen for that size.

Shapes of ids: a tid is the job's request index; ranks are world ranks (groups.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .diffusion_cost import CostModel
from .diffusion_step import TrajView, check_policy, priority


@dataclass(frozen=True, slots=True)
class ElasticOptions:
    """max_running: trajectories one worker owns at once; admit_per_round: the most a worker admits
    per round (so every worker gets a share of the queue); switch_gain: the share of the round's
    estimated time a move must save (hysteresis: no flapping on estimation noise); max_degree:
    cap on the degree (None: the number of workers); adapt: correct the cost model by the
    forward times measured so far (ClusterState.scale / speed), else trust it as calibrated."""

    max_running: int = 8
    admit_per_round: int = 2
    switch_gain: float = 0.05
    max_degree: int | None = None
    adapt: bool = True

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.admit_per_round < 1:
            raise ValueError(f"max_running and admit_per_round must be >= 1, got {self.max_running}, "
                             f"{self.admit_per_round}")
        if not 0 <= self.switch_gain < 1:
            raise ValueError(f"switch_gain must be in [0, 1), got {self.switch_gain}")
        if self.max_degree is not None and self.max_degree < 1:
            raise ValueError(f"max_degree must be >= 1 or None, got {self.max_degree}")


@dataclass(frozen=True, slots=True)
class Placed:
    """A running trajectory and the ranks that hold it (group[0] owns it: decodes, reports it)."""

    view: TrajView
    group: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ClusterState:
    """ranks: the job's workers; waiting: arrived, not yet admitted (tid = request index), any
    order; degrees: the degrees the model allows (they divide its attention heads). scale:
    (key, degree) -> measured / modelled forward time so far, speed: rank -> its measured /
    modelled time (Measured.update keeps both); the plan multiplies the cost model by them, so a
    cost model that is off for one shape, or a worker slowed by its neighbours, is corrected."""

    ranks: tuple[int, ...]
    running: tuple[Placed, ...]
    waiting: tuple[TrajView, ...]
    now: float
    degrees: tuple[int, ...] = (1,)
    scale: dict[tuple, float] = field(default_factory=dict)
    speed: dict[int, float] = field(default_factory=dict)
    scale_default: float = 1.0  # for a (key, degree) not measured yet: all forwards' ratio


@dataclass(slots=True)
class Measured:
    """Running ratios of measured to modelled forward time, per (key, degree) and per rank: an
    exponential average (weight `alpha` on the newest round) of ratio-of-sums, clamped to
    [1/limit, limit]. Every worker feeds it the same gathered samples in the same order, so all
    hold the same ratios."""

    alpha: float = 0.3
    limit: float = 20.0
    scale: dict[tuple, float] = field(default_factory=dict)
    speed: dict[int, float] = field(default_factory=dict)
    overall: float = 1.0

    def update(self, samples: Sequence[tuple[int, tuple, int, float, float]]) -> None:
        """samples: (rank, key, degree, modelled s, measured s) of one round's forwards."""
        by_key: dict[tuple, list[float]] = {}
        for _, key, d, model_s, real_s in samples:
            acc = by_key.setdefault((key, d), [0.0, 0.0])
            acc[0] += model_s
            acc[1] += real_s
        for k, (m, r) in by_key.items():
            if m > 0:
                self.scale[k] = self._mix(self.scale.get(k), r / m)
        total_m = sum(m for m, _ in by_key.values())
        if total_m > 0:
            # what an unmeasured (key, degree) is assumed to take: a machine slowed for every
            # measured shape is slowed for the others too (else they would look cheap)
            self.overall = self._mix(self.overall, sum(r for _, r in by_key.values()) / total_m)
        by_rank: dict[int, list[float]] = {}
        for rank, key, d, model_s, real_s in samples:
            acc = by_rank.setdefault(rank, [0.0, 0.0])
            acc[0] += model_s * self.scale.get((key, d), 1.0)
            acc[1] += real_s
        for rank, (m, r) in by_rank.items():
            if m > 0:
                self.speed[rank] = self._mix(self.speed.get(rank), r / m)

    def _mix(self, old: float | None, new: float) -> float:
        new = min(self.limit, max(1.0 / self.limit, new))
        return new if old is None else (1 - self.alpha) * old + self.alpha * new


@dataclass(frozen=True, slots=True)
class Forward:
    """One forward of the round: these trajectories (same key) over these ranks (a rank's
    degree-1 ones run as packed forwards when the cost model packs: policy.pack_forwards)."""

    ranks: tuple[int, ...]
    tids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """admit: rank -> request indices it admits now; groups: tid -> ranks running it this round
    (every running and admitted trajectory); forwards: degree-1 ones first, then the others in
    one order that all their members follow (no two groups wait on each other); reasons: why a
    trajectory's group changed."""

    admit: dict[int, tuple[int, ...]]
    groups: dict[int, tuple[int, ...]]
    forwards: tuple[Forward, ...]
    est_round_s: float
    reasons: dict[int, str] = field(default_factory=dict)


class _Loads:
    """Per-forward batch tokens (per key) and per-rank load, updated in O(members) per move. A
    rank's degree-1 forwards are one packed forward when the cost model packs (one fixed cost
    for all its keys: CostModel.pack_time), else one forward per key."""

    def __init__(self, ranks: Sequence[int], cost: CostModel, scale: dict[tuple, float] | None = None,
                 speed: dict[int, float] | None = None, scale_default: float = 1.0) -> None:
        self.cost = cost
        self.scale = scale or {}
        self.speed = speed or {}
        self.scale_default = scale_default
        self.batch: dict[tuple, dict[tuple, int]] = {}  # (ranks, key or None: packed) -> key -> rows x tokens
        self.tokens: dict[tuple, int] = {}               # key -> tokens per image
        self.load = {r: 0.0 for r in ranks}

    def _forward_of(self, group: tuple[int, ...], key: tuple) -> tuple:
        return (group, None) if self.cost.packed and len(group) == 1 else (group, key)

    def _fwd(self, f: tuple) -> float:
        keys = self.batch.get(f)
        total = sum(keys.values()) if keys else 0
        if not total:
            return 0.0
        d = len(f[0])
        # the fixed part at the key's measured ratio (packed: the ratio of all forwards)
        fixed_scale = self.scale_default if f[1] is None else self.scale.get((f[1], d), self.scale_default)
        t = self.cost.chunks(total, d) * self.cost.fixed_time(d) * fixed_scale
        for key, bt in keys.items():
            if bt:
                t += self.cost.marginal(bt, self.tokens[key], d) * self.scale.get((key, d), self.scale_default)
        return t

    def add(self, v: TrajView, group: tuple[int, ...], sign: int = 1) -> None:
        f = self._forward_of(group, v.key)
        self.tokens.setdefault(v.key, v.tokens)
        before = self._fwd(f)
        keys = self.batch.setdefault(f, {})
        keys[v.key] = keys.get(v.key, 0) + sign * v.rows * v.tokens
        delta = self._fwd(f) - before
        for r in group:
            self.load[r] += delta * self.speed.get(r, 1.0)

    def objective(self) -> tuple[float, float]:
        return max(self.load.values()), sum(self.load.values())


def plan_round(state: ClusterState, policy: str, cost: CostModel, options: ElasticOptions = ElasticOptions()
               ) -> RoundPlan:
    """-> the round's plan (see the module docstring)."""
    check_policy(policy)
    ranks = tuple(state.ranks)
    top = min(len(ranks), options.max_degree or len(ranks))
    degrees = sorted({d for d in state.degrees if 1 <= d <= top} | {1})
    groups: dict[int, tuple[int, ...]] = {}
    views: dict[int, TrajView] = {}
    for p in state.running:
        groups[p.view.tid] = tuple(r for r in p.group if r in ranks) or (ranks[0],)
        views[p.view.tid] = p.view

    loads = _Loads(ranks, cost, state.scale, state.speed, state.scale_default)
    owned = {r: 0 for r in ranks}
    for tid, group in groups.items():
        loads.add(views[tid], group)
        owned[group[0]] += 1
    admit: dict[int, list[int]] = {r: [] for r in ranks}
    for v in priority(state.waiting, policy, state.now, cost):
        room = [r for r in ranks if owned[r] < options.max_running and len(admit[r]) < options.admit_per_round]
        if not room:
            break

        def with_it(r: int) -> tuple:
            loads.add(v, (r,))  # noqa: B023 - called at once by min() below, in this iteration
            obj = loads.objective()
            loads.add(v, (r,), -1)  # noqa: B023
            return (obj, loads.load[r], owned[r], r)
        r = min(room, key=with_it)
        loads.add(v, (r,))
        admit[r].append(v.tid)
        owned[r] += 1
        groups[v.tid], views[v.tid] = (r,), v

    order = [v.tid for v in priority(list(views.values()), policy, state.now, cost)]
    # local search from where things are, and from everything at degree 1 on its owner (single
    # moves out of a poor spread can all look worse); the second wins only by more than the gain
    kept = _search(dict(groups), views, order, ranks, degrees, loads, options)
    fresh = _search({t: g[:1] for t, g in groups.items()}, views, order, ranks, degrees, loads, options)
    final, loads = kept if kept[1].objective()[0] <= fresh[1].objective()[0] * (1 + options.switch_gain) else fresh
    est = loads.objective()[0]
    reasons = {t: f"{groups[t]} -> {g}: est. round {est * 1e3:.2f} ms" for t, g in final.items() if g != groups[t]}
    return RoundPlan({r: tuple(a) for r, a in admit.items() if a}, final, _forwards(final, views), est, reasons)


def _search(groups: dict[int, tuple[int, ...]], views: dict[int, TrajView], order: list[int], ranks: tuple[int, ...],
            degrees: list[int], like: _Loads, options: ElasticOptions) -> tuple[dict[int, tuple[int, ...]], _Loads]:
    loads = _Loads(ranks, like.cost, like.scale, like.speed, like.scale_default)
    owned = {r: 0 for r in ranks}
    for tid, group in groups.items():
        loads.add(views[tid], group)
        owned[group[0]] += 1
    for _ in range(2 * len(order) + 1):
        room = {r for r in ranks if owned[r] < options.max_running}
        move = _best_move(order, views, groups, loads, ranks, degrees, options.switch_gain, room)
        if move is None:
            break
        tid, new = move
        old = groups[tid]
        owned[old[0]] -= 1
        owned[new[0]] += 1
        loads.add(views[tid], old, -1)
        loads.add(views[tid], new)
        groups[tid] = new
    return groups, loads


def _best_move(order: list[int], views: dict[int, TrajView], groups: dict[int, tuple[int, ...]], loads: _Loads,
               ranks: tuple[int, ...], degrees: list[int], gain: float, room: set[int]
               ) -> tuple[int, tuple[int, ...]] | None:
    cur = loads.objective()
    slowest = max(ranks, key=lambda r: (loads.load[r], -r))
    band = cur[0] * (1 - gain)  # workers loaded above it are as slow as the slowest, within the gain
    tied = _above(loads, band)
    best, best_obj = None, None
    for tid in order:
        old = groups[tid]
        if slowest not in old:
            continue
        v = views[tid]
        loads.add(v, old, -1)
        for new in _options(old, ranks, degrees, loads, v.remaining):
            if new[0] != old[0] and new[0] not in room:
                continue  # a new owner needs a free slot
            loads.add(v, new)
            obj = loads.objective()
            # where others are nearly as slow, no single move shortens the round by the gain; a
            # move that takes the slowest out of that band, putting no one into it, is the first
            # of the moves that do
            relieved = loads.load[slowest] < band and _above(loads, band) < tied
            loads.add(v, new, -1)
            # a shorter round, or the same round with less work in all, by more than the gain
            worth = obj[0] < cur[0] * (1 - gain) or (obj[0] <= cur[0] * (1 + 1e-9)
                                                      and (obj[1] < cur[1] * (1 - gain) or relieved))
            if worth and (best_obj is None or obj < best_obj):
                best, best_obj = (tid, new), obj
        loads.add(v, old)
    return best


def _above(loads: _Loads, level: float) -> int:
    """How many workers are loaded to `level` or more."""
    return sum(x >= level for x in loads.load.values())


def _options(old: tuple[int, ...], ranks: tuple[int, ...], degrees: list[int], loads: _Loads, remaining: int
             ) -> list[tuple[int, ...]]:
    """Groups to try: each holder leading (no transfer for it), the least-loaded others joining;
    degree 1 on any worker (migration). Not spread with one step left."""
    out = []
    for d in degrees:
        if d > len(old) and remaining < 2:
            continue
        if d == 1:
            out += [(r,) for r in ranks if (r,) != old]
            continue
        for lead in old:
            others = sorted((r for r in ranks if r != lead), key=lambda r: (loads.load[r], r))
            group = (lead, *sorted(others[:d - 1]))
            if group != old and group not in out:
                out.append(group)
    return out


def _forwards(groups: dict[int, tuple[int, ...]], views: dict[int, TrajView]) -> tuple[Forward, ...]:
    by: dict[tuple, list[int]] = {}
    for tid in sorted(groups):
        by.setdefault((groups[tid], views[tid].key), []).append(tid)
    items = sorted(by.items(), key=lambda kv: (len(kv[0][0]) > 1, kv[0][0], repr(kv[0][1])))
    return tuple(Forward(g, tuple(tids)) for (g, _), tids in items)
