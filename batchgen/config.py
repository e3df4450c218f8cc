"""EngineConfig: every engine knob in one checked dataclass.

Defaults can also come from dask.config under `batchgen.*` (e.g. `batchgen.max-num-seqs`), so a
cluster's workers are configured the Dask way; explicit keyword arguments win.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import dask.config


@dataclass(slots=True)
class EngineConfig:
    dtype: str = "float32"  # or "auto": the checkpoint's own dtype
    device: str | None = None  # None: cuda when available, else cpu
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_bytes
    kv_cache_bytes: int | None = None  # None: 1 GiB on CPU; on CUDA, what gpu_memory_utilization leaves
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the device the weights + KV cache may use
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    eviction: str = "newest"
    # Expert-level batching: attention runs in micro-batches of at most this many KV tokens
    # (context included); the MoE stage of each layer runs once on all micro-batches combined.
    # None: attention runs on the whole forward batch at once.
    attention_kv_tokens: int | None = None
    # evicted coroutines keep their KV in host memory (up to this many bytes) when copying it
    # back beats recomputing it at host_link_bytes_per_s; 0 always recomputes
    swap_space_bytes: int = 4 << 30
    host_link_bytes_per_s: int = 10_000_000_000
    # migrate: a coroutine's KV travels when sending it beats recomputing it at this link speed
    kv_link_bytes_per_s: int = 1_000_000_000
    seed: int = 0  # draws the seeds of requests that set none
    # Device bytes for routed-expert weights. None: every expert resident. Less than the experts
    # need: they stay in host memory and stream through a pool this size (at least one MoE
    # layer's experts), the expert needed furthest ahead out first (models/offload.py).
    expert_memory_bytes: int | None = None
    # Where MALLOC_TRIM_THRESHOLD_ is set (Dask workers), raise glibc's mmap/trim thresholds for
    # this process so activations reuse heap blocks instead of faulting in fresh pages (malloc.py).
    restore_heap_reuse: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.swap_space_bytes, int) or self.swap_space_bytes < 0:
            raise ValueError(f"EngineConfig.swap_space_bytes must be an integer >= 0, got {self.swap_space_bytes!r}")
        for name in ("block_size", "kv_link_bytes_per_s", "host_link_bytes_per_s", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("num_kv_blocks", "kv_cache_bytes", "max_model_len", "attention_kv_tokens", "expert_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"EngineConfig.{name} must be a positive integer or None, got {value!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Keyword arguments over dask.config `batchgen.*` over defaults; unknown keys raise TypeError.

        A keyword given as None counts as not given.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(names)}")
        merged: dict[str, Any] = {}
        for name in names:
            value = dask.config.get(f"batchgen.{name.replace('_', '-')}", default=None)
            if value is not None:
                merged[name] = value
        merged.update({k: v for k, v in kwargs.items() if v is not None})  # None: not set here
        return cls(**merged)
