"""How rows reach workers: the placements compared side by side. Small frozen variants.

- Static:   each worker gets 1/N of the rows up front (contiguous, in file order) and runs them
            with continuous batching: vLLM per node, Ray Data with fixed blocks.
- Dynamic:  a shared queue of small batches; a worker whose queue has drained pulls the next
            one. Nothing moves once placed (no migration).
- BatchGen: the rows are dealt as Static (one partition per worker), then every tick the real
            `plan_migrations` (policy/balance.py) reads each engine's load and orders splits of
            not-started coroutines and migrations of running ones, as the Dask plugin does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import PlanError
from ..policy.balance import BalanceConfig


@dataclass(frozen=True, slots=True)
class Static:
    name: str = "static"


@dataclass(frozen=True, slots=True)
class Dynamic:
    batch_rows: int = 64
    name: str = "dynamic"

    def __post_init__(self) -> None:
        if self.batch_rows < 1:
            raise PlanError(f"dynamic batch_rows must be >= 1, got {self.batch_rows}")


@dataclass(frozen=True, slots=True)
class BatchGen:
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    name: str = "batchgen"


Policy = Static | Dynamic | BatchGen
DEFAULT_POLICIES: tuple[Policy, ...] = (Static(), Dynamic(), BatchGen())
