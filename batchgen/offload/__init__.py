"""Expert tiers for memory-constrained MoE: device pool, host memory, the checkpoint on disk.

Applied to a loaded model: models/model.py asks `build_store` for an ExpertStore and calls its
`fetch` at each MoE stage; model code does not know where an expert lives.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from ..policy.expert_eviction import TierPlan
    from .state import HostExperts, StoreOptions
    from .store import ExpertStore, RouterPredict

__all__ = ["ExpertStore", "ExpertReadError", "HostExperts", "StoreOptions", "TierPlan", "expert_tier_plan",
           "build_store"]
_LAZY = {"ExpertStore": ".store", "HostExperts": ".state", "StoreOptions": ".state", "ExpertReadError": ".disk",
         "TierPlan": "..policy.expert_eviction"}


def __getattr__(name: str) -> Any:
    """Classes load on first use: `import batchgen.policy.expert_eviction` must not import torch."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(name)


def expert_tier_plan(num_experts: dict[int, int], w13_shape: tuple[int, int], w2_shape: tuple[int, int],
                     dtype: torch.dtype, device: torch.device, device_budget: int | None,
                     host_budget: int | None) -> TierPlan | None:
    """The tiers the budgets give this model (None: every expert resident); a budget below one
    MoE layer's experts fails with ModelLoadError naming the minimum."""
    from ..errors import ModelLoadError
    from ..policy.expert_eviction import BudgetError, plan_tiers

    if not num_experts or (device_budget is None and host_budget is None):
        return None
    expert_bytes = (w13_shape[0] * w13_shape[1] + w2_shape[0] * w2_shape[1]) * dtype.itemsize
    try:
        return plan_tiers(expert_bytes, sum(num_experts.values()), max(num_experts.values()),
                          device_budget, host_budget, device_is_host=device.type == "cpu")
    except BudgetError as exc:
        raise ModelLoadError(str(exc)) from exc


def build_store(plan: TierPlan, model_dir: Path, num_experts: dict[int, int], layer_prefixes: dict[int, str],
                expert_names: tuple[str, str, str], w13_shape: tuple[int, int], w2_shape: tuple[int, int],
                dtype: torch.dtype, device: torch.device, host_experts: dict[int, HostExperts] | None,
                options: StoreOptions, router_predict: RouterPredict | None) -> ExpertStore:
    from .disk import DiskExperts
    from .store import ExpertStore

    disk = None
    if plan.from_disk:
        disk = DiskExperts(model_dir, layer_prefixes, num_experts, expert_names, w13_shape, w2_shape)
    return ExpertStore(plan, num_experts, w13_shape, w2_shape, dtype, device, host_experts, disk, options,
                       router_predict)
