"""Ulysses self-attention for Wan's blocks (WanAttention): diffusers' WanAttnProcessor on a token
shard, the rotary table sharded like the tokens, all-to-all over heads around attention.

Shapes: B batch, n_me tokens on this member of N, H heads of D, k members (H / k heads each).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from .sp import UlyssesShard, self_attention_processors


def wan_attention(shard: UlyssesShard, model: Any) -> contextlib.AbstractContextManager[None]:
    """Every Wan block's self-attention (attn1) runs on the shard's tokens; cross-attention and
    the feed-forward work per token and run as they are."""
    return self_attention_processors(model.blocks, _UlyssesWanProcessor(shard))


def apply_wan_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """WanAttnProcessor's apply_rotary_emb: x [B, n, H, D], cos / sin [1, n, 1, D] (per token;
    the packed forward passes [1, T, H, D] with a row per token)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class _UlyssesWanProcessor:
    def __init__(self, shard: UlyssesShard) -> None:
        self.shard = shard

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None or rotary_emb is None:
            raise NotImplementedError("Ulysses Wan processor: rotary self-attention without a mask only")
        if attn.fused_projections:
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)  # across heads, per token: local
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))          # [B, n_me, H, D]
        q, k = apply_wan_rotary(q, *rotary_emb), apply_wan_rotary(k, *rotary_emb)
        q, k, v = (self.shard.heads_to_tokens(t).transpose(1, 2) for t in (q, k, v))  # [B, H/k, N, D]
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        out = self.shard.tokens_to_heads(out.transpose(1, 2)).flatten(2, 3).type_as(q)  # [B, n_me, H D]
        return attn.to_out[1](attn.to_out[0](out))
