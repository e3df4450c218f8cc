"""Where a job's requests are generated: the seam between the job runner and the engine.

The runner hands a backend one chunk at a time and writes each result as it comes back, so any
backend that can ``submit`` a chunk and yield results in finishing order plugs in: the local
``Engine`` now, a Dask cluster later.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from batchgen.engine import Engine
    from batchgen.outputs import RequestOutput
    from batchgen.sampling_params import SamplingParams


class Backend(Protocol):
    def submit(self, prompts: Sequence[list[int]],
               params: Sequence[SamplingParams]) -> Iterator[tuple[int, RequestOutput]]:
        """Generate one chunk; yield ``(index in the chunk, output)`` as each finishes."""
        ...


class EngineBackend:
    """Runs chunks on one in-process ``Engine``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def submit(self, prompts: Sequence[list[int]],
               params: Sequence[SamplingParams]) -> Iterator[tuple[int, RequestOutput]]:
        return self.engine.stream(list(prompts), list(params))
