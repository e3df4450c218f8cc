"""Where a job's requests are generated: the seam between the job runner and the engine.

The runner hands a backend a lazy stream of work items (one per valid row, made by the job's
``Work``) and writes each result as it comes back, so any backend that can ``run`` such a stream
with bounded rows in flight and yield results in finishing order plugs in: an Engine, a Dask
cluster, a pool of models, an image job's diffusion engine.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from batchgen.engine import Engine
    from batchgen.io.request import Request
    from batchgen.outputs import RequestOutput
    from batchgen.sampling_params import SamplingParams


class Backend(Protocol):
    def run(self, requests: Iterable[Any], max_in_flight: int) -> Iterator[tuple[int, Any]]:
        """Run a stream of work items; yield ``(position in the stream, output)`` as each
        finishes, pulling at most ``max_in_flight`` items ahead of the finished ones. An output
        (``RequestOutput`` for text) whose ``finish_reason`` is "error" fails its row (``error``
        says why)."""
        ...


@dataclass(frozen=True, slots=True)
class Work:
    """What a kind of job hands its backend for each valid row, and what its results count."""

    item: Callable[[Any], Any]  # a valid row (a Request, or the job's subclass) -> a work item
    amount: Callable[[Any], int]  # a successful output -> what it generated, in ``unit``
    unit: str = "tokens"  # only tokens feed the progress line's tok/s


def text_item(req: Request) -> tuple[list[int], SamplingParams] | tuple[list[int], SamplingParams, str]:
    """A multi-model row also names its model (a ``batchgen.moa.MultiModelBackend`` takes those)."""
    assert req.prompt_token_ids is not None and req.params is not None
    if req.model is None:
        return req.prompt_token_ids, req.params
    return req.prompt_token_ids, req.params, req.model


TEXT = Work(text_item, attrgetter("num_generated_tokens"))


class EngineBackend:
    """Runs on one in-process ``Engine``, topping it up as rows finish."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def run(self, requests: Iterable[tuple[list[int], SamplingParams]],
            max_in_flight: int) -> Iterator[tuple[int, RequestOutput]]:
        return self.engine.run_requests(requests, max_in_flight=max_in_flight)

    def progress_status(self) -> str:
        """The engine's own figures (prefix cache, expert hit rates) for the progress line."""
        status = getattr(self.engine, "progress_status", None)
        return status() if status is not None else ""
