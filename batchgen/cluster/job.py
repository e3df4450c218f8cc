"""PartitionJob: the rows one task waits for, wherever their coroutines run.

The task that owns a partition owns its rows. A row's coroutine runs in this worker's engine
or, after a migration, on another worker (the holder). For a moved row the job keeps the
suspended state bytes until its result arrives, so that the row can be resumed here if the
holder disappears. The holder refreshes that state now and then with a KV-less snapshot of
its progress (`progress`), so a recovered row resumes from its last known tokens, not from
where it left. The first result for a row wins: a row resumed here after a false alarm and
also finished by its holder is not duplicated.
"""
from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

from ..outputs import RequestOutput
from .spec import EngineSpec


@dataclass(slots=True)
class RemoteRow:
    holder: str  # worker address running the coroutine
    state: bytes  # suspended coroutine: as it left this worker, or the holder's latest snapshot
    num_output: int = 0  # output tokens in `state`


class PartitionJob:
    def __init__(self, spec: EngineSpec, num_rows: int, job_id: str | None = None) -> None:
        self.spec = spec
        self.job_id = job_id or uuid.uuid4().hex
        self.outputs: list[RequestOutput | None] = [None] * num_rows
        self._remote: dict[int, RemoteRow] = {}
        self._pending = num_rows
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.failure: BaseException | None = None
        self.generated_tokens = 0
        self.group: str | None = None  # the Dask task group of the task waiting for it (host.py: rows per job)
        if num_rows == 0:
            self._done.set()

    @property
    def is_done(self) -> bool:
        return self._done.is_set()

    @property
    def rows_done(self) -> int:
        return len(self.outputs) - self._pending

    def deliver(self, row: int, output: RequestOutput) -> bool:
        """Record a row's output; False when the row already had one (a duplicate)."""
        with self._lock:
            if self.outputs[row] is not None or self._done.is_set():
                return False
            self.outputs[row] = output
            self._remote.pop(row, None)
            self.generated_tokens += output.num_generated_tokens
            self._pending -= 1
            if self._pending == 0:
                self._done.set()
            return True

    def moved(self, row: int, holder: str, state: bytes, num_output: int = 0) -> bool:
        """Record that `row` now runs on `holder`; False (nothing recorded) when the row already
        has its output or the job ended: then the state must not be sent anywhere."""
        with self._lock:
            if self.outputs[row] is not None or self._done.is_set():
                return False
            self._remote[row] = RemoteRow(holder, state, num_output)
            return True

    def progress(self, row: int, holder: str, num_output: int, state: bytes) -> bool:
        """A newer state of a moved row from its holder; kept when it has more output tokens."""
        with self._lock:
            remote = self._remote.get(row)
            if remote is None or remote.holder != holder or num_output <= remote.num_output:
                return False
            remote.state, remote.num_output = state, num_output
            return True

    def holders(self) -> dict[int, str]:
        """Moved rows without a result -> the worker holding them."""
        with self._lock:
            return {row: r.holder for row, r in self._remote.items()}

    def kept(self) -> dict[int, int]:
        """Moved rows -> output tokens of the state kept for them."""
        with self._lock:
            return {row: r.num_output for row, r in self._remote.items()}

    def take_back(self, rows: list[int] | None = None, *, lost: set[str] | None = None,
                  live: set[str] | None = None) -> list[tuple[int, bytes]]:
        """Rows to resume here: the given ones, or those whose holder is in `lost` / not in `live`."""
        with self._lock:
            back: list[tuple[int, bytes]] = []
            for row, remote in list(self._remote.items()):
                gone = (rows is not None and row in rows) or (lost is not None and remote.holder in lost) \
                    or (live is not None and remote.holder not in live)
                if gone:
                    back.append((row, remote.state))
                    del self._remote[row]
            return back

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if not self._done.is_set():
                self.failure = exc
                self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def result(self) -> list[RequestOutput]:
        if self.failure is not None:
            raise self.failure
        assert all(o is not None for o in self.outputs)
        return self.outputs  # type: ignore[return-value]
