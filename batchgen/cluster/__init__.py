"""batchgen on Dask: a whole cluster as one batch engine.

    client = batchgen.cluster.connect()          # or connect("tcp://...") / connect(client=c)
    out = ddf.map_partitions(batchgen.generate, model=path, max_tokens=64)
    batchgen.cluster.metrics(client)              # per-worker load while it runs

Modules: generate (the partition function), frame (pandas in/out, meta calls), spec (engine
key), runner (an engine and its loop thread), engines (a host's runners), job (rows a task waits
for), host (jobs, migration), worker (worker extension, RPC handlers, load push), plugin (scheduler plugin),
client (connect / disconnect / release), dataframe, monitor (metrics, progress), output_columns
(the columns generate adds), devices (which GPU each local worker sees), eligibility and
delegate (which workers may hold engines; rows of the others handed to them), dashboard (the
dashboard's batchgen page), html_report (that page as one HTML file).
`generate` is bound eagerly (its module shares its name, and it imports nothing heavy); the
other names load on first use, so `import batchgen` does not import distributed.
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
