"""What the job runner writes finished rows to: a resumable output."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from batchgen.io.request import Request, RowKey


class Sink(Protocol):
    """A resumable output (``JsonlSink``, ``ParquetSink``, an image job's sinks)."""

    flush_rows: int
    done: set[RowKey]  # keys already in the output when it was opened

    @property
    def pending(self) -> int: ...
    def add_result(self, req: Request, out: Any) -> None: ...  # a backend's output
    def add_error(self, req: Request) -> None: ...
    def flush(self) -> None: ...
    def commit(self) -> None: ...
    def close(self) -> None: ...
