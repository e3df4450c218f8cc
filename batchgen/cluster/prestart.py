"""Cutting a job's fixed costs: engines load while the job is still being built and scheduled.

Without this, every worker pays its engine start (torch import, weights, tokenizer, the first
forward's one-time allocations) after its first task arrives, inside the job. Two things start it
earlier:

- `worker.warm_imports`, when the worker plugin is installed (`connect`): torch and the engine
  modules are imported on a background thread, once per worker process.
- `prestart(spec)`, from `batchgen.generate`'s meta call: Dask calls the partition function on an
  empty frame while `map_partitions` builds the graph, on the client, before `compute()`. That
  call knows the model and engine options, so it asks every worker (fire and forget,
  `Client.run(wait=False)`) to start that engine now; by the time tasks land it is loading or
  loaded. Without a connected batchgen cluster it does nothing; a worker that already has the
  engine ignores it, and so does one that may not hold engines (eligibility.py). The engine is
  the one the tasks would have started (same EngineSpec).
"""
from __future__ import annotations

import logging

from .spec import EngineSpec

logger = logging.getLogger(__name__)


def prestart(spec: EngineSpec) -> bool:
    """Ask every worker of the default client's cluster to start `spec`'s engine; -> whether asked."""
    try:
        from distributed import default_client

        from .worker import start_engine

        client = default_client()
    except (ImportError, ValueError):  # no distributed, or no client: a plain pandas call
        return False
    try:
        client.run(start_engine, spec.to_msg(), wait=False)
    except Exception as exc:  # noqa: BLE001 - an optimisation: the tasks start the engine anyway
        logger.debug("batchgen prestart failed: %s", exc)
        return False
    return True
