"""Shape and dtype checks shared by the paged-attention reference and its Triton launcher."""
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
