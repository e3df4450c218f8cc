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
done), divided by each engine's measured speed relative to the others: finishing time. Engines
whose speeds lie within `speed_tolerance` of each other count as equally fast (a speed measured
on a different mix of rows is noise, not a slower device); an engine not yet measured counts as
average. A running coroutine that moves without its KV costs `recompute_weight` decode-token
units per token to recompute.
"""
from __future__ import annotations

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


def reported_movable(coroutines: Iterable[CoroutineInfo], limit: int = MAX_REPORTED) -> tuple[CoroutineInfo, ...]:
    """What an engine's load report lists as movable: not-started ones first (free to move), then
    the most remaining; at most `limit`. The runner and the simulator both report through this."""
    return tuple(sorted(coroutines, key=lambda c: (c.is_started, -c.remaining))[:limit])


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
    kv_capacity_tokens: int = 0  # tokens its KV pool holds; 0: not known (orders then use kv_used alone)


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
    kv_used: float = 0.0  # reported KV use plus what this round's orders bring (when the pool size is known)

    def kv_room(self, config: BalanceConfig) -> float:
        """Tokens of KV this engine can still take before `max_kv_used` (inf: pool size not known)."""
        cap = self.load.kv_capacity_tokens
        return (config.max_kv_used - self.kv_used) * cap if cap > 0 else float("inf")


def relative_speeds(loads: list[EngineLoad], tolerance: float) -> list[float]:
    """Each engine's speed relative to the mean of the measured ones; 1.0 for the unmeasured,
    and for all when the measured ones are within `tolerance` of each other."""
    measured = [load.speed for load in loads if load.speed > 0]
    if len(measured) < 2 or max(measured) < tolerance * min(measured):
        return [1.0] * len(loads)
    mean = sum(measured) / len(measured)
    return [min(10.0, max(0.1, load.speed / mean)) if load.speed > 0 else 1.0 for load in loads]


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
    nodes = [_Node(load, load.remaining_tokens / speed, speed, kv_used=load.kv_used)
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
            exhausted.add(src.load.worker)
            continue
        # x tokens move so that both finish together: (Ws - x) / vs = (Wd + x) / vd, in raw tokens
        # W = work * v, so x = vs * vd * (work_s - work_d) / (vs + vd): half the gap at equal speeds
        target = src.speed * dst.speed * (src.work - dst.work) / (src.speed + dst.speed)
        picked, tokens, cost = _pick(src, target, config, dst.kv_room(config))
        if tokens < config.min_move_tokens or not picked:
            exhausted.add(src.load.worker)
            continue
        src.taken.update(c.seq_id for c in picked)
        src.work -= tokens / src.speed
        dst.work += (tokens + cost) / dst.speed
        if dst.load.kv_capacity_tokens > 0:  # the next order of this round sees the pool these fill
            dst.kv_used += sum(kv_footprint(c) for c in picked) / dst.load.kv_capacity_tokens
        reason = "migrate" if any(c.is_started for c in picked) else "split"
        orders.append(Migration(src.load.worker, dst.load.worker, src.load.model,
                                tuple(c.seq_id for c in picked), tokens, reason))
    return orders


def kv_footprint(c: CoroutineInfo) -> int:
    """KV tokens a moved coroutine holds at the destination once it ends there (its computed
    tokens, recomputed or sent, plus those still to generate; a not-started one's prompt is not
    reported, so it counts its output alone)."""
    return c.num_computed + c.remaining


def _pick_destination(nodes: list[_Node], src: _Node, config: BalanceConfig) -> _Node | None:
    candidates = [n for n in nodes if n is not src and n.kv_used < config.max_kv_used
                  and (n.load.ready or src.work >= config.cold_start_tokens)]
    return min(candidates, key=lambda n: (n.work, not n.load.ready), default=None)


def _worth_moving(src_work: float, dst_work: float, config: BalanceConfig) -> bool:
    return src_work - dst_work >= 2 * config.min_move_tokens and src_work >= config.imbalance_ratio * dst_work


def _pick(src: _Node, target: float, config: BalanceConfig, kv_room: float = float("inf")
          ) -> tuple[list[CoroutineInfo], int, float]:
    """Greedy, largest first, never past `target` nor past the destination's KV room (tokens):
    -> (coroutines, their tokens, recompute cost)."""
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
        if c.remaining <= extra or tokens + c.remaining > target or kv_footprint(c) > kv_room:
            continue
        picked.append(c)
        tokens += c.remaining
        cost += extra
        kv_room -= kv_footprint(c)
    return picked, tokens, cost
