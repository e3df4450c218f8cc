"""Shape and dtype checks shared by the paged-attention reference and its Triton and CPU launchers."""
from __future__ import annotations

import torch

from .errors import KernelInputError


def check_paged_inputs(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, block_size: int) -> tuple[int, int, int]:
    """-> (S, Hq, Dq). q: [S, Hq, Dq]; cache: [slots, W]; block_tables: [S, MB]; context_lens: [S]."""
    if q.dim() != 3:
        raise KernelInputError(f"q must be [S, Hq, D], got shape {tuple(q.shape)}")
    S, hq, d = q.shape
    if not q.dtype.is_floating_point or cache.dtype != q.dtype:
        raise KernelInputError(f"q and cache must share one floating dtype, got {q.dtype} and {cache.dtype}")
    if cache.dim() != 2:
        raise KernelInputError(f"cache must be one layer's [slots, W], got shape {tuple(cache.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != S:
        raise KernelInputError(f"block_tables must be [S, MB] with S={S} (from q), got shape "
                               f"{tuple(block_tables.shape)}")
    if tuple(context_lens.shape) != (S,):
        raise KernelInputError(f"context_lens must be [S] with S={S}, got shape {tuple(context_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise KernelInputError(f"{name} must be int32 or int64, got dtype {t.dtype}")
        if t.device != q.device:
            raise KernelInputError(f"{name} must be on q's device {q.device}, got {t.device}")
    if cache.device != q.device:
        raise KernelInputError(f"cache must be on q's device {q.device}, got {cache.device}")
    if not isinstance(block_size, int) or block_size < 1:
        raise KernelInputError(f"block_size must be a positive int, got {block_size!r}")
    return S, hq, d


def check_gqa_inputs(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     block_size: int, num_kv_heads: int, window: int | None) -> tuple[int, int, int]:
    """check_paged_inputs, plus a GQA cache row of 2 * Hk * D (K then V) and Hq a multiple of Hk
    -> (S, Hq, D)."""
    S, hq, d = check_paged_inputs(q, cache, block_tables, context_lens, block_size)
    hk = num_kv_heads
    if hk < 1 or hq % hk or cache.shape[1] != 2 * hk * d:
        raise KernelInputError(f"GQA cache rows must be 2 * {hk} kv heads * {d} = {2 * hk * d} wide with "
                               f"{hq} query heads a multiple of {hk}, got width {cache.shape[1]}")
    if window is not None and window < 1:
        raise KernelInputError(f"window must be >= 1 or None, got {window}")
    return S, hq, d


def check_mla_inputs(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     block_size: int, kv_lora_rank: int) -> tuple[int, int, int]:
    """check_paged_inputs, plus a latent cache row as wide as q and 0 < kv_lora_rank <= it
    -> (S, Hq, R + P)."""
    S, hq, w = check_paged_inputs(q, cache, block_tables, context_lens, block_size)
    if cache.shape[1] != w or not 0 < kv_lora_rank <= w:
        raise KernelInputError(f"MLA cache rows must be q's width {w} with 0 < kv_lora_rank <= {w}, "
                               f"got width {cache.shape[1]}, kv_lora_rank {kv_lora_rank}")
    return S, hq, w
