"""DeepSeek multi-head latent attention over the paged cache.

The cache holds the compressed latent per token: [kv_lora_rank] (after kv_a_layernorm) followed by
the rotated shared key [rope_dim] — kv_lora_rank + rope_dim floats instead of 2 Hq D.

Prefill chunks expand keys and values from the latent (kv_b_proj) and attend as usual. Decoding
tokens use the absorbed form instead: kv_b_proj's key half is folded into the query and its value
half applied after attention, so every head attends the latent itself (one shared key/value
head of width kv_lora_rank + rope_dim) and nothing is expanded per context token. That is the
same function regrouped: per step it costs O(heads x context x kv_lora_rank) instead of
O(heads x context x kv_lora_rank x (nope + v)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import AttentionBatch, OutputRows, paged_attention
from .cuda_decode import DecodeTables, mla_decode
from .layers import rms_norm
from .rope import RotaryEmbedding
from .spec import MLASpec
from .weights import MLAWeights

# transformers builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def mla_attention(x: torch.Tensor, w: MLAWeights, a: MLASpec, rotary: RotaryEmbedding, batch: AttentionBatch,
                  cache: torch.Tensor, eps: float, rows: OutputRows | None = None) -> torch.Tensor:
    """x: [T, H] (already normed) -> [T, H], or [R, H] of the R `rows` alone (their output
    projection only: the prompt rows keep the expanded form transformers computes, which the
    decode rows' absorbed form would only match within rounding); writes the latent of this
    batch's tokens into cache [slots, W].

    eps is the model's rms_norm_eps, unused here: the latent norms use LATENT_NORM_EPS.
    """
    T, h = x.shape[0], a.num_heads
    nope, rope_dim, r = a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
    if w.q is not None:
        q = F.linear(x, w.q)
    else:
        q = F.linear(rms_norm(F.linear(x, w.q_a, w.q_a_bias), w.q_a_norm, LATENT_NORM_EPS), w.q_b)
    q = q.reshape(T, h, nope + rope_dim)
    tables = batch.rope_tables(rotary)
    q = torch.cat([q[..., :nope], rotary.apply(q[..., nope:], batch.positions, tables)], dim=-1)
    latent, k_pe = F.linear(x, w.kv_a, w.kv_a_bias).split([r, rope_dim], dim=-1)
    latent = rms_norm(latent, w.kv_a_norm, LATENT_NORM_EPS)
    k_pe = rotary.apply(k_pe.unsqueeze(1), batch.positions, tables).squeeze(1)
    new_rows = torch.cat([latent, k_pe], dim=-1).to(cache.dtype)  # [T, r + rope]
    cache.index_copy_(0, batch.slot_mapping, new_rows)

    def expand(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = F.linear(rows[..., :r], w.kv_b).unflatten(-1, (h, nope + a.v_head_dim))  # [..., L, Hq, nope + v]
        k_nope, v = kv.split([nope, a.v_head_dim], dim=-1)
        pe = rows[..., r:].unsqueeze(-2).expand(*k_nope.shape[:-1], rope_dim)
        return torch.cat([k_nope, pe], dim=-1), v

    kv_b = w.kv_b.view(h, nope + a.v_head_dim, r)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # [Hq, nope, r], [Hq, v, r]

    def decode(q_rows: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q_rows [Sg, Hq, nope + rope], rows [Sg, L, r + rope], allowed [Sg, 1, L] -> [Sg, Hq, v]."""
        q_latent = torch.einsum("shn,hnr->shr", q_rows[..., :nope], w_uk)
        query = torch.cat([q_latent, q_rows[..., nope:]], dim=-1).unsqueeze(2)  # [Sg, Hq, 1, r + rope]
        keys = rows.unsqueeze(1).expand(-1, h, -1, -1)  # one shared head: a view, not a copy
        values = keys[..., :r]
        mask = allowed.unsqueeze(1)  # [Sg, 1, 1, L]
        o_latent = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=a.softmax_scale)
        return torch.einsum("shr,hvr->shv", o_latent.squeeze(2), w_uv)

    def paged(q_rows: torch.Tensor, kv: torch.Tensor, t: DecodeTables) -> torch.Tensor:
        """The same absorbed form, the latent read in place by the paged kernel."""
        q_latent = torch.einsum("shn,hnr->shr", q_rows[..., :nope], w_uk)
        query = torch.cat([q_latent, q_rows[..., nope:]], dim=-1)  # [Sd, Hq, r + rope]
        o_latent = mla_decode(query, kv, t, r, a.softmax_scale)
        return torch.einsum("shr,hvr->shv", o_latent, w_uv)

    out = paged_attention(q, batch, cache, expand, a.softmax_scale, None, a.v_head_dim, decode, paged, new_rows)
    out = out.reshape(T, h * a.v_head_dim)
    return F.linear(out if rows is None else out[rows.index], w.o, w.o_bias)
