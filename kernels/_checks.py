"""Shape and dtype checks shared by the reference and the Triton launchers."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import KernelInputError


class MoeShape(NamedTuple):
    """Sizes of one fused-MoE call (T tokens, K hidden, E experts, N expert intermediate,
    A active experts per token)."""

    T: int
    K: int
    E: int
    N: int
    A: int


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_topk_ids(topk_ids: torch.Tensor, name: str = "topk_ids") -> None:
    if topk_ids.dim() != 2:
        raise KernelInputError(f"{name} must be [T, A], got shape {_shape(topk_ids)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(f"{name} must be int32 or int64, got dtype {topk_ids.dtype}")


def check_moe_inputs(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> MoeShape:
    """Check the shapes, dtypes and devices common to every fused-MoE implementation.

    # T tokens, E experts, A active per token, K hidden, N expert intermediate
    x: [T, K]; w13: [E, 2N, K]; w2: [E, K, N]; topk_weights: [T, A]; topk_ids: [T, A].
    """
    if x.dim() != 2:
        raise KernelInputError(f"x must be [T, K], got shape {_shape(x)}")
    T, K = x.shape
    if not x.dtype.is_floating_point:
        raise KernelInputError(f"x must be a floating tensor, got dtype {x.dtype}")
    if w13.dim() != 3 or w13.shape[2] != K or w13.shape[1] % 2 != 0:
        raise KernelInputError(
            f"w13 must be [E, 2N, K] with K={K} (from x) and an even middle dim, "
            f"got shape {_shape(w13)}"
        )
    E, N = w13.shape[0], w13.shape[1] // 2
    if E == 0 or N == 0:
        raise KernelInputError(f"w13 must have E >= 1 and N >= 1, got shape {_shape(w13)}")
    if _shape(w2) != (E, K, N):
        raise KernelInputError(
            f"w2 must be [E, K, N] = {(E, K, N)} (from w13 and x), got shape {_shape(w2)}"
        )
    check_topk_ids(topk_ids)
    A = topk_ids.shape[1]
    if topk_ids.shape[0] != T:
        raise KernelInputError(
            f"topk_ids must be [T, A] with T={T} (from x), got shape {_shape(topk_ids)}"
        )
    if _shape(topk_weights) != (T, A):
        raise KernelInputError(
            f"topk_weights must be [T, A] = {(T, A)} (from topk_ids), got shape {_shape(topk_weights)}"
        )
    if not topk_weights.dtype.is_floating_point:
        raise KernelInputError(f"topk_weights must be a floating tensor, got dtype {topk_weights.dtype}")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype != x.dtype:
            raise KernelInputError(f"{name} must have x's dtype {x.dtype}, got dtype {t.dtype}")
    for name, t in (("w13", w13), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != x.device:
            raise KernelInputError(f"{name} must be on x's device {x.device}, got device {t.device}")
    return MoeShape(T, K, E, N, A)
