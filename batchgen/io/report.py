"""How a file job ends: its exit code and its machine-readable summary.

Exit codes (docs/guides/file-jobs.md):

    0    completed, failed rows within --max-error-rate (default 5%; a job with rows that all
         failed never exits 0, whatever the budget)
    1    aborted: the engine or cluster failed mid-job (rows in flight are retryable errors)
    2    could not start: bad flags, unreadable input, missing model, bucket or credentials
    3    completed, but more rows failed than --max-error-rate allows
    130  interrupted (finished rows are kept: rerun with --resume)

The summary (``--summary-json FILE`` and the last stderr line) has OpenAI's batch
``request_counts`` {total, completed, failed} over the whole output, this run's own counts,
token usage and timing.
"""
from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from batchgen.errors import BatchgenError

if TYPE_CHECKING:
    from batchgen.io.job import JobSummary

EXIT_OK = 0
EXIT_ABORTED = 1
EXIT_CANNOT_START = 2
EXIT_TOO_MANY_ERRORS = 3
EXIT_INTERRUPTED = 130
DEFAULT_MAX_ERROR_RATE = 0.05


def check_rate(rate: float) -> float:
    if not 0 <= rate <= 1:
        raise BatchgenError(f"--max-error-rate must be in [0, 1], got {rate}")
    return rate


def exit_code(summary: JobSummary, max_error_rate: float = DEFAULT_MAX_ERROR_RATE) -> int:
    counts = summary.request_counts()
    total, failed = counts["total"], counts["failed"]
    if total and failed == total:
        return EXIT_TOO_MANY_ERRORS
    return EXIT_TOO_MANY_ERRORS if failed > max_error_rate * total else EXIT_OK


STATUS = {EXIT_OK: "completed", EXIT_TOO_MANY_ERRORS: "completed_with_too_many_errors",
          EXIT_ABORTED: "aborted", EXIT_INTERRUPTED: "interrupted"}


def summary_record(summary: JobSummary | None, code: int, *, input_url: str, output_url: str,
                   error_file: str | None, max_error_rate: float) -> dict[str, Any]:
    record: dict[str, Any] = {"object": "batchgen.job", "status": STATUS.get(code, "failed"), "exit_code": code,
                              "input_file": input_url, "output_file": output_url, "error_file": error_file,
                              "max_error_rate": max_error_rate, "finished_at": int(time.time())}
    if summary is not None:
        record.update({
            "request_counts": summary.request_counts(),
            "this_run": {"completed": summary.succeeded, "failed": summary.errors, "retryable": summary.retryable,
                         "resumed": summary.resumed},
            "usage": {"prompt_tokens": summary.prompt_tokens, "cached_tokens": summary.cached_tokens,
                      f"generated_{summary.unit}": summary.generated},
            "timing": {"wall_s": round(summary.wall_s, 3), f"{summary.unit}_per_s": round(summary.per_s, 3)},
        })
    return record


def write_summary(path: str, record: Mapping[str, Any], storage_options: Mapping[str, Any]) -> None:
    from batchgen.io.storage import locate, write_atomic

    loc = locate(path, storage_options, flag="--summary-json")
    write_atomic(loc.fs, loc.path, (json.dumps(record, indent=1) + "\n").encode())
