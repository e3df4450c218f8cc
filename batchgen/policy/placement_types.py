"""The placement's inputs and output (see placement.py): per-model demand and profiled costs,
per-worker memory, and the Placement with its predicted makespan. Pure dataclasses."""
from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import BatchgenError

Policy = Literal["ilp", "round_robin", "data_parallel"]
POLICIES: tuple[str, ...] = ("ilp", "round_robin", "data_parallel")
GAP = 0.01  # relative optimality gap at which the solver may stop (see place)


class PlacementError(BatchgenError):
    """The models cannot be placed (memory), or the inputs are inconsistent."""


@dataclass(frozen=True, slots=True)
class Demand:
    """The rows routed to one model and their predicted generated (+ prompt) token counts."""

    rows: tuple[Hashable, ...]
    tokens: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.tokens):
            raise PlacementError(f"Demand: {len(self.rows)} rows but {len(self.tokens)} token counts")
        if any(not (t >= 0 and math.isfinite(t)) for t in self.tokens):
            raise PlacementError("Demand: token counts must be finite and >= 0")

    @classmethod
    def of(cls, rows: Mapping[Hashable, float]) -> Demand:
        return cls(tuple(rows), tuple(float(t) for t in rows.values()))

    @property
    def total(self) -> float:
        return float(sum(self.tokens))


@dataclass(frozen=True, slots=True)
class ModelCost:
    """Profiled cost of one model: seconds per generated token at full batch, seconds to load
    (engine start and warm-up), bytes held, and seconds per row whatever its length (prefill,
    admission, detokenizing and returning it: what makes a model of short answers cost more
    than its tokens say)."""

    seconds_per_token: float
    load_s: float = 0.0
    memory_bytes: int = 0
    seconds_per_row: float = 0.0
    # A forward's fixed cost, whatever its batch, and the batch the engine runs at most: a
    # replica runs max(its longest row's tokens, its tokens / max_batch) forwards, so half the
    # rows on each of two replicas costs more than all of them on one until both batches are full.
    seconds_per_step: float = 0.0
    max_batch: int = 256

    def __post_init__(self) -> None:
        if not (isinstance(self.max_batch, int) and self.max_batch >= 1):
            raise PlacementError(f"ModelCost.max_batch must be an int >= 1, got {self.max_batch!r}")
        for name in ("seconds_per_token", "load_s", "memory_bytes", "seconds_per_row", "seconds_per_step"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise PlacementError(f"ModelCost.{name} must be finite and >= 0, got {value!r}")

    def row_s(self, tokens: float) -> float:
        """Predicted seconds of one row of `tokens` predicted tokens."""
        return self.seconds_per_row + tokens * self.seconds_per_token

    def work_s(self, demand: Demand) -> float:
        """Rows' work, without the forwards' fixed cost (steps_s)."""
        return len(demand.rows) * self.seconds_per_row + demand.total * self.seconds_per_token

    def steps_s(self, tokens: Sequence[float]) -> float:
        """The forwards' fixed cost of one replica running rows of these predicted tokens."""
        return self.steps_s_of(max(tokens), sum(tokens)) if tokens else 0.0

    def steps_s_of(self, longest: float, total: float) -> float:
        """steps_s from its two sums: the longest row's tokens and all rows' tokens (a replica
        runs at least the longest row's forwards, and at least total / max_batch of them)."""
        return self.seconds_per_step * max(longest, total / self.max_batch) if self.seconds_per_step else 0.0


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """One worker (one device) and the memory models may use on it."""

    name: str
    memory_bytes: int | float = math.inf


@dataclass(frozen=True, slots=True)
class Placement:
    """`replicas[model]`: the workers holding it; `rows[worker][model]`: the rows it runs there."""

    policy: str
    replicas: dict[str, tuple[str, ...]]
    rows: dict[str, dict[str, tuple[Hashable, ...]]]
    worker_s: dict[str, float]  # predicted expert-stage seconds per worker
    solver: str = ""  # "ilp" (proved within `gap`) | "ilp-incumbent" (time limit) | "greedy" | policy name
    solve_s: float = 0.0
    note: str = ""  # why the fallback was used, if it was
    optimal: bool = False

    @property
    def makespan_s(self) -> float:
        """Predicted expert-stage time: the slowest worker's load + work."""
        return max(self.worker_s.values(), default=0.0)

    def worker_of(self) -> dict[tuple[str, Hashable], str]:
        """(model, row) -> worker."""
        return {(m, r): w for w, by_model in self.rows.items() for m, rs in by_model.items() for r in rs}

    def describe(self) -> str:
        reps = ", ".join(f"{m}: {len(ws)}" for m, ws in sorted(self.replicas.items()))
        return (f"{self.policy} ({self.solver}{'; ' + self.note if self.note else ''}): replicas {reps}; "
                f"predicted expert stage {self.makespan_s:.3g} s")
