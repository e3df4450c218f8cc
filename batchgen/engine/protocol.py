"""CoroutineEngine: what the cluster runtime needs of an engine, text or image.

`Engine` (sequences of tokens) and `DiffusionEngine` (denoising trajectories) both satisfy it,
so one runtime (cluster/: runner, host, plugin, balancer) combines, migrates and recovers
either kind of coroutine. Work is counted in the engine's own units (`work_done`,
`LoadReport.remaining_by_id`): generated tokens for text, image-token steps for images; the
balancer only compares engines of one model, so the units never mix. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One engine's load, as the balancer reads it."""

    waiting: int
    running: int
    kv_used_fraction: float  # 0.0 for engines without a KV pool
    kv_capacity_tokens: int  # 0: no KV pool (incoming coroutines are bounded by seats only)
    max_num_seqs: int  # the batch's seats
    device_class: str  # equal classes run equally fast (balance.relative_speeds)
    remaining: int  # work units left over every unfinished coroutine
    remaining_by_id: dict[int, int] = field(default_factory=dict)  # coroutine id -> work units left
    computed_by_id: dict[int, int] = field(default_factory=dict)  # id -> KV tokens a move would carry
    expert_hit_rate: float = 1.0  # routed experts found in device memory (1.0: all resident)


class CoroutineOutput(Protocol):
    """A finished coroutine's result (RequestOutput, ImageOutput)."""

    index: int
    error: str | None

    @property
    def num_generated_tokens(self) -> int: ...


class CoroutineEngine(Protocol):
    """One model on one device running many coroutines; one thread owns it (cluster/runner.py)."""

    def add_request(self, request: Any, params: Any = None, index: int = 0) -> int:
        """Queue one request -> its coroutine id; a bad one finishes with its error."""
        ...

    def has_unfinished(self) -> bool: ...

    def run_step(self) -> list[int]:
        """Advance every scheduled coroutine to its next yield point -> ids that finished."""
        ...

    def is_finished(self, cid: int) -> bool: ...

    def pop_output(self, cid: int) -> CoroutineOutput:
        """Hand back a finished coroutine's output and forget it."""
        ...

    def error_output(self, index: int, message: str) -> CoroutineOutput:
        """The output of a request that could not even be queued."""
        ...

    def progress(self, cid: int) -> int:
        """How far a coroutine got (output tokens, denoising steps): a newer state has more."""
        ...

    def suspend(self, cid: int, with_kv: bool | None = None) -> bytes:
        """Take a coroutine out at its yield point -> state that `resume` continues exactly."""
        ...

    def snapshot(self, cid: int) -> bytes:
        """The coroutine's state as `suspend` would give it (without KV), leaving it here."""
        ...

    def resume(self, state: bytes) -> int: ...

    def work_done(self) -> int:
        """Work units done so far (cheap: read after every step)."""
        ...

    def load_report(self) -> LoadReport: ...

    def close(self) -> None:
        """Release what the engine holds outside Python's memory (threads, open files)."""
        ...
