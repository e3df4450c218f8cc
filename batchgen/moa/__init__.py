"""batchgen.moa: multi-model jobs and Mixture-of-Agents (MOSAIC).

Placement (models and rows onto workers) is a pure policy (batchgen/policy/placement.py); the names below load on first use
so `import batchgen.moa` stays torch- and Dask-free.
"""
from __future__ import annotations

import importlib
from typing import Any

from ..policy.placement import POLICIES as POLICIES
from ..policy.placement import Demand as Demand
from ..policy.placement import ModelCost as ModelCost
from ..policy.placement import Placement as Placement
from ..policy.placement import PlacementError as PlacementError
from ..policy.placement import WorkerSlot as WorkerSlot
from ..policy.placement import place as place

_EXPORTS: dict[str, str] = {"MoA": "mixture", "MoAStats": "mixture", "ModelPool": "pool", "Item": "pool",
                            "vote": "agreement", "make_extract": "agreement"}

__all__ = sorted(["POLICIES", "Demand", "ModelCost", "Placement", "PlacementError", "WorkerSlot", "place",
                  *_EXPORTS])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'batchgen.moa' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
