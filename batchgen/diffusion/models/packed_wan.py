"""Token-packed Wan 2.1 forward: videos of several latent shapes (frame counts, sizes) in one
forward, as packed.py does for DiT and PixArt.

In a WanTransformerBlock everything but attention works per token: the linear layers, the
q/k RMS norms (across heads, per token), the rotary rotation (a per-token table), the layer
norms and the feed-forward. The timestep modulation works per sample, and the block already
takes it per token (its [B, N, 6, D] form, which Wan 2.2 TI2V uses). So the videos' tokens are
concatenated into one [1, T, D] sequence with each token's rotary row and modulation, and only
attention runs per part (one latent shape) over views of it: self-attention within each
video, cross-attention from each video's tokens to its own text rows. A step is one forward
instead of one per latent shape.

The arithmetic is diffusers' WanTransformer3DModel / WanTransformerBlock / WanAttnProcessor op
for op (Wan 2.1: one timestep per sample, no image context); a video's numbers differ from its
forward alone only by GEMM blocking, as for any change of batch.

Shapes: parts i = 1..P, part i has B_i samples of N_i = F'_i h_i w_i / (p_t p_h p_w) tokens;
R = sum B_i samples; T = sum B_i N_i tokens; D width; H heads of hd; L text tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..parallel.sp_wan import apply_wan_rotary
from .packed_parts import PackedLayout

Part = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def wan_packable(transformer: Any) -> str | None:
    """None when the packed forward runs this WanTransformer3DModel, else why not."""
    if getattr(transformer.config, "image_dim", None) is not None:
        return "the transformer takes image context (Wan I2V)"
    for n, block in enumerate(transformer.blocks):
        for a in (block.attn1, block.attn2):
            if type(a.processor).__name__ != "WanAttnProcessor":
                return f"block {n} attention processor is {type(a.processor).__name__}"
            if getattr(a, "fused_projections", False) or a.add_k_proj is not None:
                return f"block {n} attention has fused or added key/value projections"
    return None


def predict_wan_packed(pipe: Any, parts: Sequence[Part]) -> list[torch.Tensor]:
    """parts: (x [B_i, C, F'_i, h_i, w_i], t [B_i], {"embeds": [B_i, L, D_text]}) -> the predicted
    velocity [B_i, C, F'_i, h_i, w_i] per part, from one packed forward."""
    m = pipe.transformer
    xs = [x.to(m.dtype) for x, _, _ in parts]
    embedded = [m.patch_embedding(x).flatten(2).transpose(1, 2) for x in xs]    # [B_i, N_i, D]
    sizes = [(h.shape[0], h.shape[1]) for h in embedded]
    layout = PackedLayout.of(sizes, xs[0].device)
    owner, spans = layout.owner, list(layout.parts)
    hs = torch.cat([h.reshape(-1, h.shape[-1]) for h in embedded])[None]       # [1, T, D]
    rotary = [m.rope(x) for x in xs]                                            # ([1, N_i, 1, hd],) * 2
    cos = torch.cat([c.expand(b, -1, -1, -1).reshape(b * n, 1, -1) for (c, _), (b, n) in zip(rotary, sizes)])[None]
    sin = torch.cat([s.expand(b, -1, -1, -1).reshape(b * n, 1, -1) for (_, s), (b, n) in zip(rotary, sizes)])[None]
    t = torch.cat([t for _, t, _ in parts])
    temb, proj, enc, _ = m.condition_embedder(t, torch.cat([c["embeds"] for _, _, c in parts]), None)
    proj = proj.unflatten(1, (6, -1)).index_select(0, owner)[None]            # [1, T, 6, D]
    for block in m.blocks:
        hs = _block(block, hs, enc, proj, (cos, sin), spans)
    shift, scale = (m.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)  # [R, 1, D]
    shift, scale = shift[:, 0].index_select(0, owner)[None], scale[:, 0].index_select(0, owner)[None]
    hs = m.proj_out((m.norm_out(hs.float()) * (1 + scale) + shift).type_as(hs))[0]  # [T, p_t p_h p_w C]
    p_t, p_h, p_w = m.config.patch_size
    outs = []
    for (start, _, b, n), x in zip(spans, xs):
        _, _, frames, height, width = x.shape
        o = hs[start:start + b * n].reshape(b, frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
        outs.append(o.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3))
    return outs


def _block(block: Any, hs: torch.Tensor, enc: torch.Tensor, proj: torch.Tensor,
           rotary: tuple[torch.Tensor, torch.Tensor], spans: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """WanTransformerBlock.forward with per-token modulation and attention per part."""
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
        block.scale_shift_table.unsqueeze(0) + proj.float()).chunk(6, dim=2)
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
        v.squeeze(2) for v in (shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa))
    x = (block.norm1(hs.float()) * (1 + scale_msa) + shift_msa).type_as(hs)
    hs = (hs.float() + _self_attention(block.attn1, x, rotary, spans) * gate_msa).type_as(hs)
    x = block.norm2(hs.float()).type_as(hs)
    hs = hs + _cross_attention(block.attn2, x, enc, spans)
    x = (block.norm3(hs.float()) * (1 + c_scale_msa) + c_shift_msa).type_as(hs)
    return (hs.float() + block.ffn(x).float() * c_gate_msa).type_as(hs)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[b, n, H, hd] queries over [b, m, H, hd] keys -> [b, n, H hd] (diffusers' native backend)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         dropout_p=0.0, is_causal=False)
    return out.transpose(1, 2).flatten(2, 3)


def _self_attention(a: Any, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                    spans: list[tuple[int, int, int, int]]) -> torch.Tensor:
    q, k, v = a.norm_q(a.to_q(x)), a.norm_k(a.to_k(x)), a.to_v(x)           # [1, T, H hd]
    q, k, v = (z.unflatten(2, (a.heads, -1)) for z in (q, k, v))             # [1, T, H, hd]
    q, k = apply_wan_rotary(q, *rotary), apply_wan_rotary(k, *rotary)
    outs = []
    for start, _, b, n in spans:
        span = slice(start, start + b * n)
        outs.append(_attend(*(z[0, span].reshape(b, n, a.heads, -1) for z in (q, k, v))).reshape(b * n, -1))
    out = torch.cat(outs)[None].type_as(q)
    return a.to_out[1](a.to_out[0](out))


def _cross_attention(a: Any, x: torch.Tensor, enc: torch.Tensor, spans: list[tuple[int, int, int, int]]
                     ) -> torch.Tensor:
    q = a.norm_q(a.to_q(x)).unflatten(2, (a.heads, -1))                      # [1, T, H, hd]
    k = a.norm_k(a.to_k(enc)).unflatten(2, (a.heads, -1))                    # [R, L, H, hd]
    v = a.to_v(enc).unflatten(2, (a.heads, -1))
    outs = []
    for start, row, b, n in spans:
        queries = q[0, start:start + b * n].reshape(b, n, a.heads, -1)
        outs.append(_attend(queries, k[row:row + b], v[row:row + b]).reshape(b * n, -1))
    out = torch.cat(outs)[None].type_as(q)
    return a.to_out[1](a.to_out[0](out))
