"""``batchgen run`` (a file job), ``batchgen demo`` (the same on a bundled file and model) and
``batchgen report``; ``batchgen plan`` and ``batchgen bench`` come from batchgen/sim/cli.py,
``batchgen moa`` from batchgen/moa/cli.py.

Exit codes (batchgen/io/report.py, docs/guides/file-jobs.md): 0 when the job completed with
failed rows within ``--max-error-rate``; 3 when more rows failed (a job whose rows all failed
never exits 0); 1 when the engine or cluster failed mid-job; 2 when it could not start (bad
flags, unreadable input, missing model, bucket, credentials or filesystem extra, an output that
exists without --resume/--overwrite, a resume of another job); 130 when interrupted (what
finished is kept: rerun with --resume).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

from batchgen.errors import BatchgenError

from .logs import setup_logging
from .parser import build_parser
from .reports import report_command, report_summary
from .run import demo_command, run_command

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    from batchgen.io.faults import JobAborted
    from batchgen.io.report import EXIT_ABORTED, EXIT_CANNOT_START, EXIT_INTERRUPTED

    args = build_parser().parse_args(argv)
    setup_logging(args)
    try:
        if args.command == "demo":
            return demo_command(args)
        if args.command in ("plan", "bench", "moa"):
            return args.handler(args)
        if args.command == "report":
            return report_command(args)
        return run_command(args)
    except JobAborted as exc:
        print(f"batchgen: error: {exc}; rerun with --resume --retry-errors to finish", file=sys.stderr)
        report_summary(args, getattr(exc, "summary", None), EXIT_ABORTED)
        return EXIT_ABORTED
    except BatchgenError as exc:
        print(f"batchgen: error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    except KeyboardInterrupt:
        print("batchgen: interrupted; finished rows are saved: rerun with --resume to finish",
              file=sys.stderr)
        report_summary(args, None, EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
