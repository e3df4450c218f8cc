"""Torch-free expert-tier policies: tier sizes from byte budgets, routing statistics, next-layer
prediction, and which resident experts to evict.

State in, decisions out: the expert store (offload/store.py) and the simulator drive these with
plain ints and floats, so a policy can be measured on a routing trace without a model.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# Eviction policies (ExpertStore.eviction / EngineConfig.expert_eviction):
#   "routing":     evict the expert whose loss costs least: the smallest probability of being
#                  needed (routing statistics of recent stages) per layer of distance until its
#                  layer runs again. With every expert always needed this is Belady's choice
#                  for the cyclic layer sweep; with skewed routing, cold experts go first.
#   "layer-order": Belady on layer order alone (the expert whose layer runs furthest ahead),
#                  least recently used within a layer; blind to how often an expert is needed.
EVICTIONS = ("routing", "layer-order")
# Next-layer predictors for prefetch:
#   "history": experts the next MoE layer needed in recent stages (decayed need probability);
#   "router":  the next layer's router applied early to the current stage's hidden state
#              (predicts better: 89% of its picks used against 77%, bench_offload);
#   "none":    no reads ahead;
#   "auto":    "router" on CUDA, where copies on a side stream overlap the kernels; "none" on
#              a CPU device, where reads ahead only added bytes (20-45% more) and time on
#              this 2-core machine: the reader competes with compute for the same cores.
PREDICTORS = ("auto", "history", "router", "none")


def resolve_predictor(predictor: str, device_type: str) -> str:
    if predictor != "auto":
        return predictor
    return "router" if device_type == "cuda" else "none"


class BudgetError(ValueError):
    """A tier budget that cannot hold one MoE layer's experts."""


@dataclass(frozen=True, slots=True)
class TierPlan:
    """Experts per tier. device_slots: the pool the kernel reads. host_slots: experts kept in
    host memory (None: all of them, loaded at start; an int: a cache filled from the
    checkpoint on disk). shared: the kernel reads the host cache itself (a CPU device given
    only a host budget: one memory, one copy)."""

    device_slots: int
    host_slots: int | None
    total_experts: int
    shared: bool = False

    @property
    def from_disk(self) -> bool:
        return self.host_slots is not None


def plan_tiers(expert_bytes: int, total_experts: int, widest_layer: int, device_budget: int | None,
               host_budget: int | None, device_is_host: bool) -> TierPlan | None:
    """Byte budgets -> a TierPlan, or None when nothing is offloaded (both unset, or every
    expert fits the budgets given). Each budget must hold one MoE layer's experts: a stage may
    need all of them at once."""
    total = expert_bytes * total_experts
    minimum = expert_bytes * widest_layer
    for name, budget in (("expert_memory_bytes", device_budget), ("expert_host_memory_bytes", host_budget)):
        if budget is not None and budget < minimum:
            raise BudgetError(f"{name}={budget} cannot hold one MoE layer's {widest_layer} experts "
                              f"(at least {minimum} bytes; all routed experts take {total})")
    device = None if device_budget is None or device_budget >= total else device_budget // expert_bytes
    host = None if host_budget is None or host_budget >= total else host_budget // expert_bytes
    if host is None:
        return None if device is None else TierPlan(device, None, total_experts)
    if device is None and device_is_host:
        return TierPlan(host, host, total_experts, shared=True)
    if device is None:  # every expert on the device would defeat the point (and not fit)
        raise BudgetError("expert_host_memory_bytes on an accelerator needs expert_memory_bytes too: "
                          "the device pool the experts stream through")
    return TierPlan(device, host, total_experts)


@dataclass(slots=True)
class RoutingStats:
    """Per MoE layer and expert, a decayed probability that a stage needs the expert: after
    each stage of a layer, p <- decay * p + (1 - decay) * [needed]."""

    decay: float = 0.75
    need: dict[int, list[float]] = field(default_factory=dict)
    expected: dict[int, float] = field(default_factory=dict)  # decayed count of experts a stage needs

    def observe(self, layer: int, num_experts: int, needed: Iterable[int]) -> None:
        row = self.need.setdefault(layer, [0.0] * num_experts)
        d, fresh = self.decay, 1.0 - self.decay
        for e in range(num_experts):
            row[e] *= d
        count = 0
        for e in needed:
            row[e] += fresh
            count += 1
        self.expected[layer] = d * self.expected.get(layer, float(count)) + fresh * count

    def probability(self, layer: int, expert: int) -> float:
        row = self.need.get(layer)
        return row[expert] if row is not None else 0.0

    def predict(self, layer: int) -> list[int]:
        """The experts most likely needed by the next stage of `layer`: as many as a stage has
        recently needed, most probable first; none before the layer has been seen."""
        row = self.need.get(layer)
        if row is None:
            return []
        count = round(self.expected.get(layer, 0.0))
        ranked = sorted(range(len(row)), key=lambda e: -row[e])
        return [e for e in ranked[:count] if row[e] > 0.0]


def layers_ahead(position: int, here: int, num_layers: int) -> int:
    """MoE stages until the layer at `position` runs again, seen from the stage at `here`
    (1 = next stage; the current layer itself runs again only after a full sweep)."""
    return (position - here - 1) % num_layers + 1


def pick_victims(count: int, residents: Sequence[tuple[int, int, int]], here: int, positions: dict[int, int],
                 eviction: str, stats: RoutingStats | None = None) -> list[tuple[int, int]]:
    """Choose `count` (layer, expert) pairs to evict.

    residents: evictable (layer, expert, last_use) triples (the caller leaves out what the
    current stage needs and reads in flight); here: the position of the current MoE stage in
    the layer sweep; positions: layer -> its position."""
    if count <= 0:
        return []
    if count > len(residents):
        raise BudgetError(f"need {count} expert slots but only {len(residents)} can be evicted")
    n = len(positions)

    def layer_order(r: tuple[int, int, int]) -> tuple[float, ...]:
        return (-layers_ahead(positions[r[0]], here, n), r[2])

    def routing(r: tuple[int, int, int]) -> tuple[float, ...]:
        ahead = layers_ahead(positions[r[0]], here, n)
        p = stats.probability(r[0], r[1]) if stats is not None else 0.0
        return (p / ahead, -ahead, r[2])

    if eviction not in EVICTIONS:
        raise ValueError(f"unknown expert eviction {eviction!r}; choose from {EVICTIONS}")
    key = routing if eviction == "routing" else layer_order
    return [(layer, expert) for layer, expert, _ in heapq.nsmallest(count, residents, key=key)]


def next_moe_layer(layer: int, order: Sequence[int]) -> int:
    """The MoE layer whose stage runs after `layer`'s (wrapping to the first: the next forward)."""
    i = order.index(layer)
    return order[(i + 1) % len(order)]
