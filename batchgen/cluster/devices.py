"""Which GPU each local worker sees: the i-th of the devices this process was given.

A node's scheduler (SLURM, Kubernetes, a user's `CUDA_VISIBLE_DEVICES=2,3`) hands a process a
list of devices: indices, UUIDs (`GPU-8f3c...`) or MIG instances (`MIG-...`). A worker started
from it must see one entry of that list, never a device outside it: worker i gets entry i.
More workers than devices is refused unless the caller asks for several engines per device.
See docs/guides/gpu-clusters.md.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from ..errors import BatchgenError

VISIBLE = "CUDA_VISIBLE_DEVICES"


def visible_devices(env: Mapping[str, str] | None = None, count: int | None = None) -> list[str]:
    """The devices this process may use, as CUDA_VISIBLE_DEVICES entries. With the variable
    unset: indices 0..count-1 (`count`: the devices the driver shows, asked of torch when None).
    Set but empty: none (CUDA hides every device then)."""
    env = os.environ if env is None else env
    value = env.get(VISIBLE)
    if value is None:
        return [str(i) for i in range(gpu_count() if count is None else count)]
    # CUDA reads entries up to the first it cannot parse; "-1" and "" hide everything
    entries = [e.strip() for e in value.split(",")]
    out: list[str] = []
    for entry in entries:
        if not entry or entry.startswith("-"):
            break
        out.append(entry)
    return out


def assign_devices(n_workers: int, devices: Sequence[str], engines_per_device: int = 1) -> list[str]:
    """Worker i -> its one device: devices[i] (with `engines_per_device` > 1, worker i shares
    devices[i % len(devices)] with the others on it)."""
    if n_workers < 1:
        raise BatchgenError(f"n_workers must be >= 1, got {n_workers}")
    if engines_per_device < 1:
        raise BatchgenError(f"engines_per_device must be >= 1, got {engines_per_device}")
    if not devices:
        raise BatchgenError(f"no GPU is visible to this process ({VISIBLE}={os.environ.get(VISIBLE)!r})")
    room = len(devices) * engines_per_device
    if n_workers > room:
        raise BatchgenError(
            f"n_workers={n_workers} but this process was given {len(devices)} GPU(s) ({','.join(devices)}) "
            f"and engines_per_device={engines_per_device}: at most {room} workers. Ask for fewer workers or "
            f"pass engines_per_device={-(-n_workers // len(devices))} to share devices.")
    return [devices[i % len(devices)] for i in range(n_workers)]


def gpu_count() -> int:
    """GPUs the driver shows this process (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def has_dask_cuda() -> bool:
    """Is dask-cuda installed (the `cuda` extra)? Checked without importing it."""
    import importlib.util

    return importlib.util.find_spec("dask_cuda") is not None
