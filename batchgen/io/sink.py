"""What the job runner writes finished rows to: a resumable output."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from batchgen.io.request import Request, RowKey


class Sink(Protocol):
    """A resumable output (``JsonlSink``, ``ParquetSink``, an image job's sinks)."""

    flush_rows: int
    done: set[RowKey]  # keys already in the output when it was opened
    done_failed: int  # how many of them ended in an error

    @property
    def pending(self) -> int: ...
    def add_result(self, req: Request, out: Any) -> None: ...  # a backend's output
    def add_error(self, req: Request) -> None: ...
    def flush(self) -> None: ...
    def commit(self) -> None: ...
    def close(self) -> None: ...


class SplitSink:
    """Results to one sink, failed rows to another (``--error-file``, as OpenAI's batch API
    writes an output file and an error file); resumes from both."""

    def __init__(self, results: Sink, errors: Sink) -> None:
        self.results, self.errors = results, errors
        self.flush_rows = results.flush_rows
        self.done = results.done | errors.done
        self.done_failed = results.done_failed + errors.done_failed

    @property
    def pending(self) -> int:
        return self.results.pending + self.errors.pending

    def add_result(self, req: Request, out: Any) -> None:
        self.results.add_result(req, out)

    def add_error(self, req: Request) -> None:
        self.errors.add_error(req)

    def flush(self) -> None:
        self.results.flush()
        self.errors.flush()

    def commit(self) -> None:
        self.results.commit()
        self.errors.commit()

    def close(self) -> None:
        self.results.close()
        self.errors.close()
