"""Where this code runs in Dask: the worker, whether in a task, and the task's group. No batchgen
imports, so any cluster module may ask (host.py counts a job's rows by its task group)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Worker


def current_worker() -> Worker | None:
    """The Dask worker this code runs on, or None (no distributed, or not on a worker)."""
    try:
        from distributed import get_worker
    except ImportError:
        return None
    try:
        return get_worker()
    except ValueError:
        return None


def current_task_group() -> str | None:
    """The Dask task group of the task this code runs in (the scheduler's TaskGroup name: a
    job's partitions share it), or None outside a task."""
    worker = current_worker()
    if worker is None or not in_task():
        return None
    from distributed.utils import key_split_group

    key = worker.get_current_task()
    return key_split_group(key) if key is not None else None


def in_task() -> bool:
    from distributed.worker import thread_state

    return getattr(thread_state, "key", None) is not None
