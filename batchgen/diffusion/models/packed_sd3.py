"""Token-packed SD3 / SD3.5 forward: images of several latent shapes in one forward, as packed.py
does for DiT and PixArt.

In a JointTransformerBlock the image stream works per token (linear layers, layer norms, q/k
RMS norms per head, the feed-forward) and per sample (the timestep-and-pooled-text modulation),
and the text stream has the same L tokens for every sample. So the images' tokens are
concatenated into one [T, D] matrix with each sample's modulation gathered onto its tokens, the
text stream stays a batch [R, L, D], and only the joint attention runs per part (one latent
shape): each image's tokens with its own text tokens, as diffusers concatenates them. SD3.5's
second, image-only attention (dual-attention blocks) runs per part too.

The arithmetic is diffusers' SD3Transformer2DModel / JointTransformerBlock / JointAttnProcessor2_0
op for op; an image's numbers differ from its forward alone only by GEMM blocking, as for any
change of batch. `sd3_packable` says which transformers qualify.

Shapes: parts i = 1..P, part i has B_i samples of N_i = h_i w_i / p^2 tokens; R = sum B_i; T = sum
B_i N_i; D joint width; H heads of hd; L text tokens; P pooled width; Dj the text encoders' width.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .packed_parts import PackedLayout, join, self_attention, split_heads, unpatchify

Part = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def sd3_packable(transformer: Any) -> str | None:
    """None when the packed forward runs this SD3Transformer2DModel, else why not."""
    for n, block in enumerate(transformer.transformer_blocks):
        if block._chunk_size is not None:
            return f"block {n} uses a chunked feed-forward"
        for a in (block.attn, block.attn2):
            if a is None:
                continue
            if type(a.processor).__name__ != "JointAttnProcessor2_0":
                return f"block {n} attention processor is {type(a.processor).__name__}"
            if getattr(a, "fused_projections", False):
                return f"block {n} attention has fused projections"
    return None


def predict_sd3_packed(pipe: Any, parts: Sequence[Part]) -> list[torch.Tensor]:
    """parts: (x [B_i, C, h_i, w_i], t [B_i], {"embeds": [B_i, L, Dj], "pooled": [B_i, P]}) -> the
    predicted velocity [B_i, C, h_i, w_i] per part, from one packed forward."""
    m = pipe.transformer
    embedded = [m.pos_embed(x) for x, _, _ in parts]                     # [B_i, N_i, D]
    layout = PackedLayout.of([(h.shape[0], h.shape[1]) for h in embedded], embedded[0].device)
    hs = join([h.reshape(-1, h.shape[-1]) for h in embedded])            # [T, D]
    temb = m.time_text_embed(join([t for _, t, _ in parts]), join([c["pooled"] for _, _, c in parts]))  # [R, D]
    enc = m.context_embedder(join([c["embeds"] for _, _, c in parts]))  # [R, L, D]
    for block in m.transformer_blocks:
        enc, hs = _block(block, hs, enc, temb, layout)
    tok = layout.per_token
    norm = m.norm_out  # AdaLayerNormContinuous: scale first, then shift
    scale, shift = norm.linear(norm.silu(temb).to(hs.dtype)).chunk(2, dim=1)
    hs = m.proj_out(norm.norm(hs) * tok(1 + scale) + tok(shift))         # [T, p p C_out]
    return unpatchify(hs, layout, [x.shape[-2:] for x, _, _ in parts], m.config.patch_size, m.out_channels)


def _block(block: Any, hs: torch.Tensor, enc: torch.Tensor, temb: torch.Tensor, layout: PackedLayout
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """JointTransformerBlock.forward with per-token modulation and attention per part."""
    tok = layout.per_token
    n1 = block.norm1  # AdaLayerNormZero, or SD35AdaLayerNormZeroX in a dual-attention block
    emb = n1.linear(n1.silu(temb))
    normed = n1.norm(hs)
    if block.use_dual_attention:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2, gate_msa2 = \
            emb.chunk(9, dim=1)
        x2 = normed * tok(1 + scale_msa2) + tok(shift_msa2)
    else:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    x = normed * tok(1 + scale_msa) + tok(shift_msa)
    if block.context_pre_only:
        c = block.norm1_context(enc, temb)
    else:
        c, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(enc, emb=temb)
    image_out, text_out = _joint_attention(block.attn, x, c, layout)
    hs = hs + tok(gate_msa) * image_out
    if block.use_dual_attention:
        hs = hs + tok(gate_msa2) * self_attention(block.attn2, x2, layout)
    x = block.norm2(hs) * tok(1 + scale_mlp) + tok(shift_mlp)
    hs = hs + tok(gate_mlp) * block.ff(x)
    if block.context_pre_only:
        return enc, hs  # the last block's text stream is not read again
    enc = enc + c_gate_msa.unsqueeze(1) * text_out
    c = block.norm2_context(enc) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    return enc + c_gate_mlp.unsqueeze(1) * block.ff_context(c), hs


def _joint_attention(a: Any, x: torch.Tensor, c: torch.Tensor, layout: PackedLayout
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """JointAttnProcessor2_0 per part: x [T, D] image tokens, c [R, L, D] text tokens -> image
    output [T, D], text output [R, L, D] (None in a context_pre_only block)."""
    q, k, v = a.to_q(x), a.to_k(x), a.to_v(x)                            # [T, H hd]
    rows = c.shape[0]
    cq, ck, cv = (split_heads(z, rows, a.heads) for z in (a.add_q_proj(c), a.add_k_proj(c), a.add_v_proj(c)))
    if a.norm_added_q is not None:
        cq = a.norm_added_q(cq)                                          # [R, H, L, hd]
    if a.norm_added_k is not None:
        ck = a.norm_added_k(ck)
    images, texts = [], []
    for start, row, b, n in layout.parts:
        span = slice(start, start + b * n)
        qs, ks, vs = (split_heads(z[span], b, a.heads) for z in (q, k, v))  # [b, H, n, hd]
        if a.norm_q is not None:
            qs = a.norm_q(qs)
        if a.norm_k is not None:
            ks = a.norm_k(ks)
        rs = slice(row, row + b)
        out = F.scaled_dot_product_attention(torch.cat([qs, cq[rs]], dim=2), torch.cat([ks, ck[rs]], dim=2),
                                             torch.cat([vs, cv[rs]], dim=2), dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(b, -1, a.heads * out.shape[-1]).to(q.dtype)  # [b, n + L, H hd]
        images.append(out[:, :n].reshape(b * n, -1))
        texts.append(out[:, n:])
    text = None if a.context_pre_only else a.to_add_out(join(texts))
    return a.to_out[1](a.to_out[0](join(images))), text
