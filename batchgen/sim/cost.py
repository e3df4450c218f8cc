"""Engine cost model: the seconds one forward takes, from what the scheduler put in it.

A forward is described by four sums over its scheduled sequences (vectorized: numpy arrays of
forwards are welcome): `tokens` fed, `seqs` scheduled, `kv_tokens` of context read (computed +
new) and `attn_pairs` (query-context token pairs). Two models fill that in:

- RooflineCost: a GPU profile applied to a model's shapes. Time is the larger of compute and
  memory traffic (weights, KV), plus fetching the experts that do not sit on the device (expert
  offload tiers) and a fixed per-step overhead.
- FittedCost: the same terms, least-squares fitted to step times measured on a real engine;
  for an engine calibrated with its experts offloaded, the expert bytes each forward moved
  (measured, by tokens per forward) replace the uniform-routing estimate of what it fetches.

MoE: a forward of T tokens reads each expert that at least one token routes to. Routing is
assumed uniform and independent: E * (1 - (1 - k/E)^T) experts per layer. Real routers are
skewed, which touches fewer experts, so this errs towards slower small batches.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import PlanError
from .profiles import FIT_TERMS, ExpertTraffic, FittedProfile, GpuProfile, Profile
from .shapes import ModelShape

ArrayLike = np.ndarray | float | int
ACTIVATION_RESERVE = 0.05  # of device memory, for activations and the allocator's slack


def experts_touched(tokens: ArrayLike, num_experts: int, top_k: int) -> np.ndarray:
    """Expected distinct experts per layer that a forward of `tokens` tokens reads."""
    raw = np.asarray(tokens)
    if num_experts and raw.dtype.kind in "iu" and raw.size and 0 <= raw.min() and raw.max() < TOUCHED_TABLE_SIZE:
        return _touched_table(num_experts, top_k)[raw]  # integer token counts (every slice): a lookup
    t = raw.astype(np.float64)
    if num_experts == 0:
        return np.zeros_like(t)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** t) * (t > 0)


TOUCHED_TABLE_SIZE = 1 << 15


@functools.lru_cache(maxsize=8)
def _touched_table(num_experts: int, top_k: int) -> np.ndarray:
    """experts_touched of 0 .. TOUCHED_TABLE_SIZE - 1 tokens, by the same float expression."""
    return experts_touched(np.arange(TOUCHED_TABLE_SIZE, dtype=np.float64), num_experts, top_k)


class CostModel(Protocol):
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    network_bytes_per_s: float
    host_bytes_per_s: float

    def step_seconds(self, tokens: ArrayLike, seqs: ArrayLike, kv_tokens: ArrayLike,
                     attn_pairs: ArrayLike) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class ExpertTiers:
    """Where the routed experts live when they do not all fit on the device.

    device_bytes None: all on the device. Otherwise that much of them is resident (the rest is
    fetched per forward, from host memory over PCIe, and beyond the host budget from disk).
    Under uniform routing an expert is resident with probability device_bytes / all experts."""

    device_bytes: float | None = None

    def __post_init__(self) -> None:
        if self.device_bytes is not None and self.device_bytes < 0:
            raise PlanError(f"--expert-memory must be >= 0 bytes, got {self.device_bytes}")


@dataclass(frozen=True, slots=True)
class RooflineCost:
    gpu: GpuProfile
    shape: ModelShape
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    network_bytes_per_s: float
    host_bytes_per_s: float
    resident_fraction: float  # of the routed experts, on the device
    host_fraction: float  # of the routed experts, in host memory (the rest is on disk)
    # per token count 0 .. TOUCHED_TABLE_SIZE - 1: bytes read besides the KV, seconds fetching
    # experts, FLOPs of the parameters (what step_seconds computes from the count alone)
    per_tokens: tuple[np.ndarray, np.ndarray, np.ndarray] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_tokens", self._count_terms(np.arange(TOUCHED_TABLE_SIZE)))

    def _count_terms(self, tokens: ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The terms of a forward that depend on its token count alone: (bytes read besides the
        KV, seconds fetching experts, FLOPs of the parameters)."""
        g, s = self.gpu, self.shape
        touched = s.num_moe_layers * experts_touched(tokens, s.num_experts, s.top_k) * s.expert_bytes
        base = s.dense_bytes + touched * self.resident_fraction
        # Fetched experts are counted serially: a prefetcher hides part of it, which this omits.
        fetch = touched * (self.host_fraction / g.pcie_bytes_per_s
                           + (1.0 - self.resident_fraction - self.host_fraction) / max(g.disk_bytes_per_s, 1.0))
        return base, fetch, 2.0 * np.asarray(tokens, dtype=np.float64) * s.active_params_per_token

    @classmethod
    def build(cls, gpu: GpuProfile, shape: ModelShape, tiers: ExpertTiers = ExpertTiers(),
              kv_capacity_tokens: int | None = None) -> RooflineCost:
        experts = shape.total_expert_bytes
        on_device = experts if tiers.device_bytes is None else min(experts, tiers.device_bytes)
        usable = gpu.memory_bytes * (gpu.memory_utilization - ACTIVATION_RESERVE)
        free = usable - shape.dense_bytes - on_device
        if kv_capacity_tokens is None:
            kv_capacity_tokens = int(free // shape.kv_bytes_per_token)
        if kv_capacity_tokens < 1:
            need = (shape.dense_bytes + on_device) / 2**30
            if not experts:
                hint = "a dense model: it has no experts to offload; plan it on a GPU with more memory"
            elif shape.dense_bytes >= usable:
                hint = (f"even its non-expert weights ({shape.dense_bytes / 2**30:.1f} GiB) do not fit, so "
                        "offloading experts cannot help; plan it on a GPU with more memory")
            elif tiers.device_bytes is None:
                hint = "offload experts with --expert-memory (e.g. 4GiB)"
            else:
                hint = "keep fewer experts on the device (a smaller --expert-memory)"
            raise PlanError(f"{shape.name} does not fit one {gpu.name}: weights on the device need {need:.1f} GiB, "
                            f"{usable / 2**30:.1f} GiB usable (no room left for the KV cache); {hint}")
        spilled = experts - on_device
        in_host = min(spilled, gpu.host_memory_bytes * 0.8) if spilled else 0.0
        if spilled > in_host and gpu.disk_bytes_per_s <= 0:
            raise PlanError(f"{shape.name}: {spilled / 2**30:.1f} GiB of experts would need disk, and "
                            f"profile {gpu.name} has no disk_bytes_per_s")
        return cls(gpu, shape, kv_capacity_tokens, shape.kv_bytes_per_token, gpu.network_bytes_per_s,
                   gpu.pcie_bytes_per_s, on_device / experts if experts else 1.0,
                   in_host / experts if experts else 0.0)

    def step_seconds(self, tokens: ArrayLike, seqs: ArrayLike, kv_tokens: ArrayLike,
                     attn_pairs: ArrayLike) -> np.ndarray | float:
        g, s = self.gpu, self.shape
        if type(tokens) is int and type(kv_tokens) is int and 0 <= tokens < TOUCHED_TABLE_SIZE:
            return self._one_step_seconds(tokens, kv_tokens, float(attn_pairs))  # type: ignore[arg-type]
        raw = np.asarray(tokens)
        if raw.dtype.kind in "iu" and raw.size and 0 <= raw.min() and raw.max() < TOUCHED_TABLE_SIZE:
            # integer token counts (every decode slice): the count's terms looked up
            base, fetched, param_flops = (terms[raw] for terms in self.per_tokens)
        else:
            base, fetched, param_flops = self._count_terms(tokens)
        read = base + np.asarray(kv_tokens) * s.kv_bytes_per_token
        flops = param_flops + s.attn_flops_per_pair * np.asarray(attn_pairs, dtype=np.float64)
        device = np.maximum(flops / (g.peak_flops * g.compute_efficiency), read / (g.hbm_bytes_per_s * g.memory_efficiency))
        return g.step_overhead_s + device + fetched

    def _one_step_seconds(self, tokens: int, kv_tokens: int, attn_pairs: float) -> float:
        """step_seconds of one forward in Python floats: the same operations in the same order,
        so the same value, without a dozen numpy calls on scalars (every simulated prefill)."""
        g, s = self.gpu, self.shape
        base, fetched, param_flops = self.per_tokens
        read = float(base[tokens]) + kv_tokens * s.kv_bytes_per_token
        flops = float(param_flops[tokens]) + s.attn_flops_per_pair * attn_pairs
        device = max(flops / (g.peak_flops * g.compute_efficiency), read / (g.hbm_bytes_per_s * g.memory_efficiency))
        return g.step_overhead_s + device + float(fetched[tokens])


def fit_features(tokens: ArrayLike, seqs: ArrayLike, kv_tokens: ArrayLike, attn_pairs: ArrayLike,
                 num_experts: int, top_k: int, num_moe_layers: int, host_bytes: ArrayLike = 0.0,
                 disk_bytes: ArrayLike = 0.0) -> np.ndarray:
    """[..., len(FIT_TERMS)]: the regressors of FittedCost, in FIT_TERMS order (inputs broadcast).
    host_bytes / disk_bytes: expert bytes a forward copied from host memory / read from disk
    (an offloaded engine's measured traffic; 0 with every expert resident)."""
    t, s, k, a, h, d = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64)
                                             for v in (tokens, seqs, kv_tokens, attn_pairs, host_bytes, disk_bytes)))
    return np.stack([np.ones_like(t), t, s, k, a, num_moe_layers * experts_touched(t, num_experts, top_k), h, d],
                    axis=-1)


@dataclass(frozen=True, slots=True)
class FittedCost:
    profile: FittedProfile
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    network_bytes_per_s: float
    host_bytes_per_s: float
    traffic: ExpertTraffic | None = None  # measured expert bytes per forward (an offloaded run)

    @classmethod
    def build(cls, profile: FittedProfile, kv_capacity_tokens: int | None = None) -> FittedCost:
        return cls(profile, kv_capacity_tokens or profile.kv_capacity_tokens, profile.kv_bytes_per_token,
                   profile.network_bytes_per_s, profile.host_bytes_per_s,
                   ExpertTraffic.from_profile(profile.expert_traffic))

    def step_seconds(self, tokens: ArrayLike, seqs: ArrayLike, kv_tokens: ArrayLike,
                     attn_pairs: ArrayLike) -> np.ndarray:
        p = self.profile
        host, disk = self.traffic.at(tokens) if self.traffic is not None else (0.0, 0.0)
        x = fit_features(tokens, seqs, kv_tokens, attn_pairs, p.num_experts, p.top_k, p.num_moe_layers, host, disk)
        return x @ np.array([p.coefficients.get(k, 0.0) for k in FIT_TERMS])


def build_cost(profile: Profile, shape: ModelShape | None, tiers: ExpertTiers = ExpertTiers(),
               kv_capacity_tokens: int | None = None) -> CostModel:
    if isinstance(profile, FittedProfile):
        if tiers.device_bytes is not None:
            raise PlanError(f"--expert-memory applies to GPU profiles; {profile.name} was measured as it ran")
        return FittedCost.build(profile, kv_capacity_tokens)
    if shape is None:
        raise PlanError(f"profile {profile.name} is a GPU: give the model's shapes with --model (a directory "
                        "with config.json, or qwen3-30b-a3b / deepseek-v3 / mixtral-8x7b)")
    return RooflineCost.build(profile, shape, tiers, kv_capacity_tokens)


def recompute_tokens_per_s(cost: CostModel, chunk: int) -> float:
    """Prefill rate at a full chunk: what recomputing a moved coroutine's KV costs per token."""
    seconds = float(cost.step_seconds(chunk, 1, chunk, chunk * (chunk + 1) / 2))
    return chunk / seconds if seconds > 0 else 0.0
