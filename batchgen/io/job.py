"""The job runner: stream requests through a backend in chunks, write each row as it finishes.

Memory stays bounded whatever the input's length: the reader parses lazily, the backend pulls
valid rows as it has room (at most ``chunk_size`` in flight, topped up as rows finish, so the
batch never drains between chunks), and finished rows are written (and made durable by the
sink's ``flush``) at least every ``flush_rows`` rows or ``flush_seconds``.
Invalid rows are written as errors without reaching the backend. The runner knows rows, sinks
and backends only: what a kind of job sends its backend is its ``Work`` (io/backend.py).
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from batchgen.errors import BatchgenError
from batchgen.io.backend import TEXT, Backend, EngineBackend, Work
from batchgen.io.faults import SERVER_CODE, JobAborted, backend_error, engine_error
from batchgen.io.request import Request, RowError, RowKey
from batchgen.io.rows import RowContext
from batchgen.io.sink import Sink
from batchgen.progress import Mode, Progress

if TYPE_CHECKING:
    from batchgen.engine import Engine
    from batchgen.io.spec import JobSpec
    from batchgen.models.info import ModelInfo


class Reader(Protocol):
    """An input file's rows (``OpenAIBatchReader``, ``ParquetReader``, an image job's reader)."""

    def count(self) -> int: ...
    def requests(self, skip: set[RowKey]) -> Iterator[Request]: ...


@dataclass(slots=True)
class JobSummary:
    resumed: int = 0  # rows already in the output before this run
    resumed_failed: int = 0  # of them: rows that ended in an error
    succeeded: int = 0
    errors: int = 0
    retryable: int = 0  # of this run's errors: server faults (``--resume --retry-errors``)
    generated: int = 0  # in ``unit``
    prompt_tokens: int = 0
    cached_tokens: int = 0
    wall_s: float = 0.0
    unit: str = "tokens"

    @property
    def rows(self) -> int:
        return self.succeeded + self.errors

    @property
    def per_s(self) -> float:
        return self.generated / self.wall_s if self.wall_s > 0 else 0.0

    def request_counts(self) -> dict[str, int]:
        """OpenAI's batch ``request_counts`` over the whole output, earlier runs' rows included."""
        total = self.resumed + self.rows
        failed = self.resumed_failed + self.errors
        return {"total": total, "completed": total - failed, "failed": failed}

    def describe(self) -> str:
        text = (f"{self.rows} rows: {self.succeeded} succeeded, {self.errors} errors"
                + (f" ({self.resumed} already done before this run)" if self.resumed else "")
                + f"; {self.generated} {self.unit} generated in {self.wall_s:.1f} s "
                f"({self.per_s:,.1f} {'tok' if self.unit == 'tokens' else self.unit}/s)")
        if self.errors:
            text += "\nsome rows failed: their error records say why (line/row, field, value)"
        if self.retryable:
            text += f"; {self.retryable} failed on the engine or cluster: --resume --retry-errors runs them again"
        return text


def run_file_job(spec: JobSpec, engine: Engine | ModelInfo, *, chunk_size: int = 1024,
                 progress: Mode = "auto", backend: Backend | None = None) -> JobSummary:
    """Run ``spec``'s text input file on ``engine`` (or ``backend``, which then does the work
    while ``engine`` -- an Engine or just a ModelInfo -- provides the tokenizer and limits).
    Call ``spec.check()`` first."""
    ctx = RowContext(engine.tokenizer, engine.vocab_size, engine.max_model_len, spec.defaults)
    reader, sink = spec.open(ctx, model=engine.model_dir.name)
    if backend is None:
        if not hasattr(engine, "run_requests"):
            raise TypeError("run_file_job needs an Engine, or a backend to run on")
        backend = EngineBackend(engine)  # type: ignore[arg-type]
    return run_reader(reader, sink, backend, chunk_size=chunk_size, progress=progress)


def run_reader(reader: Reader, sink: Sink, backend: Backend, *, work: Work = TEXT,
               chunk_size: int = 1024, progress: Mode = "auto") -> JobSummary:
    """Run the rows of ``reader`` not yet in ``sink``, with a progress display; the backend's
    ``progress_status()``, if it has one, adds its own figures to it."""
    status = getattr(backend, "progress_status", None)
    with Progress(reader.count(), initial=len(sink.done), mode=progress, status=status) as bar:
        return run_job(reader.requests(sink.done), sink, backend, work=work,
                       chunk_size=chunk_size, progress=bar)


def run_job(requests: Iterable[Request], sink: Sink, backend: Backend, *, work: Work = TEXT,
            chunk_size: int = 1024, flush_seconds: float = 2.0,
            progress: Progress | None = None) -> JobSummary:
    """Run every request, write every result or error to ``sink``, then commit it.

    On an exception (KeyboardInterrupt included) the rows finished so far are flushed and the
    sink stays resumable.
    """
    summary = JobSummary(resumed=len(sink.done), resumed_failed=getattr(sink, "done_failed", 0), unit=work.unit)
    start = last_flush = time.monotonic()
    counts_tokens = work.unit == "tokens"  # the progress line's rate is tok/s

    def wrote(amount: int = 0) -> None:
        nonlocal last_flush
        if progress is not None:
            progress.update(1, amount if counts_tokens else 0)
        now = time.monotonic()
        if sink.pending >= sink.flush_rows or now - last_flush >= flush_seconds:
            sink.flush()
            last_flush = now

    in_flight: dict[int, Request] = {}  # position in the backend's stream -> its row

    def _written_if_invalid(req: Request) -> bool:
        if req.is_valid:
            return True
        sink.add_error(req)
        summary.errors += 1
        wrote()
        return False

    def valid_items() -> Iterator[Any]:
        """Invalid rows are written here and never reach the backend."""
        for position, req in enumerate(r for r in requests if _written_if_invalid(r)):
            in_flight[position] = req
            yield work.item(req)

    def failed(req: Request, error: RowError) -> None:
        req.fail_with(error)
        sink.add_error(req)
        summary.errors += 1
        summary.retryable += error.code == SERVER_CODE

    try:
        for position, out in backend.run(valid_items(), chunk_size):
            req = in_flight.pop(position)
            amount = 0
            if out.finish_reason == "error":
                failed(req, engine_error(out.error))
            else:
                sink.add_result(req, out)
                summary.succeeded += 1
                amount = work.amount(out)
                summary.generated += amount
                summary.prompt_tokens += getattr(out, "num_prompt_tokens", 0)
                summary.cached_tokens += getattr(out, "num_cached_tokens", 0)
            wrote(amount)
    except (BatchgenError, KeyboardInterrupt, SystemExit):
        sink.close()
        raise
    except Exception as exc:  # the backend failed: its rows in flight are the server's fault
        for req in in_flight.values():
            failed(req, backend_error(exc))
        sink.close()
        aborted = JobAborted(f"the engine or cluster failed mid-job ({type(exc).__name__}: {exc}); "
                             f"{len(in_flight)} rows in flight were written as retryable server errors")
        aborted.summary = summary  # type: ignore[attr-defined]
        raise aborted from exc
    except BaseException:
        sink.close()
        raise
    finally:
        summary.wall_s = time.monotonic() - start
    sink.commit()
    return summary
