"""Elastic sequence parallelism on Dask workers: each worker process joins one gloo world at
start-up (`start_world`); a trajectory then runs chunks of steps on any subset of workers
(`run_steps`, degree = len(workers)), its degree changing between chunks. The state travels as
suspended bytes: every member resumes the same state, takes the steps on its token shard (the
model output is all-gathered, so every member applies the same scheduler step), and the first
member hands back the new state; the latents are re-split on the next chunk's group.
"""
from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from ..parallel.groups import Group, init_world


def start_world(client: Any) -> dict[str, int]:
    """Join every worker into one gloo world, once; -> worker address -> world rank."""
    workers = sorted(client.scheduler_info()["workers"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = {w: i for i, w in enumerate(workers)}
    futures = [client.submit(init_world, ranks[w], len(workers), f"tcp://127.0.0.1:{port}", workers=[w],
                             allow_other_workers=False, pure=False) for w in workers]
    client.gather(futures)
    return ranks


def world_ranks(client: Any) -> dict[str, int]:
    """Every worker's world rank, starting the world if it is not up; a worker that joined after
    start-up (not in the world) is an error naming it."""
    got = client.run(_rank_or_none)
    if any(r is None for r in got.values()):
        if all(r is None for r in got.values()):
            start_world(client)
            got = client.run(_rank_or_none)
        else:
            missing = sorted(w for w, r in got.items() if r is None)
            raise RuntimeError(f"workers {missing} joined after the gloo world started; restart the cluster")
    return got


def world_size() -> int:
    """How many processes the gloo world holds (1 when there is none)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _rank_or_none() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else None


def sp_steps(model: str, state: bytes, ranks: tuple[int, ...], steps: int,
             engine_options: dict[str, Any] | None = None) -> bytes | None:
    """A member's part of `steps` Ulysses steps of one trajectory (a Dask task, on its worker's
    engine for the model)."""
    import torch.distributed as dist

    from ..parallel.sp import UlyssesShard
    from .on_worker import on_engine

    group = Group.of(ranks)

    def run(engine: Any) -> bytes:
        tid = engine.resume(state)
        shard = UlyssesShard(group) if len(ranks) > 1 else None
        for _ in range(steps):
            engine.step_trajectory(tid, shard)
        return engine.suspend(tid)

    data = on_engine(model, dict(engine_options or {}), run)
    return data if group.index(dist.get_rank()) == 0 else None


def run_steps(client: Any, model: str, state: bytes, workers: Sequence[str], ranks: dict[str, int],
              steps: int, engine_options: dict[str, Any] | None = None) -> bytes:
    """`steps` steps of the trajectory in `state` at degree len(workers) on those workers; -> new state."""
    group = tuple(ranks[w] for w in workers)
    futures = [client.submit(sp_steps, model, state, group, steps, engine_options, workers=[w], allow_other_workers=False,
                             pure=False) for w in workers]
    return client.gather(futures)[0]
