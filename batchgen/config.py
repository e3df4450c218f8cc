"""EngineConfig: every engine knob in one checked dataclass.

Defaults can also come from dask.config under `batchgen.*` (e.g. `batchgen.max-num-seqs`), so a
cluster's workers are configured the Dask way; explicit keyword arguments win.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# With experts offloaded every expert copy is paid once per MoE stage, so the engine keeps more
# coroutines per forward (bench_offload, 1024 rows: MoE batch 223 against 197 tokens, 15% fewer
# expert bytes per token) and bounds each attention micro-batch's KV working set, which costs
# nothing measurable at 4096 KV tokens (1.06x and 0.99x of one attention batch in two runs; 1024:
# 0.95x, 256: 0.73x) and keeps transient attention memory small where memory is short.
OFFLOAD_MAX_NUM_SEQS = 1024
OFFLOAD_ATTENTION_KV_TOKENS = 4096

# byte counts that may also be given as human sizes
BYTE_FIELDS = ("kv_cache_bytes", "swap_space_bytes", "expert_memory_bytes", "expert_host_memory_bytes")


def parse_size(text: str, name: str) -> int:
    """'2GiB' -> 2147483648 (dask's units: GiB = 2**30, GB = 10**9); ValueError naming `name`."""
    # imported here, as dask.config below: dask takes a tenth of a second to import, and commands
    # that read sizes without a cluster (`batchgen plan`) need none of it
    from dask.utils import parse_bytes

    try:
        value = parse_bytes(text)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name} must be a byte count or a size like '2GiB', got {text!r}") from exc
    if value < 1:
        raise ValueError(f"{name} must be a positive size, got {text!r}")
    return int(value)


def size_arg(text: str) -> int:
    """``parse_size`` for argparse: every command's size flags read sizes the same way."""
    import argparse

    try:
        return parse_size(text, "size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


@dataclass(slots=True)
class EngineConfig:
    # "auto" (vLLM's rule, models/dtype.py): the checkpoint's dtype on CUDA, float32 on CPU;
    # or float32 / bfloat16 / float16 everywhere
    dtype: str = "auto"
    device: str | None = None  # None: cuda when available, else cpu
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_bytes
    # None: on CUDA what gpu_memory_utilization leaves; in host memory 1 GiB, or what max_num_seqs
    # rows at max_model_len hold where that is less
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the device the weights + KV cache may use
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int | None = None  # None: 256, or OFFLOAD_MAX_NUM_SEQS with experts offloaded
    max_num_batched_tokens: int = 2048
    eviction: str = "newest"
    # Expert-level batching: attention runs in micro-batches of at most this many KV tokens
    # (context included); the MoE stage of each layer runs once on all micro-batches combined.
    # None: the whole forward batch at once, or OFFLOAD_ATTENTION_KV_TOKENS with experts offloaded.
    attention_kv_tokens: int | None = None
    # evicted coroutines keep their KV in host memory (up to this many bytes) when copying it
    # back beats recomputing it at host_link_bytes_per_s; 0 always recomputes
    swap_space_bytes: int = 4 << 30
    host_link_bytes_per_s: int = 10_000_000_000
    # migrate: a coroutine's KV travels when sending it beats recomputing it at this link speed
    kv_link_bytes_per_s: int = 1_000_000_000
    seed: int = 0  # draws the seeds of requests that set none
    # Routed experts tiered over device, host and disk (batchgen/offload). expert_memory_bytes:
    # device bytes for them (None: as many as they need); below that they stream through a
    # device pool this size from host memory. expert_host_memory_bytes: host bytes for them
    # (None: all of them); below that the rest stay in the checkpoint's safetensors files and
    # are read per expert. On a CPU device the host budget alone is the pool the kernel reads.
    # Each budget must hold one MoE layer's experts. Both None: everything resident.
    expert_memory_bytes: int | None = None
    expert_host_memory_bytes: int | None = None
    expert_eviction: str = "routing"  # or "layer-order" (policy/expert_eviction.py)
    expert_prefetch: str = "auto"  # next-layer predictor: "router", "history", "none"; auto: router on CUDA, none on CPU
    expert_io_threads: int = 1  # reader threads for experts on disk
    expert_overlap_reads: bool = True  # CPU: compute a stage's landed experts while the rest are read (store.py)
    # Keep the KV pool in host memory and run attention there (BatchGen / MoE-Gen on
    # memory-constrained GPUs): the decode batch is bounded by host memory, not device memory,
    # and the device keeps the expert GEMMs. On a CPU device that is the ordinary path.
    kv_cache_on_host: bool = False
    # Automatic prefix caching (runtime/prefix_cache.py): full KV blocks are found again by a
    # hash of their tokens and all before them, so rows sharing an instruction compute it once.
    enable_prefix_caching: bool = True
    # With prefix caching: "prefix" admits waiting rows grouped by shared prefix (epochs sorted by
    # block hashes, runtime/prefix_order.py); "fifo" admits them in arrival order. "length" (opt-in):
    # the rows predicted longest first, from the lengths of the rows that finished on this engine
    # (by prompt-length bucket; runtime/length_order.py), "prefix"'s order until that predicts
    # better than the mean of all rows.
    admission_order: str = "prefix"
    # CUDA: decode steps replay CUDA graphs captured per batch-size bucket (runtime/cuda_graphs.py);
    # True runs every step eagerly (vLLM's flag). No effect on CPU.
    enforce_eager: bool = False
    # Raise glibc's mmap/trim thresholds for this process (also undoing Dask workers'
    # MALLOC_TRIM_THRESHOLD_) so activations reuse heap blocks instead of faulting in fresh
    # pages every step (malloc.py).
    restore_heap_reuse: bool = True

    def __post_init__(self) -> None:
        for name in BYTE_FIELDS:  # human sizes ("2GiB", "512 MB") become byte counts
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, parse_size(value, f"EngineConfig.{name}"))
        if not isinstance(self.swap_space_bytes, int) or self.swap_space_bytes < 0:
            raise ValueError(f"EngineConfig.swap_space_bytes must be an integer >= 0, got {self.swap_space_bytes!r}")
        for name in ("block_size", "kv_link_bytes_per_s", "host_link_bytes_per_s", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"EngineConfig.enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if self.admission_order not in ("prefix", "fifo", "length"):
            raise ValueError("EngineConfig.admission_order must be 'prefix', 'fifo' or 'length', "
                             f"got {self.admission_order!r}")
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("num_kv_blocks", "kv_cache_bytes", "max_model_len", "attention_kv_tokens", "expert_memory_bytes",
                     "expert_host_memory_bytes", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"EngineConfig.{name} must be a positive integer or None, got {value!r}")

    def resolve_batch_defaults(self, experts_offloaded: bool) -> None:
        """Fill the batch options left unset, once the engine knows whether its experts are
        really offloaded (a budget that holds every expert offloads nothing)."""
        if self.max_num_seqs is None:
            self.max_num_seqs = OFFLOAD_MAX_NUM_SEQS if experts_offloaded else 256
        if self.attention_kv_tokens is None and experts_offloaded:
            self.attention_kv_tokens = OFFLOAD_ATTENTION_KV_TOKENS

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Keyword arguments over dask.config `batchgen.*` over defaults; unknown keys raise TypeError.

        A keyword given as None counts as not given.
        """
        import dask.config

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
