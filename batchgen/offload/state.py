"""The expert store's value types: its options, experts held in host memory, its counters and
their summary (the `expert_*` keys of Engine.stats_summary())."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..policy.expert_eviction import EVICTIONS, PREDICTORS, TierPlan


@dataclass(slots=True)
class HostExperts:
    """One MoE layer's routed experts, all in host memory."""

    w13: torch.Tensor  # [E, 2N, H]
    w2: torch.Tensor  # [E, H, N]


@dataclass(slots=True)
class StoreStats:
    stages: int = 0
    experts_needed: int = 0
    device_hits: int = 0
    host_hits: int = 0  # device misses found in host memory
    host_lookups: int = 0  # device misses looked up in the host tier
    disk_reads: int = 0
    bytes_from_disk: int = 0
    bytes_from_host: int = 0  # host -> device pool copies
    predicted: int = 0  # experts the predictor named for a coming stage
    predicted_used: int = 0  # ... that the stage then needed
    prefetch_reads: int = 0  # experts read ahead from disk (into host memory)
    prefetch_reads_used: int = 0  # ... that a stage then needed before they were evicted
    prefetch_copies: int = 0  # CUDA: experts copied ahead host -> device pool on the side stream
    prefetch_copies_used: int = 0
    fetch_wait_s: float = 0.0

    def summary(self, plan: TierPlan, slots: int, generated_tokens: int) -> dict[str, float]:
        """expert_bytes_from_disk / _from_host are per generated token (the issue's measure of an
        offload design); the _total keys are the byte counts."""
        st = self
        per_token = max(generated_tokens, 1)
        device_rate = st.device_hits / st.experts_needed if st.experts_needed else 0.0
        if plan.shared:  # the host cache is the pool: one tier, one rate
            host_rate = device_rate
        else:
            host_rate = st.host_hits / st.host_lookups if st.host_lookups else 0.0
        return {
            "expert_pool_slots": slots,
            "expert_host_slots": plan.host_slots if plan.host_slots is not None else plan.total_experts,
            "expert_hit_rate_device": device_rate,
            "expert_hit_rate_host": host_rate,
            "expert_bytes_from_disk": st.bytes_from_disk / per_token,
            "expert_bytes_from_host": st.bytes_from_host / per_token,
            "expert_bytes_from_disk_total": st.bytes_from_disk,
            "expert_bytes_from_host_total": st.bytes_from_host,
            "expert_disk_reads": st.disk_reads,
            "expert_prefetch_accuracy": st.predicted_used / st.predicted if st.predicted else 0.0,
            "expert_prefetch_reads": st.prefetch_reads,
            "expert_prefetch_reads_used": st.prefetch_reads_used,
            "expert_prefetch_copies": st.prefetch_copies,
            "expert_prefetch_copies_used": st.prefetch_copies_used,
            "expert_fetch_wait_s": st.fetch_wait_s,
        }


@dataclass(frozen=True, slots=True)
class StoreOptions:
    eviction: str = "routing"
    predictor: str = "auto"
    io_threads: int = 1
    overlap_reads: bool = True  # CPU host cache: compute a stage's landed experts while the rest are read

    def __post_init__(self) -> None:
        if self.eviction not in EVICTIONS:
            raise ValueError(f"expert_eviction must be one of {EVICTIONS}, got {self.eviction!r}")
        if self.predictor not in PREDICTORS:
            raise ValueError(f"expert_prefetch must be one of {PREDICTORS}, got {self.predictor!r}")
        if not isinstance(self.io_threads, int) or self.io_threads < 1:
            raise ValueError(f"expert_io_threads must be a positive integer, got {self.io_threads!r}")
