"""The Dask cluster a command runs on: --scheduler's (left as it was found) or a local one of
--workers processes (closed after), with batchgen installed."""
from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .reports import write_report

if TYPE_CHECKING:
    from distributed import Client


@contextlib.contextmanager
def cluster_session(args: argparse.Namespace, engine_key: str) -> Iterator[Client]:
    """A client of --scheduler's cluster, or of a local one of --workers workers (closed after),
    with batchgen installed; a user's cluster is left as it was found."""
    from distributed import Client

    from batchgen.cluster.client import install, local_cluster

    cluster = None if args.scheduler else local_cluster(args.workers)
    try:
        client = Client(args.scheduler) if args.scheduler else Client(cluster)
        try:
            ours = install(client)  # False: the cluster already runs batchgen for someone else too
            try:
                yield client
                if getattr(args, "report", None):
                    write_report(args.report, client)
            finally:
                if args.scheduler:
                    _leave_as_found(client, ours, engine_key)
        finally:
            client.close()
    finally:
        if cluster is not None:
            cluster.close()


def _leave_as_found(client: Client, ours: bool, engine_key: str) -> None:
    """Undo what this run added to a user's cluster: the plugin if it installed it (which stops
    its engines too), else the idle engines of this run's model. A failure here is reported,
    never allowed to hide the job's own outcome (the output file is complete either way)."""
    from batchgen.cluster.client import disconnect, release

    try:
        if ours:
            disconnect(client)
        else:
            release(client, engine_key)
    except Exception as exc:  # noqa: BLE001
        print(f"batchgen: could not clean up the cluster ({type(exc).__name__}: {exc}); "
              "the results are complete", file=sys.stderr)
