"""Cutting a job's fixed costs: engines load while the job is still being built and scheduled.

Without this, every worker pays its engine start (torch import, weights, tokenizer, the first
forward's one-time allocations) after its first task arrives, inside the job. Two things start it
earlier:

- `warm_imports`, when the worker plugin is installed (`connect`): torch and the engine modules
  are imported on a background thread, once per worker process.
- `prestart(spec)`, from `batchgen.generate`'s meta call: Dask calls the partition function on an
  empty frame while `map_partitions` builds the graph, on the client, before `compute()`. That
  call knows the model and engine options, so it asks every worker (fire and forget,
  `Client.run(wait=False)`) to start that engine now; by the time tasks land it is loading or
  loaded. Without a connected batchgen cluster it does nothing; a worker that already has the
  engine ignores it. The engine is the one the tasks would have started (same EngineSpec).
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from .spec import EngineSpec

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger(__name__)


def prestart(spec: EngineSpec) -> bool:
    """Ask every worker of the default client's cluster to start `spec`'s engine; -> whether asked."""
    try:
        from distributed import default_client

        client = default_client()
    except (ImportError, ValueError):  # no distributed, or no client: a plain pandas call
        return False
    try:
        client.run(start_engine, spec.to_msg(), wait=False)
    except Exception as exc:  # noqa: BLE001 - an optimisation: the tasks start the engine anyway
        logger.debug("batchgen prestart failed: %s", exc)
        return False
    return True


async def start_engine(spec: dict[str, Any], dask_worker: Worker) -> bool:
    """`Client.run` target (a coroutine: `run(wait=False)` needs one): start this worker's engine
    for `spec` unless running; -> whether this worker runs batchgen (its side is installed).
    Returns at once: the engine loads on its own thread."""
    from .worker import EXTENSION

    side = dask_worker.extensions.get(EXTENSION)
    if side is None:
        return False
    side.host.prestart(EngineSpec.from_msg(spec))
    return True


_warmed = threading.Event()


def warm_imports() -> None:
    """Import torch and the engine on a daemon thread, once per process."""
    if _warmed.is_set():
        return
    _warmed.set()

    def go() -> None:
        try:
            import batchgen.engine  # noqa: F401 - torch, the models and the runtime
        except Exception as exc:  # noqa: BLE001 - the first task reports a real import error
            logger.debug("batchgen import warm-up failed: %s", exc)

    threading.Thread(target=go, name="batchgen-warm-imports", daemon=True).start()
