"""A function run on this worker's image engine: the runtime's engine, on its own thread.

The elastic driver's loops, its sequence-parallel steps and the calibration forwards need to
drive an engine themselves (their own plan per step, collectives with other workers). They do
it on the engine the cluster runtime keeps for that spec (cluster/host.py: the same one
`batchgen.diffuse` partitions join), as one command on its runner thread: nothing else touches
that engine meanwhile, and no second engine is loaded beside it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .engine_spec import image_spec

if TYPE_CHECKING:
    from ...cluster.worker import WorkerSide
    from ..engine.diffusion_engine import DiffusionEngine

T = TypeVar("T")


def this_side() -> WorkerSide:
    """This Dask worker's batchgen side (its engines and mailboxes), installed on first use."""
    from distributed import get_worker

    from ...cluster.worker import ensure_side

    return ensure_side(get_worker())


def install_side(dask_worker: Any) -> bool:
    """`Client.run` target: install the batchgen side (handlers included) before any part of a
    job may send to this worker."""
    from ...cluster.worker import ensure_side

    ensure_side(dask_worker)
    return True


def on_engine(model: str, engine_options: dict[str, Any], fn: Callable[[DiffusionEngine], T],
              long: bool = False) -> T:
    """In a Dask task: fn(engine) on this worker's engine for (model, options) -> its result.
    long: the task leaves the worker's thread pool while it waits (a job's whole loop)."""
    side = this_side()
    spec = image_spec(model, engine_options)
    fut = side.host.engines.call(spec, lambda runner: runner.call(fn))  # type: ignore[arg-type]
    if not long:
        return fut.result()
    from distributed import rejoin, secede

    secede()
    try:
        return fut.result()
    finally:
        rejoin()
