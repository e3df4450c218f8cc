"""Launchers of the Triton paged decode attention: check inputs, pick tile sizes, compute the
grid. The kernel lives in `_triton_paged_attention.py`, imported on first use so this module
imports without triton; the semantics are `paged_attention_reference.py`'s.

# S sequences, Hq query heads, Hk kv heads (G = Hq / Hk), D head dim, MB blocks per table
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from ._paged_checks import check_gqa_inputs, check_mla_inputs
from .errors import KernelInputError, TritonUnavailableError

# Tile sizes: tl.dot needs every dim >= 16 when compiled. BLOCK_N context tokens per iteration,
# independent of the cache's block size (each token's slot is looked up in its table).
BLOCK_H = 16
BLOCK_N = 32


def _kernels() -> ModuleType:
    try:
        return importlib.import_module("._triton_paged_attention", __package__)
    except ImportError as exc:
        raise TritonUnavailableError(
            "paged decode attention needs triton (pip install triton; a CUDA GPU, or TRITON_INTERPRET=1 "
            f"for the CPU interpreter); without it use the references. Import failed with: {exc}") from exc


def _interpreting(kernels: ModuleType) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernels.paged_decode_kernel, InterpretedFunction)


def _tile(n: int) -> int:
    return max(16, 1 << max(0, n - 1).bit_length())


def _check_launch(kernels: ModuleType, q: torch.Tensor, cache: torch.Tensor) -> None:
    if not (q.is_cuda or _interpreting(kernels)):
        raise KernelInputError(f"q is on device {q.device}; the Triton kernel needs CUDA tensors (on CPU use "
                               "the references, or set TRITON_INTERPRET=1 before importing triton)")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise KernelInputError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if q.dtype == torch.bfloat16 and _interpreting(kernels):
        raise KernelInputError("bfloat16 is not supported by Triton's interpreter (triton-lang/triton#11584); "
                               "use float16/float32 there, or run on CUDA")
    if q.stride(-1) != 1 or cache.stride(-1) != 1:
        raise KernelInputError(f"q and cache need unit stride in their last dim, got {q.stride()} and {cache.stride()}")


def _launch(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
            block_size: int, num_kv_heads: int, scale: float, window: int | None, d1: int, d2: int, dv: int,
            key_head_stride: int, value_offset: int, value_head_stride: int, value_is_key: bool) -> torch.Tensor:
    kernels = _kernels()
    _check_launch(kernels, q, cache)
    S, hq, _ = q.shape
    group = hq // num_kv_heads
    out = torch.empty(S, hq, dv, dtype=q.dtype, device=q.device)
    if S == 0:
        return out
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    grid = (S, num_kv_heads, -(-group // BLOCK_H))
    kernels.paged_decode_kernel[grid](
        q, cache, block_tables, context_lens, out,
        q.stride(0), q.stride(1), cache.stride(0), block_tables.stride(0), out.stride(0), out.stride(1),
        block_size, window or 0, float(scale), group, key_head_stride, value_offset, value_head_stride,
        d1, d2, dv,
        BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_D1=_tile(d1), BLOCK_D2=_tile(max(d2, 1)), BLOCK_DV=_tile(dv),
        HAS_D2=d2 > 0, VALUE_IS_KEY=value_is_key, FP32_IEEE=q.dtype == torch.float32,
    )
    return out


def paged_attention_gqa(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, block_size: int, num_kv_heads: int, scale: float,
                        window: int | None = None) -> torch.Tensor:
    """Triton GQA/MHA decode attention over the paged cache; `paged_attention_gqa_reference`'s
    result up to rounding.

    q: [S, Hq, D] (unit last stride); cache: [slots, 2 Hk D] (K of every kv head, then V);
    block_tables: [S, MB] int32/int64; context_lens: [S] (>= 1, the new token included, its KV
    already written) -> [S, Hq, D]. window: only the last `window` positions (sliding window).
    """
    S, hq, d = check_gqa_inputs(q, cache, block_tables, context_lens, block_size, num_kv_heads, window)
    hk = num_kv_heads
    return _launch(q, cache, block_tables, context_lens, block_size, hk, scale, window, d, 0, d,
                   key_head_stride=d, value_offset=hk * d, value_head_stride=d, value_is_key=False)


def paged_attention_mla(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, block_size: int, kv_lora_rank: int,
                        scale: float) -> torch.Tensor:
    """Triton MLA decode attention over the latent cache (DeepSeek's absorbed form); the
    result of `paged_attention_mla_reference` up to rounding.

    q: [S, Hq, R + P] (latent query, then rope query); cache: [slots, R + P] (latent, then the
    rotated shared key) -> [S, Hq, R]. Every query head attends the one shared latent head;
    the latent tile is loaded once as key and value.
    """
    S, hq, w = check_mla_inputs(q, cache, block_tables, context_lens, block_size, kv_lora_rank)
    r = kv_lora_rank
    return _launch(q, cache, block_tables, context_lens, block_size, 1, scale, None, r, w - r, r,
                   key_head_stride=0, value_offset=0, value_head_stride=0, value_is_key=True)
