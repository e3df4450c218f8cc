"""Getting a cluster that runs batchgen: connect to one, or start one sized to this machine.

    client = batchgen.cluster.connect()                       # LocalCluster sized to the machine
    client = batchgen.cluster.connect("tcp://scheduler:8786")  # any Dask cluster
    client = batchgen.cluster.connect(client=existing_client)

Each registers the BalancePlugin (which installs the worker side on every worker) unless the
cluster already has it; `disconnect` removes it and every handler it installed; `release` stops
idle engines and keeps the plugin.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..policy.balance import BalanceConfig
from .plugin import PLUGIN_NAME, BalancePlugin

if TYPE_CHECKING:
    from distributed import Client, SpecCluster


def connect(scheduler_address: str | None = None, client: Client | None = None, n_workers: int | None = None,
            *, balance: BalanceConfig | None = None, push_interval: float | None = None,
            **cluster_options: Any) -> Client:
    """A Client whose cluster runs batchgen (plugin registered).

    With neither `scheduler_address` nor `client`, starts a local cluster: one worker per GPU
    (each sees only its own), or on CPU `n_workers` (default one per 8 cores) workers sharing
    the cores. `cluster_options` go to LocalCluster / SpecCluster. `balance` configures
    splitting and migration (BalanceConfig(split=False, migrate=False) turns both off).
    `push_interval`: seconds between load reports (default: dask config
    `batchgen.cluster.push-interval`, else 0.2).
    """
    from distributed import Client

    if client is None:
        if scheduler_address is not None:
            client = Client(scheduler_address)
        else:
            client = Client(local_cluster(n_workers, **cluster_options))
    install(client, balance, push_interval)
    return client


def install(client: Client, balance: BalanceConfig | None = None, push_interval: float | None = None) -> bool:
    """Register the batchgen plugin on `client`'s cluster; -> True when this call registered it.

    A plugin already there is kept as it is unless `balance` or `push_interval` is given (then it
    is re-registered with those settings): other clients of a shared cluster may be running jobs
    on it, and re-registering restarts every worker's engines.
    """
    import dask.config
    from dask.utils import parse_timedelta

    if is_installed(client):
        if balance is None and push_interval is None:
            return False
        disconnect(client)
    if push_interval is None:
        push_interval = parse_timedelta(dask.config.get("batchgen.cluster.push-interval", default="200ms"))
    client.register_plugin(BalancePlugin(balance, push_interval=push_interval), name=PLUGIN_NAME)
    return True


def is_installed(client: Client) -> bool:
    return bool(client.run_on_scheduler(_has_plugin))


def disconnect(client: Client) -> None:
    """Remove the plugin, its scheduler handlers, the worker plugin and the workers' handlers
    and engines. The cluster and client stay up."""
    client.run_on_scheduler(_remove_plugin)


def release(client: Client, model: str | None = None) -> int:
    """Stop the engines that hold no work on every worker (only those of `model`, an EngineSpec
    key, when given), freeing their GPU/host memory; -> how many stopped. The plugin stays; the
    next task that needs an engine starts it again."""
    from .worker import release_engines

    return sum(client.run(release_engines, model=model).values())


def local_cluster(n_workers: int | None = None, **options: Any) -> SpecCluster:
    """A LocalCluster (CPU) or SpecCluster (one Nanny per GPU) with 1 task thread per worker.

    Tasks secede while they wait for their rows, so one thread slot carries any number of
    partitions; the compute threads are torch's (OMP_NUM_THREADS = cores / workers on CPU).
    """
    from distributed import LocalCluster, Scheduler, SpecCluster

    gpus = _gpu_count()
    cores = os.cpu_count() or 1
    if gpus:
        n = n_workers or gpus
        spec = gpu_worker_spec(n, gpus, max(1, cores // n))
        return SpecCluster(workers=spec, scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
                           **options)
    n = n_workers or max(1, min(8, cores // 8))
    options.setdefault("dashboard_address", ":0")
    options.setdefault("threads_per_worker", 1)
    options.setdefault("processes", True)
    env = {"OMP_NUM_THREADS": str(max(1, cores // n))} | dict(options.pop("env", {}))
    return LocalCluster(n_workers=n, env=env, **options)


def gpu_worker_spec(n_workers: int, gpus: int, cpu_threads: int) -> dict[str, dict[str, Any]]:
    """SpecCluster worker spec: worker i sees GPU i % gpus as its only device."""
    from distributed import Nanny

    return {f"gpu-{i}": {"cls": Nanny, "options": {
        "nthreads": 1, "env": {"CUDA_VISIBLE_DEVICES": str(i % gpus), "OMP_NUM_THREADS": str(cpu_threads)}}}
        for i in range(n_workers)}


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _has_plugin(dask_scheduler: Any) -> bool:
    return PLUGIN_NAME in dask_scheduler.plugins


async def _remove_plugin(dask_scheduler: Any) -> bool:
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    if plugin is None:
        return False
    await plugin.close()
    dask_scheduler.remove_plugin(PLUGIN_NAME)
    return True
