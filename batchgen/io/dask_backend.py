"""Backend that runs a job's rows on a Dask cluster running batchgen.

Rows go out in tasks of `rows_per_task` (token ids + SamplingParams, or image requests: small), at most
`max_in_flight` rows ahead of the finished ones; each task joins its worker's engine, where the
scheduler plugin balances coroutines between workers. A task on a worker that dies is retried
by Dask (`retries`), so every row comes back exactly once.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Client

    from batchgen.cluster.spec import EngineSpec


class DaskBackend:
    def __init__(self, client: Client, spec: EngineSpec, *, rows_per_task: int = 32, retries: int = 3) -> None:
        """spec: the engine every row runs on (EngineSpec.make for text; any engine class)."""
        self.client, self.spec = client, spec
        self.rows_per_task, self.retries = rows_per_task, retries

    def run(self, requests: Iterable[tuple[Any, Any]], max_in_flight: int) -> Iterator[tuple[int, Any]]:
        from distributed import as_completed

        from batchgen.cluster.generate import generate_rows

        source = enumerate(requests)
        per_task = max(1, min(self.rows_per_task, max_in_flight))
        done = as_completed()
        positions: dict[str, list[int]] = {}  # future key -> positions of its rows

        def submit_more() -> None:
            while sum(map(len, positions.values())) + per_task <= max(max_in_flight, per_task):
                chunk = list(itertools.islice(source, per_task))
                if not chunk:
                    return
                future = self.client.submit(generate_rows, [req for _, req in chunk], spec=self.spec.to_msg(),
                                            retries=self.retries, pure=False)
                positions[future.key] = [pos for pos, _ in chunk]
                done.add(future)

        submit_more()
        for future in done:
            outputs = future.result()
            rows = positions.pop(future.key)
            if len(outputs) != len(rows):  # never expected: fail loudly rather than drop rows
                raise RuntimeError(f"a batchgen task returned {len(outputs)} outputs for {len(rows)} rows")
            yield from zip(rows, outputs)
            submit_more()
