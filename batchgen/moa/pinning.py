"""Tell the scheduler plugin which workers hold a model's replicas (the placement), so balancing
never starts that model's engine anywhere else. Workers that already run the engine still
balance between them."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Client, Scheduler


def _set(dask_scheduler: Scheduler, key: str, workers: list[str] | None) -> bool:
    from ..cluster.plugin import PLUGIN_NAME

    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    if plugin is None:
        return False
    if workers is None:
        plugin.pinned.pop(key, None)
    else:
        plugin.pinned[key] = frozenset(workers)
    return True


def pin(client: Client, key: str, workers: list[str] | None) -> bool:
    """Pin engine `key` (an EngineSpec key) to `workers`; None unpins. -> False without a plugin."""
    return bool(client.run_on_scheduler(_set, key=key, workers=workers))


def pinned(client: Client) -> dict[str, list[str]]:
    def get(dask_scheduler: Scheduler) -> dict[str, list[str]]:
        from ..cluster.plugin import PLUGIN_NAME

        plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
        return {k: sorted(v) for k, v in getattr(plugin, "pinned", {}).items()}

    return client.run_on_scheduler(get)
