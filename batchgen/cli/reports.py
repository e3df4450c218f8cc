"""What a command reports: the job summary (last stderr line, --summary-json) and exit code, and
the cluster's charts (--report, `batchgen report`)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING

from batchgen.errors import BatchgenError

if TYPE_CHECKING:
    from distributed import Client

    from batchgen.io.job import JobSummary
    from batchgen.io.spec import JobSpec

log = logging.getLogger("batchgen")


def report_summary(args: argparse.Namespace, summary: JobSummary | None, code: int) -> None:
    """The summary as the last stderr line, and in --summary-json."""
    if getattr(args, "command", None) != "run":
        return
    from batchgen.io.report import summary_record, write_summary
    from batchgen.io.storage import parse_storage_options

    record = summary_record(summary, code, input_url=str(args.input), output_url=str(args.output),
                            error_file=args.error_file, max_error_rate=args.max_error_rate)
    if args.summary_json:
        try:
            write_summary(args.summary_json, record, parse_storage_options(args.storage_option))
        except (OSError, BatchgenError) as exc:
            print(f"batchgen: could not write --summary-json {args.summary_json}: {exc}", file=sys.stderr)
    print(json.dumps(record), file=sys.stderr)


def finish(args: argparse.Namespace, spec: JobSpec, summary: JobSummary, where: str = "") -> int:
    from batchgen.io.report import EXIT_TOO_MANY_ERRORS, exit_code

    code = exit_code(summary, args.max_error_rate)
    log.info("wrote %s: %s%s", spec.output, summary.describe(), where)
    if code == EXIT_TOO_MANY_ERRORS:
        counts = summary.request_counts()
        log.error("%d of %d rows failed, more than --max-error-rate %s allows: exit %d", counts["failed"],
                  counts["total"], args.max_error_rate, code)
    report_summary(args, summary, code)
    return code


def check_report(args: argparse.Namespace) -> None:
    """--report's needs, before any work: a cluster (the charts are its plugin's) and bokeh."""
    if not getattr(args, "report", None):
        return
    if not (args.scheduler or args.workers):
        raise BatchgenError("--report needs --workers or --scheduler: the charts come from the cluster's "
                            "batchgen plugin")
    import importlib.util

    if importlib.util.find_spec("bokeh") is None:
        raise BatchgenError("--report needs bokeh: pip install 'batchgen[dashboard]'")


def write_report(path: str, client: Client) -> None:
    """The job's charts, once it has finished and before its cluster goes; a failure here is
    reported and leaves the job's own outcome as it is."""
    from batchgen.cluster.html_report import report

    try:
        log.info("wrote the job's charts to %s", report(path, client))
    except Exception as exc:  # noqa: BLE001 - the output is complete either way
        log.error("could not write --report %s (%s: %s); the results are complete", path, type(exc).__name__, exc)


def report_command(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("bokeh") is None:
        raise BatchgenError("batchgen report needs bokeh: pip install 'batchgen[dashboard]'")
    from distributed import Client

    from batchgen.cluster.client import is_installed
    from batchgen.cluster.html_report import report

    try:
        client = Client(args.scheduler, timeout="10s")
    except OSError as exc:
        raise BatchgenError(f"cannot reach the scheduler at {args.scheduler}: {exc}") from None
    try:
        if not is_installed(client):
            raise BatchgenError(f"the cluster at {args.scheduler} runs no batchgen plugin: nothing to report")
        log.info("wrote %s", report(args.output, client))
    finally:
        client.close()
    return 0
