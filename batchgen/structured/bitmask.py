"""Packed token masks and their application to logits (torch only; no grammar library).

A mask is llguidance's (and xgrammar's) layout: int32 words, bit j of word w set when token
32 * w + j is allowed. Applying it is a per-row elementwise -inf, so it commutes with the
sampler's other elementwise steps (penalties, temperature) and the rows without a grammar are
never touched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TokenBitmask:
    rows: list[int]        # the batch rows the masks belong to, in order
    bits: torch.Tensor     # [G, W] int32 on the CPU, W = ceil(V' / 32)


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bits: [G, W] int32 -> allowed: [G, vocab_size] bool (ids past 32 * W are not allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)     # [G, 32 W]
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(allowed.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """logits: [B, V]; the rows in mask.rows get -inf where their grammar forbids the token.
    In place: the caller's logits are the sampler's own."""
    if not mask.rows:
        return
    V = logits.shape[1]
    rows = torch.tensor(mask.rows, device=logits.device)
    allowed = unpack_bitmask(mask.bits.to(logits.device, non_blocking=True), V)   # [G, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_token_bitmask_reference(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """Plain loop over rows and ids: the reference the vectorised version is tested against."""
    V = logits.shape[1]
    words = mask.bits.tolist()
    for g, row in enumerate(mask.rows):
        for t in range(V):
            w = t // 32
            if w >= len(words[g]) or not (words[g][w] >> (t % 32)) & 1:
                logits[row, t] = float("-inf")
