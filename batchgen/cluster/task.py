"""How a partition task reaches its host's engines and waits for its rows.

Inside a Dask task the rows join this worker's host (shared by every partition there) and the
task secedes from the worker's thread pool while it waits, so many partitions are in flight per
worker. Outside Dask the rows join a process-wide host. distributed is imported on first call
only: `import batchgen` stays light.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .dask_task import current_worker, in_task

if TYPE_CHECKING:
    from .host import Host
    from .job import PartitionJob


def this_host() -> Host:
    """The host whose engines this call's rows join: the worker's, else the process's own."""
    from .worker import ensure_side, local_host

    worker = current_worker()
    return ensure_side(worker).host if worker is not None else local_host()


def wait_for(jobs: Iterable[PartitionJob]) -> None:
    """Block until every job is done; inside a task the thread slot is freed meanwhile, so the
    next partition can start and join the engine."""
    if current_worker() is None or not in_task():
        for job in jobs:
            job.wait()
        return
    from distributed import rejoin, secede

    secede()
    try:
        for job in jobs:
            job.wait()
    finally:
        rejoin()
