"""How rows reach workers: the placements compared side by side. Small frozen variants.

- Static:   each worker gets 1/N of the rows up front (contiguous, in file order) and runs them
            with continuous batching: vLLM per node, Ray Data with fixed blocks.
- Dynamic:  a shared queue of small batches; a worker whose queue has drained pulls the next
            one. Nothing moves once placed (no migration).
- BatchGen: the rows are dealt as Static (one partition per worker), then every tick the real
            `plan_migrations` (policy/balance.py) reads each engine's load and orders splits of
            not-started coroutines and migrations of running ones, as the Dask plugin does.
- length-aware: BatchGen whose engines admit the rows predicted longest first (the runtime's
            `admission="length"`: runtime/length_order.py, policy/length_prediction.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..errors import PlanError
from ..policy.balance import BalanceConfig
from ..runtime.policy import Admission


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
    admission: Admission = "fifo"  # the engines' admission order (EngineSimConfig.admission)

    def __post_init__(self) -> None:
        if self.admission not in ("fifo", "length"):
            raise PlanError(f"batchgen admission must be 'fifo' or 'length', got {self.admission!r}")


Policy = Static | Dynamic | BatchGen
DEFAULT_POLICIES: tuple[Policy, ...] = (Static(), Dynamic(), BatchGen())
LENGTH_AWARE = BatchGen(admission="length", name="length-aware")
POLICIES: dict[str, Policy] = {p.name: p for p in (*DEFAULT_POLICIES, LENGTH_AWARE)}


def deal(occupancy: list[tuple[int, int]], batches: deque[np.ndarray], max_num_seqs: int) -> list[list[np.ndarray]]:
    """Dynamic's pull, from each engine's (waiting, running) rows: workers whose queue has
    drained pull a batch each, in turn, until their seats are spoken for (workers pull at once,
    not one after another: round-robin, not first come). -> the batches each engine gets."""
    given: list[list[np.ndarray]] = [[] for _ in occupancy]
    held = [waiting + running for waiting, running in occupancy]
    hungry = [i for i, (waiting, _) in enumerate(occupancy) if not waiting]
    while batches and hungry:
        for i in list(hungry):
            if not batches:
                return given
            batch = batches.popleft()
            given[i].append(batch)
            held[i] += len(batch)
            if held[i] >= max_num_seqs:
                hungry.remove(i)
    return given
