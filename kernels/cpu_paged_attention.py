"""Launchers of the CPU paged decode attention (csrc/paged_attention_cpu.cpp): check inputs, hand
pointers and strides to the compiled kernel. The semantics are `paged_attention_reference.py`'s;
the kernel reads every sequence's K and V from the cache rows its block table names, in place.

# S sequences, Hq query heads, Hk kv heads (G = Hq / Hk), D head dim, MB blocks per table
Same signatures as the Triton launchers in paged_attention.py, for CPU tensors (float32 or
bfloat16). `cpu_paged_attention_available()` says whether the kernel built here; without it
these raise CpuKernelUnavailableError and callers use the torch path.
"""
from __future__ import annotations

import torch

from ._cpu_build import cpu_kernels, cpu_kernels_error
from ._paged_checks import check_gqa_inputs, check_mla_inputs
from .errors import CpuKernelUnavailableError, KernelInputError

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def cpu_paged_attention_available() -> bool:
    """Whether the compiled CPU kernel is usable (builds it on first call, about a second)."""
    return cpu_kernels() is not None


def _launch(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
            block_size: int, num_kv_heads: int, scale: float, window: int | None, dk: int, dv: int,
            key_head_stride: int, value_offset: int, value_head_stride: int) -> torch.Tensor:
    lib = cpu_kernels()
    if lib is None:
        raise CpuKernelUnavailableError(f"the CPU paged-attention kernel is unavailable: {cpu_kernels_error()}")
    if q.device.type != "cpu":
        raise KernelInputError(f"q is on device {q.device}; this kernel needs CPU tensors")
    if q.dtype not in _DTYPES:
        raise KernelInputError(f"q must be float32 or bfloat16 for the CPU kernel, got {q.dtype}")
    if q.stride(-1) != 1 or cache.stride(-1) != 1:
        raise KernelInputError(f"q and cache need unit stride in their last dim, got {q.stride()} and {cache.stride()}")
    S, hq, _ = q.shape
    out = torch.empty(S, hq, dv, dtype=q.dtype)
    if S == 0:
        return out
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    bad = lib.batchgen_paged_decode(
        _DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1), cache.data_ptr(), cache.stride(0),
        cache.shape[0], tables.data_ptr(), tables.stride(0), tables.shape[1], lens.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1), S, hq, num_kv_heads, dk, dv, key_head_stride,
        value_offset, value_head_stride, block_size, window or 0, float(scale), torch.get_num_threads())
    if bad:
        s = bad - 1
        raise KernelInputError(
            f"sequence {s}: context_lens {int(lens[s])} does not fit its table of {tables.shape[1]} blocks of "
            f"{block_size}, or the table names a block outside the cache's {cache.shape[0] // block_size} blocks")
    return out


def paged_attention_gqa_cpu(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, block_size: int, num_kv_heads: int, scale: float,
                            window: int | None = None) -> torch.Tensor:
    """GQA/MHA decode attention over the paged cache on CPU; `paged_attention_gqa_reference`'s
    result up to fp32 rounding.

    q: [S, Hq, D] (unit last stride, any row/head strides); cache: [slots, 2 Hk D] (K of every kv
    head, then V); block_tables: [S, MB] int32/int64; context_lens: [S] (>= 1, the new token
    included, its KV already written) -> [S, Hq, D]. window: only the last `window` positions.
    """
    S, hq, d = check_gqa_inputs(q, cache, block_tables, context_lens, block_size, num_kv_heads, window)
    hk = num_kv_heads
    return _launch(q, cache, block_tables, context_lens, block_size, hk, scale, window, d, d,
                   key_head_stride=d, value_offset=hk * d, value_head_stride=d)


def paged_attention_mla_cpu(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, block_size: int, kv_lora_rank: int,
                            scale: float) -> torch.Tensor:
    """MLA decode attention over the latent cache on CPU (DeepSeek's absorbed form); the result
    of `paged_attention_mla_reference` up to fp32 rounding.

    q: [S, Hq, R + P] (latent query, then rope query); cache: [slots, R + P] (latent, then the
    rotated shared key) -> [S, Hq, R]. One kv head: its key is the whole row, its value the latent.
    """
    S, hq, w = check_mla_inputs(q, cache, block_tables, context_lens, block_size, kv_lora_rank)
    return _launch(q, cache, block_tables, context_lens, block_size, 1, scale, None, w, kv_lora_rank,
                   key_head_stride=0, value_offset=0, value_head_stride=0)
