"""Engines load while the job is still being built: `prestart(spec)` from `generate`'s meta call
asks every eligible worker to start the job's engine now (docs/concepts/dask-plugin.md#engines-start-before-the-job).
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
