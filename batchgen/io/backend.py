"""Where a job's requests are generated: the seam between the job runner and the engine.

The runner hands a backend a lazy stream of requests and writes each result as it comes back, so
any backend that can ``run`` such a stream with bounded rows in flight and yield results in
finishing order plugs in.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from batchgen.engine import Engine
    from batchgen.outputs import RequestOutput
    from batchgen.sampling_params import SamplingParams


class Backend(Protocol):
    def run(self, requests: Iterable[tuple[list[int], SamplingParams]],
            max_in_flight: int) -> Iterator[tuple[int, RequestOutput]]:
        """Generate a stream of requests; yield ``(position in the stream, output)`` as each
        finishes, pulling at most ``max_in_flight`` requests ahead of the finished ones."""
        ...


class EngineBackend:
    """Runs on one in-process ``Engine``, topping it up as rows finish."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def run(self, requests: Iterable[tuple[list[int], SamplingParams]],
            max_in_flight: int) -> Iterator[tuple[int, RequestOutput]]:
        return self.engine.run_requests(requests, max_in_flight=max_in_flight)
