"""Plain-torch paged decode attention: the semantics the Triton kernel is tested against.

# S sequences, Hq query heads, Hk kv heads (G = Hq / Hk), D head dim, MB blocks per table
The cache is one layer's [slots, W] with slot = block * block_size + offset; a sequence's
context positions 0 .. L-1 live at block_tables[s, p // block_size] * block_size + p % block_size.
Two layouts of a cache row:
  GQA:  [K of kv head 0 .. Hk-1 | V of kv head 0 .. Hk-1], each D wide (W = 2 Hk D)
  MLA:  [latent (kv_lora_rank) | rotated shared key (rope)]; one kv head whose key is the whole
        row and whose value is the latent (DeepSeek's absorbed decode form)
"""
from __future__ import annotations

import torch

from ._paged_checks import check_paged_inputs
from .errors import KernelInputError


def _context_slots(block_tables: torch.Tensor, length: int, block_size: int, s: int) -> torch.Tensor:
    pos = torch.arange(length, device=block_tables.device)
    return block_tables[s, pos // block_size].long() * block_size + pos % block_size


def _decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [Hq, Dk]; keys: [L, Hk, Dk]; values: [L, Hk, Dv] -> [Hq, Dv] (fp32 math)."""
    g = q.shape[0] // keys.shape[1]
    k = keys.float().repeat_interleave(g, dim=1)  # [L, Hq, Dk]
    v = values.float().repeat_interleave(g, dim=1)
    probs = (torch.einsum("hd,lhd->hl", q.float(), k) * scale).softmax(dim=-1)
    return torch.einsum("hl,lhd->hd", probs, v)


def paged_attention_gqa_reference(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                                  context_lens: torch.Tensor, block_size: int, num_kv_heads: int,
                                  scale: float, window: int | None = None) -> torch.Tensor:
    """q: [S, Hq, D]; cache: [slots, 2 Hk D]; block_tables: [S, MB] int; context_lens: [S] int
    (>= 1) -> [S, Hq, D] in q's dtype. window: attend only the last `window` positions."""
    S, hq, d = check_paged_inputs(q, cache, block_tables, context_lens, block_size)
    hk = num_kv_heads
    if hq % hk or cache.shape[1] != 2 * hk * d:
        raise KernelInputError(f"GQA cache rows must be 2 * {hk} kv heads * {d} = {2 * hk * d} wide with "
                         f"{hq} % {hk} == 0, got width {cache.shape[1]}")
    out = q.new_empty(S, hq, d)
    for s, length in enumerate(context_lens.tolist()):
        rows = cache[_context_slots(block_tables, length, block_size, s)]  # [L, W]
        k, v = rows[:, :hk * d].unflatten(1, (hk, d)), rows[:, hk * d:].unflatten(1, (hk, d))
        if window is not None:
            k, v = k[-window:], v[-window:]
        out[s] = _decode(q[s], k, v, scale).to(q.dtype)
    return out


def paged_attention_mla_reference(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                                  context_lens: torch.Tensor, block_size: int, kv_lora_rank: int,
                                  scale: float) -> torch.Tensor:
    """q: [S, Hq, R + P] (the absorbed query: latent part, then rope part); cache: [slots, R + P]
    -> [S, Hq, R]: attention over the latent, before kv_b_proj's value half is applied."""
    S, hq, w = check_paged_inputs(q, cache, block_tables, context_lens, block_size)
    if cache.shape[1] != w or not 0 < kv_lora_rank < w + 1:
        raise KernelInputError(f"MLA cache rows must be q's width {w} with 0 < kv_lora_rank <= {w}, "
                         f"got width {cache.shape[1]}, kv_lora_rank {kv_lora_rank}")
    out = q.new_empty(S, hq, kv_lora_rank)
    for s, length in enumerate(context_lens.tolist()):
        rows = cache[_context_slots(block_tables, length, block_size, s)].unsqueeze(1)  # [L, 1, R + P]
        out[s] = _decode(q[s], rows, rows[..., :kv_lora_rank], scale).to(q.dtype)
    return out
