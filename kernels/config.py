"""Launch configs for the fused-MoE Triton kernels: JSON data by (E, N, dtype, device), with a
default heuristic when no tuned file exists.

A tuned file is `configs/E={E},N={N},device_name={device},dtype={dtype}.json`, where device is
`torch.cuda.get_device_name()` with spaces as underscores and dtype is fp16, bf16 or fp32. It
maps a token count T (as a string) to a config; the entry with the nearest T is used:

    {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
           "num_warps": 4, "num_stages": 3},
     "256": {...}}
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from .errors import KernelInputError

CONFIG_DIR = Path(__file__).parent / "configs"
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_REQUIRED = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M")
_OPTIONAL = {"num_warps": 4, "num_stages": 3}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise KernelInputError(f"dtype must be one of float16, bfloat16, float32, got {dtype}")
    return _DTYPE_NAMES[dtype]


def config_file_name(E: int, N: int, dtype: torch.dtype, device_name: str) -> str:
    device = device_name.replace(" ", "_")
    return f"E={E},N={N},device_name={device},dtype={dtype_name(dtype)}.json"


def validate_config(config: dict[str, int], source: str = "config") -> dict[str, int]:
    """Return a complete copy of a launch config, or raise naming the bad key and value."""
    unknown = set(config) - set(_REQUIRED) - set(_OPTIONAL)
    if unknown:
        raise KernelInputError(f"{source} has unknown keys {sorted(unknown)}")
    full = {**_OPTIONAL, **config}
    for key in _REQUIRED:
        if key not in full:
            raise KernelInputError(f"{source} is missing {key}")
    for key, value in full.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise KernelInputError(f"{source}[{key!r}] must be a positive int, got {value!r}")
    for key in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
        value = full[key]
        # tl.dot needs every tile dim >= 16 and tl.arange needs powers of two.
        if value < 16 or value & (value - 1):
            raise KernelInputError(f"{source}[{key!r}] must be a power of two >= 16, got {value}")
    return full


@functools.lru_cache(maxsize=64)
def _load_tuned(path: Path) -> dict[int, dict[str, int]] | None:
    if not path.is_file():
        return None
    with path.open() as f:
        raw = json.load(f)
    return {int(t): validate_config(c, f"{path.name}[{t}]") for t, c in raw.items()}


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def default_config(E: int, N: int, K: int, T: int, dtype: torch.dtype) -> dict[str, int]:
    """vLLM's untuned defaults: small tiles when tokens are few (decode), larger otherwise;
    tiles no wider than the (power-of-two rounded) matrix so tiny shapes waste no work."""
    if T <= E:
        config = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
    else:
        config = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8}
    # Both GEMMs use BLOCK_SIZE_N/K: the first has (N out, K in), the second (K out, N in).
    smallest = min(_pow2_at_least(N), _pow2_at_least(K))
    config["BLOCK_SIZE_N"] = max(16, min(config["BLOCK_SIZE_N"], smallest))
    config["BLOCK_SIZE_K"] = max(16, min(config["BLOCK_SIZE_K"], smallest))
    if dtype == torch.float32:
        config["BLOCK_SIZE_K"] = min(config["BLOCK_SIZE_K"], 32)  # fp32 tiles take twice the SRAM
    return validate_config(config, "default_config")


def get_config(
    E: int,
    N: int,
    K: int,
    T: int,
    dtype: torch.dtype,
    *,
    device_name: str | None = None,
    config_dir: Path | None = None,
) -> dict[str, int]:
    """Launch config for T tokens through E experts (w13: [E, 2N, K]): the tuned entry nearest
    T from `config_dir` (default `configs/`) for this device, else `default_config`.

    device_name defaults to the current CUDA device's name ("cpu" without CUDA).
    """
    if device_name is None:
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    path = (config_dir or CONFIG_DIR) / config_file_name(E, N, dtype, device_name)
    tuned = _load_tuned(path)
    if tuned:
        nearest = min(tuned, key=lambda t: (abs(t - T), t))
        return dict(tuned[nearest])
    return default_config(E, N, K, T, dtype)
