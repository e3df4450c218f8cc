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
    """The Dask task group of the task running on this thread (the scheduler's TaskGroup name:
    a job's partitions share it), or None outside a task. Read from the thread's own task key:
    never a lookup that can fail or wait."""
    try:
        from distributed.utils import key_split_group
        from distributed.worker import thread_state
    except ImportError:
        return None
    key = getattr(thread_state, "key", None)
    if key is None:
        return None
    try:
        return key_split_group(key)
    except Exception:  # noqa: BLE001 - a key of a shape this does not know: no group, no count
        return None


def in_task() -> bool:
    from distributed.worker import thread_state

    return getattr(thread_state, "key", None) is not None
