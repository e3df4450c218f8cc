"""A simulated cluster's starting state: each engine given its partition of the workload's rows."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .cost import CostModel
from .engine import SimEngine
from .engine_config import EngineSimConfig
from .seqs import make_sequence
from .workload import Workload

if TYPE_CHECKING:
    from ..runtime.sequence import Sequence


def rows_as_sequences(workload: Workload, rows: np.ndarray) -> list[Sequence]:
    # plain ints first (indexing numpy arrays row by row makes numpy scalars: slower)
    p, o, m = (a[rows].tolist() for a in (workload.prompt_len, workload.output_len, workload.max_tokens))
    if workload.group is None:
        return list(map(make_sequence, rows.tolist(), p, m, o))
    return list(map(make_sequence, rows.tolist(), p, m, o, workload.group[rows].tolist()))


def partitioned_engines(names: list[str], parts: list[np.ndarray], workload: Workload, cost: CostModel,
                        config: EngineSimConfig) -> list[SimEngine]:
    """One engine per name, each given its partition's rows (static and batchgen start so)."""
    engines = [SimEngine(name, cost, config) for name in names]
    for e, part in zip(engines, parts):
        give_rows(e, workload, part)
    return engines


def give_rows(engine: SimEngine, workload: Workload, rows: np.ndarray) -> None:
    """`engine` gets the workload's `rows` at time 0, in order (a partition, as a task hands it over)."""
    for seq in rows_as_sequences(workload, rows):
        engine.add(seq)
