"""batchgen on Dask: a whole cluster as one batch engine.

    client = batchgen.cluster.connect()          # or connect("tcp://...") / connect(client=c)
    out = ddf.map_partitions(batchgen.generate, model=path, max_tokens=64)
    batchgen.cluster.metrics(client)              # per-worker load while it runs

The modules and their roles: docs/concepts/architecture.md#code-layout. `generate` is bound
eagerly (its module shares its name and imports nothing heavy); the other names load on first
use, so `import batchgen` does not import distributed.
"""
from __future__ import annotations

import importlib
from typing import Any

from .generate import generate as generate

_EXPORTS = {
    "connect": "client", "disconnect": "client", "install": "client", "is_installed": "client",
    "local_cluster": "client", "release": "client", "engine_workers": "client",
    "generate_dataframe": "dataframe",
    "metrics": "monitor", "progress": "monitor",
    "BalanceConfig": "..policy.balance", "Migration": "..policy.balance", "EngineLoad": "..policy.balance",
    "plan_migrations": "..policy.balance",
    "BalancePlugin": "plugin", "BatchgenWorkerPlugin": "worker",
    "report": "html_report", "record": "html_report",  # need bokeh
}

__all__ = sorted([*_EXPORTS, "generate"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'batchgen.cluster' has no attribute {name!r}")
    return getattr(importlib.import_module(module if module.startswith(".") else f".{module}", __name__), name)
