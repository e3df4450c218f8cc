"""What the device gives an engine: its class (equal classes run equally fast, for the balancer)
and the byte budget of its KV pool.
"""
from __future__ import annotations

import torch

from ..config import EngineConfig


def device_class(device: torch.device, dtype: torch.dtype, config: EngineConfig) -> str:
    """What sets an engine's pace besides the rows it runs: the device model, the dtype, CPU
    threads, and where experts and KV live. The balancer counts engines of one class as equally
    fast (policy/balance.py relative_speeds)."""
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{torch.get_num_threads()} threads"
    tiers = ""
    if config.expert_memory_bytes is not None or config.expert_host_memory_bytes is not None:
        tiers = f" experts {config.expert_memory_bytes}/{config.expert_host_memory_bytes} B"
    return f"{device.type} {where} {str(dtype).removeprefix('torch.')}{tiers}{' kv-on-host' if config.kv_cache_on_host else ''}"


HOST_KV_BYTES = 1 << 30


def kv_budget(config: EngineConfig, device: torch.device, most_bytes: int) -> int:
    """Bytes for the KV pool: as configured; else on CUDA what the utilization target leaves
    after the weights (and whatever else holds the device); in host memory HOST_KV_BYTES, or
    most_bytes (what max_num_seqs rows at max_model_len hold) where that is less: a host pool's
    pages are faulted in when it is made, so a small model's engine should not pay for a GiB it
    can never fill."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type == "cuda" and not config.kv_cache_on_host:
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - (1 - config.gpu_memory_utilization) * total))
    return min(HOST_KV_BYTES, most_bytes)
