"""Rotary embedding of q and k fused with the KV cache write, on CPU (csrc/rope_kv_cpu.cpp), and
its plain-torch reference.

# T tokens, Hq query heads, Hk kv heads, D head dim, R rotated channels per head (R <= D, even)
One pass over the qkv projection replaces about a dozen small torch ops per layer (rotate q and
k in fp32, concatenate K and V, index_copy_ into the cache). Bit-identical to the reference.
"""
from __future__ import annotations

import torch

from ._cpu_build import cpu_kernels, cpu_kernels_error
from .errors import CpuKernelUnavailableError, KernelInputError

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def cpu_rope_kv_available() -> bool:
    """Whether the compiled rope + KV-write kernel is usable here (built on first call)."""
    return cpu_kernels("rope_kv_cpu") is not None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, R/2] -> x with its first R channels rotated (fp32 math)."""
    r = 2 * cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = x[..., :r].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :r // 2], rot[..., r // 2:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., r:]), dim=-1)


def rope_kv_write_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                            cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                            interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv: [T, (Hq + 2 Hk) D]; cos, sin: [T, R/2] fp32; slots: [T] int64; cache: [slots, 2 Hk D]
    -> (q [T, Hq, D] rotated, kv [T, 2 Hk D]: rotated k then v), kv also written to cache[slots]."""
    T, hq, hk, d = qkv.shape[0], num_heads, num_kv_heads, head_dim
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q = _rotate(q.reshape(T, hq, d), cos, sin, interleaved)
    kv = torch.cat([_rotate(k.reshape(T, hk, d), cos, sin, interleaved).reshape(T, -1), v], dim=-1)
    cache.index_copy_(0, slots, kv)
    return q, kv


def rope_kv_write_cpu(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                      cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                      interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_kv_write_reference` in one compiled pass (float32 or bfloat16, CPU tensors)."""
    lib = cpu_kernels("rope_kv_cpu")
    if lib is None:
        raise CpuKernelUnavailableError(f"the CPU rope kernel is unavailable: {cpu_kernels_error('rope_kv_cpu')}")
    T, hq, hk, d = qkv.shape[0], num_heads, num_kv_heads, head_dim
    half = cos.shape[-1]
    if qkv.dtype not in _DTYPES or cache.dtype != qkv.dtype or qkv.device.type != "cpu" or cache.device.type != "cpu":
        raise KernelInputError(f"qkv and cache must be CPU float32 or bfloat16 of one dtype, got {qkv.dtype} on "
                               f"{qkv.device} and {cache.dtype} on {cache.device}")
    if qkv.dim() != 2 or qkv.shape[1] != (hq + 2 * hk) * d or qkv.stride(1) != 1:
        raise KernelInputError(f"qkv must be [T, ({hq} + 2 * {hk}) * {d}] with unit last stride, got shape "
                               f"{tuple(qkv.shape)} strides {qkv.stride()}")
    if cache.dim() != 2 or cache.shape[1] != 2 * hk * d or cache.stride(1) != 1:
        raise KernelInputError(f"cache must be [slots, {2 * hk * d}] with unit last stride, got {tuple(cache.shape)}")
    if 2 * half > d or cos.dtype != torch.float32 or sin.dtype != torch.float32 or \
            tuple(cos.shape) != (T, half) or tuple(sin.shape) != (T, half):
        raise KernelInputError(f"cos and sin must be fp32 [T={T}, R/2] with R <= {d}, got {tuple(cos.shape)} "
                               f"{cos.dtype} and {tuple(sin.shape)} {sin.dtype}")
    if tuple(slots.shape) != (T,) or slots.dtype != torch.int64:
        raise KernelInputError(f"slots must be int64 [T={T}], got {tuple(slots.shape)} {slots.dtype}")
    cos, sin, slots = cos.contiguous(), sin.contiguous(), slots.contiguous()
    q = torch.empty(T, hq, d, dtype=qkv.dtype)
    kv = torch.empty(T, 2 * hk * d, dtype=qkv.dtype)
    bad = lib.batchgen_rope_kv_write(_DTYPES[qkv.dtype], qkv.data_ptr(), qkv.stride(0), cos.data_ptr(),
                                     sin.data_ptr(), slots.data_ptr(), q.data_ptr(), kv.data_ptr(), cache.data_ptr(),
                                     cache.stride(0), cache.shape[0], T, hq, hk, d, 2 * half, int(interleaved),
                                     torch.get_num_threads())
    if bad:
        raise KernelInputError(f"token {bad - 1}: slot {int(slots[bad - 1])} is outside the cache's "
                               f"{cache.shape[0]} slots")
    return q, kv
