"""Getting a cluster that runs batchgen: connect to one, or start one sized to this machine.

    client = batchgen.cluster.connect()                       # LocalCluster sized to the machine
    client = batchgen.cluster.connect("tcp://scheduler:8786")  # any Dask cluster
    client = batchgen.cluster.connect(client=existing_client)
    client = batchgen.cluster.connect(address, worker_resource="GPU")  # engines on GPU workers only

Each registers the BalancePlugin (which installs the worker side on every worker) unless the
cluster already has it; `disconnect` removes it and every handler it installed; `release` stops
idle engines and keeps the plugin. On a GPU machine `local_cluster` gives worker i the i-th
device this process was given (devices.py), through dask-cuda's LocalCUDACluster when it is
installed. Deploying on real clusters: docs/guides/gpu-clusters.md.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..policy.balance import BalanceConfig
from .devices import assign_devices, gpu_count, has_dask_cuda, visible_devices
from .eligibility import RESOURCE_KEY, EngineWorkers
from .plugin import PLUGIN_NAME, BalancePlugin

if TYPE_CHECKING:
    from distributed import Client, SpecCluster

# Dask's own default: when the port is taken, Dask serves the dashboard on a free one instead
DASHBOARD_ADDRESS = ":8787"
GPU_RESOURCE = "GPU"  # the resource local GPU workers carry unless dask config names another


def connect(scheduler_address: str | None = None, client: Client | None = None, n_workers: int | None = None,
            *, balance: BalanceConfig | None = None, push_interval: float | None = None,
            worker_resource: str | None = None, engine_workers: Iterable[str] | None = None,
            **cluster_options: Any) -> Client:
    """A Client whose cluster runs batchgen (plugin registered).

    With neither `scheduler_address` nor `client`, starts a local cluster (`local_cluster`): one
    worker per GPU this process was given (each sees only its own), or on CPU `n_workers`
    (default one per 8 cores) workers sharing the cores. `cluster_options` go to
    `local_cluster`. `balance` configures splitting and migration
    (BalanceConfig(split=False, migrate=False) turns both off). `push_interval`: seconds
    between load reports (default: dask config `batchgen.cluster.push-interval`, else 0.2).
    worker_resource / engine_workers: engines start only on workers with this Dask resource, or
    with these addresses or names (defaults: dask config `batchgen.worker-resource` and
    `batchgen.engine-workers`; unset: any worker). Prints the dashboard's link.
    """
    from distributed import Client

    if client is None:
        if scheduler_address is not None:
            client = Client(scheduler_address)
        else:
            client = Client(local_cluster(n_workers, **cluster_options))
    install(client, balance, push_interval, worker_resource=worker_resource, engine_workers=engine_workers)
    if scheduler_address is not None:
        _print_dashboard(client)
    return client


def install(client: Client, balance: BalanceConfig | None = None, push_interval: float | None = None, *,
            worker_resource: str | None = None, engine_workers: Iterable[str] | None = None) -> bool:
    """Register the batchgen plugin on `client`'s cluster; -> True when this call registered it.

    A plugin already there is kept as it is unless `balance`, `push_interval`,
    `worker_resource` or `engine_workers` is given (then it is re-registered with those
    settings): other clients of a shared cluster may be running jobs on it, and re-registering
    restarts every worker's engines.
    """
    import dask.config
    from dask.utils import parse_timedelta

    given = worker_resource is not None or engine_workers is not None
    if is_installed(client):
        if balance is None and push_interval is None and not given:
            return False
        disconnect(client)
    if push_interval is None:
        push_interval = parse_timedelta(dask.config.get("batchgen.cluster.push-interval", default="200ms"))
    rule = EngineWorkers.make(worker_resource, engine_workers)
    client.register_plugin(BalancePlugin(balance, push_interval=push_interval, engine_workers=rule),
                           name=PLUGIN_NAME)
    return True


def is_installed(client: Client) -> bool:
    return bool(client.run_on_scheduler(_has_plugin))


def engine_workers(client: Client) -> list[str] | None:
    """The live workers that may hold engines, by the installed plugin's rule; None: no plugin,
    or no rule (any worker may)."""
    return client.run_on_scheduler(_engine_workers)


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


def local_cluster(n_workers: int | None = None, *, engines_per_device: int = 1, dask_cuda: bool | None = None,
                  **options: Any) -> SpecCluster:
    """A cluster on this machine with 1 task thread per worker; prints the dashboard's link.

    GPU: one worker per device this process was given (CUDA_VISIBLE_DEVICES: indices, UUIDs or
    MIG ids; worker i gets entry i), each carrying the Dask resource `GPU` (or dask config
    `batchgen.worker-resource`). More workers than devices only with `engines_per_device` > 1.
    dask_cuda: use dask_cuda.LocalCUDACluster (default: when installed and one engine per
    device); else a SpecCluster of Nannies. CPU: a LocalCluster of `n_workers` (default one per
    8 cores). Tasks secede while they wait for their rows, so one thread slot carries any number
    of partitions; the compute threads are torch's (OMP_NUM_THREADS = cores / workers).
    `options` go to the cluster class; the dashboard stays on Dask's default ":8787".
    """
    from distributed import LocalCluster

    cores = os.cpu_count() or 1
    devices = visible_devices() if gpu_count() else []
    if devices:
        n = n_workers or len(devices)
        if dask_cuda is None:
            dask_cuda = has_dask_cuda() and engines_per_device == 1 and n <= len(devices)
        if dask_cuda:
            cluster = _cuda_cluster(n, devices, max(1, cores // n), options)
        else:
            cluster = _spec_cluster(n, devices, engines_per_device, max(1, cores // n), options)
    else:
        n = n_workers or max(1, min(8, cores // 8))
        options.setdefault("dashboard_address", DASHBOARD_ADDRESS)
        options.setdefault("threads_per_worker", 1)
        options.setdefault("processes", True)
        env = {"OMP_NUM_THREADS": str(max(1, cores // n))} | dict(options.pop("env", {}))
        if options["processes"]:  # threads in this process share its environment: no env to set
            options["env"] = env
        cluster = LocalCluster(n_workers=n, **options)
    _print_dashboard(cluster)
    return cluster


def cuda_cluster_options(n_workers: int, devices: Sequence[str], cpu_threads: int,
                         options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for dask_cuda.LocalCUDACluster: the first `n_workers` of this process's
    devices (dask-cuda gives worker i a list starting with entry i, so each engine's cuda:0 is
    its own device), one task thread, the GPU resource, OMP_NUM_THREADS, Dask's dashboard port.
    `options` (the caller's) win over these."""
    chosen = assign_devices(n_workers, devices)
    out: dict[str, Any] = {
        "CUDA_VISIBLE_DEVICES": ",".join(chosen), "n_workers": n_workers, "threads_per_worker": 1,
        "dashboard_address": DASHBOARD_ADDRESS, "resources": {gpu_resource(): 1},
        "env": {"OMP_NUM_THREADS": str(cpu_threads)},
    }
    options = dict(options or {})
    out["env"] = out["env"] | dict(options.pop("env", {}))
    return out | options


def gpu_worker_spec(n_workers: int, gpus: int | Sequence[str], cpu_threads: int, *,
                    engines_per_device: int | None = None) -> dict[str, dict[str, Any]]:
    """SpecCluster worker spec: worker i sees one device, entry i of `gpus` (the devices this
    process was given, or a count: indices 0..gpus-1), and carries the GPU resource.
    engines_per_device None: as many as `n_workers` needs (workers then share devices)."""
    from distributed import Nanny

    devices = [str(i) for i in range(gpus)] if isinstance(gpus, int) else list(gpus)
    if engines_per_device is None:
        engines_per_device = max(1, -(-n_workers // max(1, len(devices))))
    chosen = assign_devices(n_workers, devices, engines_per_device)
    return {f"gpu-{i}": {"cls": Nanny, "options": {
        "nthreads": 1, "resources": {gpu_resource(): 1},
        "env": {"CUDA_VISIBLE_DEVICES": device, "OMP_NUM_THREADS": str(cpu_threads)}}}
        for i, device in enumerate(chosen)}


def gpu_resource() -> str:
    """The Dask resource local GPU workers carry: dask config `batchgen.worker-resource`, else GPU."""
    import dask.config

    return str(dask.config.get(RESOURCE_KEY, default=None) or GPU_RESOURCE)


def _cuda_cluster(n: int, devices: Sequence[str], cpu_threads: int, options: dict[str, Any]) -> SpecCluster:
    from dask_cuda import LocalCUDACluster  # the `cuda` extra; only reached on a GPU machine

    kwargs = cuda_cluster_options(n, devices, cpu_threads, options)
    print(f"batchgen: starting dask_cuda.LocalCUDACluster with {n} worker(s) on devices "
          f"{kwargs['CUDA_VISIBLE_DEVICES']}", file=sys.stderr)
    return LocalCUDACluster(**kwargs)


def _spec_cluster(n: int, devices: Sequence[str], engines_per_device: int, cpu_threads: int,
                  options: dict[str, Any]) -> SpecCluster:
    from distributed import Scheduler, SpecCluster

    spec = gpu_worker_spec(n, devices, cpu_threads, engines_per_device=engines_per_device)
    dashboard = options.pop("dashboard_address", DASHBOARD_ADDRESS)
    print(f"batchgen: starting {n} GPU worker(s) on devices "
          f"{','.join(s['options']['env']['CUDA_VISIBLE_DEVICES'] for s in spec.values())}"
          + ("" if has_dask_cuda() else " (install batchgen[cuda] to use dask-cuda)"), file=sys.stderr)
    return SpecCluster(workers=spec, scheduler={"cls": Scheduler, "options": {"dashboard_address": dashboard}},
                       **options)


def _print_dashboard(cluster_or_client: Any) -> None:
    try:
        link = cluster_or_client.dashboard_link
    except Exception:  # noqa: BLE001 - no dashboard (dashboard_address=None): nothing to show
        return
    print(f"batchgen: Dask dashboard at {link}", file=sys.stderr)  # stdout may carry a job's output


def _has_plugin(dask_scheduler: Any) -> bool:
    return PLUGIN_NAME in dask_scheduler.plugins


def _engine_workers(dask_scheduler: Any) -> list[str] | None:
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    if plugin is None or not plugin.engine_rule.is_restricted:
        return None
    return plugin.engine_workers()


async def _remove_plugin(dask_scheduler: Any) -> bool:
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    if plugin is None:
        return False
    await plugin.close()
    dask_scheduler.remove_plugin(PLUGIN_NAME)
    return True
