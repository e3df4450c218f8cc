"""Whose fault a failed row is: the request's own (HTTP 400, ``invalid_request_error``, final) or
the engine's or cluster's (HTTP 500, ``server_error``, retryable with ``--resume --retry-errors``).

The engine reports a row's failure as text only, so a server fault is recognised by the shapes
its messages take: an expert that cannot be read, a state that cannot resume on this worker, an
unexpected exception while adding the row (``TypeName: ...``), or a backend that stopped (a lost
cluster, an engine crash) with the row in flight.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from batchgen.errors import BatchgenError
from batchgen.io.request import RowError

SERVER_CODE = "server_error"  # the RowError code of every server fault
_SERVER_MESSAGES = (
    re.compile(r"^model weights unreadable:"),
    re.compile(r"^cannot resume here:"),
    re.compile(r"^[A-Z][A-Za-z]*(Error|Exception|Interrupt|Killed|Timeout)\b.*:"),  # an exception's repr
)


@dataclass(frozen=True, slots=True)
class Fault:
    status: int
    type: str
    retryable: bool


REQUEST_FAULT = Fault(400, "invalid_request_error", False)
SERVER_FAULT = Fault(500, "server_error", True)


def is_server_message(message: str) -> bool:
    return any(p.match(message) for p in _SERVER_MESSAGES)


def engine_error(message: str | None) -> RowError:
    """The RowError of an engine's failed output."""
    text = message or "generation failed"
    return RowError(SERVER_CODE if is_server_message(text) else "invalid_request", text)


def backend_error(exc: BaseException) -> RowError:
    """The RowError of a row in flight when its backend raised."""
    return RowError(SERVER_CODE, f"the engine or cluster failed while this row ran ({type(exc).__name__}: {exc})")


def fault_of(code: str | None) -> Fault:
    return SERVER_FAULT if code == SERVER_CODE else REQUEST_FAULT


class JobAborted(BatchgenError):
    """The backend stopped mid-job (a lost cluster, an engine crash): the rows in flight were
    written as retryable server errors, the rest stay unwritten; ``--resume --retry-errors``
    finishes the job."""
