"""Cluster balancing policy: engine loads in, migration orders out. Pure, torch-free, no Dask.

The scheduler plugin calls `plan_migrations` with the latest load of every worker's engine; the
same function can drive a simulator. One concept covers the three runtime moves of the design:

- split:   a big partition's coroutines that have not started yet (no KV, nothing to lose) move
           to a worker with less work, so one partition runs on several engines;
- migrate: running coroutines move from a busy engine to an idle one (the long tail at the end
           of a job); they travel suspended, with their KV or to be recomputed;
- combine: is what does *not* move. Every partition on a worker already joins that worker's
           engine; the policy never moves work below `min_move_tokens`, never splits a lone
           coroutine, and so keeps small batches together instead of spreading them thin.

Work is measured in tokens still to generate (the engine's upper bound, max_tokens minus those
done), divided by each engine's measured speed relative to the others: finishing time. A
measured speed (generated tokens/s at capacity) follows the rows an engine ran as much as its
hardware: in a simulated fleet of equal GPUs, engines that had run long-prompt rows measured 8x
less than those that had run reasoning rows, and were sent almost nothing. So engines that
report their `device` class (hardware and the settings that set its pace) count as equally fast
within a class, and classes compare by the median speed of their engines; without classes,
engines whose speeds lie within `speed_tolerance` of each other count as equally fast. An
engine not yet measured counts as average. A running coroutine that moves without its KV costs
`recompute_weight` decode-token units per token to recompute.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class CoroutineInfo:
    """One movable coroutine as its engine reports it."""

    seq_id: int
    remaining: int  # tokens still to generate (upper bound)
    num_computed: int = 0  # tokens with KV in the cache; 0: not started (free to move)

    @property
    def is_started(self) -> bool:
        return self.num_computed > 0


# Most movable coroutines one load report lists (the policy needs candidates, not all of them).
MAX_REPORTED = 256


def report_order(remaining: int, num_computed: int) -> tuple[bool, int]:
    """The order a load report lists movable coroutines in: not-started ones first (free to
    move), then the most remaining."""
    return (num_computed > 0, -remaining)


def reported_movable(coroutines: Iterable[CoroutineInfo], limit: int = MAX_REPORTED) -> tuple[CoroutineInfo, ...]:
    """What an engine's load report lists as movable: at most `limit`, in report_order (ties in
    input order: heapq.nsmallest is sorted(...)[:limit]). The runner and the simulator both
    report through this."""
    return tuple(heapq.nsmallest(limit, coroutines, key=lambda c: report_order(c.remaining, c.num_computed)))


def reported_movable_rows(rows: Iterable[tuple[int, int, int]], limit: int = MAX_REPORTED
                          ) -> tuple[CoroutineInfo, ...]:
    """reported_movable of (seq_id, remaining, num_computed) rows, a CoroutineInfo made only for
    those listed (an engine holding thousands of rows lists `limit` of them, every 0.1 s)."""
    return tuple(CoroutineInfo(*r) for r in heapq.nsmallest(limit, rows, key=lambda r: report_order(r[1], r[2])))


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One worker's engine for one model. `ready` False: the worker has no engine for it yet."""

    worker: str
    model: str
    ready: bool = True
    waiting: int = 0
    running: int = 0
    remaining_tokens: int = 0
    kv_used: float = 0.0
    tokens_per_s: float = 0.0
    movable: tuple[CoroutineInfo, ...] = ()
    speed: float = 0.0  # generated tokens/s it can sustain (peak measured); 0: not measured yet
    kv_capacity_tokens: int = 0  # the KV pool's size; 0: unknown (planned orders not counted in kv_used)
    max_num_seqs: int = 0  # its batch's seats; 0: unknown (incoming running coroutines not bounded by them)
    device: str = ""  # device class (e.g. "cuda NVIDIA H200 bfloat16"); "": not reported


@dataclass(frozen=True, slots=True)
class BalanceConfig:
    split: bool = True  # move coroutines that have not started
    migrate: bool = True  # move running coroutines (suspend / resume)
    imbalance_ratio: float = 1.5  # act only when src work >= ratio * dst work
    min_move_tokens: int = 16  # smaller orders are not worth a round trip
    min_remaining: int = 4  # a coroutine this close to done stays where it is
    recompute_weight: float = 0.05  # decode-token units per token of KV to recompute
    max_kv_used: float = 0.9  # a destination this full takes nothing
    cold_start_tokens: int = 4096  # work that justifies loading the model on a worker without it
    max_orders: int = 8  # per planning round
    max_coroutines_per_order: int = 256
    # While tasks are still waiting to start, new partitions will land on idle workers anyway:
    # only not-started coroutines move then, running ones wait for the tail.
    tail_only: bool = True
    # Engines whose measured speeds differ by less than this factor are treated as equal. Keep it
    # below imbalance_ratio: else a speed estimate crossing the tolerance could move work back.
    speed_tolerance: float = 1.3

    def __post_init__(self) -> None:
        if self.imbalance_ratio < 1.0:
            raise ValueError(f"BalanceConfig.imbalance_ratio must be >= 1, got {self.imbalance_ratio!r}")
        for name in ("min_move_tokens", "min_remaining", "cold_start_tokens", "max_orders",
                     "max_coroutines_per_order"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"BalanceConfig.{name} must be an integer >= 0, got {value!r}")
        if not 0.0 <= self.max_kv_used <= 1.0:
            raise ValueError(f"BalanceConfig.max_kv_used must be in [0, 1], got {self.max_kv_used!r}")
        if self.speed_tolerance < 1.0:
            raise ValueError(f"BalanceConfig.speed_tolerance must be >= 1, got {self.speed_tolerance!r}")
        if self.recompute_weight < 0:
            raise ValueError(f"BalanceConfig.recompute_weight must be >= 0, got {self.recompute_weight!r}")

    @property
    def enabled(self) -> bool:
        return self.split or self.migrate


@dataclass(frozen=True, slots=True)
class Migration:
    """Order to `src`: suspend `seq_ids` of engine `model` and send them to `dst`."""

    src: str
    dst: str
    model: str
    seq_ids: tuple[int, ...]
    tokens: int  # remaining tokens that move
    reason: str  # "split" (none started) or "migrate"


@dataclass(slots=True)
class _Node:
    load: EngineLoad
    work: float  # remaining tokens / relative speed: tokens at the average engine's pace
    speed: float = 1.0  # relative to the average engine of this model
    taken: set[int] = field(default_factory=set)
    kv_incoming: int = 0  # KV tokens of the started coroutines this plan already sends here
    queued: int = 0  # coroutines waiting there for a seat, with those this plan sends there
    seats_incoming: int = 0  # started coroutines this plan already sends here

    def room(self, config: BalanceConfig) -> tuple[float, float]:
        """(KV tokens, coroutines) of started work it can take and run at once: none while
        coroutines queue there (they would park behind the queue, their KV in host memory or
        lost); else its pool below max_kv_used and its free seats, net of this plan's orders
        (inf where the engine does not report its pool or seats)."""
        if self.queued:
            return 0.0, 0.0
        load, inf = self.load, float("inf")
        kv = (config.max_kv_used - load.kv_used) * load.kv_capacity_tokens - self.kv_incoming \
            if load.kv_capacity_tokens > 0 else inf
        seats = load.max_num_seqs - load.running - self.seats_incoming if load.max_num_seqs > 0 else inf
        return kv, seats


def relative_speeds(loads: list[EngineLoad], tolerance: float) -> list[float]:
    """Each engine's speed relative to the mean of the measured ones; 1.0 for the unmeasured,
    and for all when the measured ones are within `tolerance` of each other. When every engine
    names its device class, an engine's speed is its class's median measured speed: engines of
    one class are equally fast, whatever rows they happened to run."""
    if loads and all(load.device for load in loads):
        by_class: dict[str, list[float]] = {}
        for load in loads:
            if load.speed > 0:
                by_class.setdefault(load.device, []).append(load.speed)
        median = {k: sorted(v)[len(v) // 2] for k, v in by_class.items()}  # (the upper median)
        speeds = [median.get(load.device, 0.0) for load in loads]
    else:
        speeds = [load.speed for load in loads]
    measured = [v for v in speeds if v > 0]
    if len(measured) < 2 or max(measured) < tolerance * min(measured):
        return [1.0] * len(loads)
    mean = sum(measured) / len(measured)
    return [min(10.0, max(0.1, v / mean)) if v > 0 else 1.0 for v in speeds]


def plan_migrations(loads: Iterable[EngineLoad], config: BalanceConfig | None = None, *,
                    arriving: bool = False) -> list[Migration]:
    """Orders that even out remaining work between engines of the same model.

    Repeatedly pairs the engine with the most work with the one with the least, and moves
    coroutines worth at most half the gap: not-started ones first (largest first), then running
    ones by remaining tokens, net of their recompute cost. Stops when the gap is under the
    thresholds or `max_orders` is reached. `arriving`: tasks are still waiting to start
    somewhere; with `config.tail_only` running coroutines then stay put.
    """
    config = config or BalanceConfig()
    if arriving and config.tail_only:
        config = replace(config, migrate=False)
    if not config.enabled:
        return []
    by_model: dict[str, list[EngineLoad]] = {}
    for load in loads:
        by_model.setdefault(load.model, []).append(load)
    orders: list[Migration] = []
    for model in sorted(by_model):
        orders += _plan_model(by_model[model], config, config.max_orders - len(orders))
    return orders


def _plan_model(loads: list[EngineLoad], config: BalanceConfig, budget: int) -> list[Migration]:
    loads = sorted(loads, key=lambda x: x.worker)
    nodes = [_Node(load, load.remaining_tokens / speed, speed, queued=load.waiting)
             for load, speed in zip(loads, relative_speeds(loads, config.speed_tolerance))]
    orders: list[Migration] = []
    exhausted: set[str] = set()  # sources with nothing worth moving left
    while len(orders) < budget:
        sources = [n for n in nodes if n.load.ready and n.load.worker not in exhausted and n.load.movable]
        if not sources:
            break
        src = max(sources, key=lambda n: n.work)
        dst = _pick_destination(nodes, src, config)
        if dst is None or not _worth_moving(src.work, dst.work, config):
            # No other source is worth it either: each has no more work than src, and its
            # destination no less (the same least-loaded engine, or src itself). Stopping here
            # makes a plan O(workers x orders), not O(workers^2): 22 ms a plan at 128 workers.
            break
        # x tokens move so that both finish together: (Ws - x) / vs = (Wd + x) / vd, in raw tokens
        # W = work * v, so x = vs * vd * (work_s - work_d) / (vs + vd): half the gap at equal speeds
        target = src.speed * dst.speed * (src.work - dst.work) / (src.speed + dst.speed)
        picked, tokens, cost = _pick(src, target, config, *dst.room(config))
        if tokens < config.min_move_tokens or not picked:
            exhausted.add(src.load.worker)
            continue
        src.taken.update(c.seq_id for c in picked)
        src.work -= tokens / src.speed
        dst.work += (tokens + cost) / dst.speed
        dst.kv_incoming += sum(c.num_computed for c in picked)
        dst.queued += sum(not c.is_started for c in picked)
        dst.seats_incoming += sum(c.is_started for c in picked)
        reason = "migrate" if any(c.is_started for c in picked) else "split"
        orders.append(Migration(src.load.worker, dst.load.worker, src.load.model,
                                tuple(c.seq_id for c in picked), tokens, reason))
    return orders


def _pick_destination(nodes: list[_Node], src: _Node, config: BalanceConfig) -> _Node | None:
    candidates = [n for n in nodes if n is not src and n.load.kv_used < config.max_kv_used
                  and (n.load.ready or src.work >= config.cold_start_tokens)]
    return min(candidates, key=lambda n: (n.work, not n.load.ready), default=None)


def _worth_moving(src_work: float, dst_work: float, config: BalanceConfig) -> bool:
    return src_work - dst_work >= 2 * config.min_move_tokens and src_work >= config.imbalance_ratio * dst_work


def _pick(src: _Node, target: float, config: BalanceConfig, kv_room: float = float("inf"),
          seats: float = float("inf")) -> tuple[list[CoroutineInfo], int, float]:
    """Greedy, largest first, never past `target`; started ones only while their KV and seats fit
    the destination's room (else it recomputes or parks them): -> (coroutines, tokens, recompute cost)."""
    free = [c for c in src.load.movable if c.seq_id not in src.taken and c.remaining >= config.min_remaining]
    fresh = sorted((c for c in free if not c.is_started), key=lambda c: -c.remaining) if config.split else []
    running = sorted((c for c in free if c.is_started),
                     key=lambda c: -(c.remaining - config.recompute_weight * c.num_computed)) \
        if config.migrate else []
    picked: list[CoroutineInfo] = []
    tokens, cost = 0, 0.0
    for c in fresh + running:
        if len(picked) >= config.max_coroutines_per_order:
            break
        extra = config.recompute_weight * c.num_computed
        if c.remaining <= extra or tokens + c.remaining > target:
            continue
        if c.is_started:
            if c.num_computed > kv_room or seats < 1:
                continue
            kv_room, seats = kv_room - c.num_computed, seats - 1
        picked.append(c)
        tokens += c.remaining
        cost += extra
    return picked, tokens, cost
