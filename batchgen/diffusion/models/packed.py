"""Token-packed transformer forward: trajectories of several latent shapes in one forward.

In a DiT or PixArt block every op but attention works per token (the linear layers, the layer
norms, the feed-forward) or per sample (the timestep / class modulation). So the images' tokens
are concatenated into one [T, D] matrix, each sample's modulation is gathered onto its tokens,
and attention runs per part (one latent shape) over views of the same matrix. A worker's step
is then one forward, not one per latent shape: the forward's fixed cost (op dispatch on a CPU,
kernel launches on a GPU) is paid once and the GEMMs are larger.

The arithmetic is diffusers' BasicTransformerBlock's (norm_type "ada_norm_zero": DiT;
"ada_norm_single": PixArt) op for op, and its attention is AttnProcessor2_0's. `packable` says
which transformers qualify; forward.predict sends every degree-1 forward of one here (a single
part when all rows share a shape), so a trajectory's numbers do not depend on whether rows of
other shapes shared its forward, beyond GEMM blocking (as for any change of batch).

Shapes: parts i = 1..P, part i has B_i samples of N_i = h_i w_i / p^2 tokens; R = sum B_i
samples; T = sum B_i N_i tokens; D hidden; H heads of size hd; L text tokens (PixArt).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .packed_flux import flux_packable, predict_flux_packed
from .packed_parts import PackedLayout, join, merge_heads, self_attention, split_heads, unpatchify
from .packed_sd3 import predict_sd3_packed, sd3_packable
from .packed_wan import predict_wan_packed, wan_packable
from .wan_experts import per_expert

_NORMS = ("ada_norm_zero", "ada_norm_single")


def packable(transformer: Any) -> str | None:
    """None when every block can run packed, else why not (that transformer keeps diffusers'
    own block forward, one forward per latent shape). Wan: packed_wan.py, SD3: packed_sd3.py, Flux: packed_flux.py."""
    if type(transformer).__name__ == "WanTransformer3DModel":
        return wan_packable(transformer)
    if type(transformer).__name__ == "SD3Transformer2DModel":
        return sd3_packable(transformer)
    if type(transformer).__name__ == "FluxTransformer2DModel":
        return flux_packable(transformer)
    blocks = getattr(transformer, "transformer_blocks", None)
    if not blocks:
        return "the transformer has no transformer_blocks"
    for n, b in enumerate(blocks):
        where = f"block {n}"
        if type(b).__name__ != "BasicTransformerBlock":
            return f"{where} is a {type(b).__name__}, not a BasicTransformerBlock"
        if b.norm_type not in _NORMS:
            return f"{where} has norm_type {b.norm_type!r} (packed: {', '.join(_NORMS)})"
        if b.norm_type == "ada_norm_zero" and b.attn2 is not None:
            return f"{where}: cross-attention with ada_norm_zero"
        if b.pos_embed is not None or b.only_cross_attention or b._chunk_size is not None \
                or getattr(b, "attention_type", "default") != "default":
            return f"{where} uses a block option the packed forward does not run (pos_embed, " \
                   "only_cross_attention, chunked feed-forward or gated attention)"
        for a in (b.attn1, b.attn2):
            if a is None:
                continue
            if type(a.processor).__name__ != "AttnProcessor2_0":
                return f"{where} attention processor is {type(a.processor).__name__}"
            if a.norm_q is not None or a.norm_k is not None or a.spatial_norm is not None or a.group_norm is not None \
                    or a.residual_connection or a.rescale_output_factor != 1.0 or a.norm_cross is not None:
                return f"{where} attention uses q/k, spatial, group or cross norm, a residual or a rescale"
    return None


def predict_packed(pipe: Any, parts: Sequence[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]
                   ) -> list[torch.Tensor]:
    """parts: (x [B_i, C, h_i, w_i], t [B_i], cond) as forward.predict takes them -> the model
    output [B_i, C_out, h_i, w_i] per part, from one packed forward (Wan: x [B_i, C, F'_i, h_i, w_i])."""
    if pipe.transformer_2 is not None:  # Wan 2.2: each expert's rows in a packed forward of its own
        return per_expert(pipe, parts, predict_wan_packed)
    if pipe.family == "wan":
        return predict_wan_packed(pipe, parts)
    if pipe.family == "sd3":
        return predict_sd3_packed(pipe, parts)
    if pipe.family == "flux":
        return predict_flux_packed(pipe, parts)
    m = pipe.transformer
    embedded = [m.pos_embed(x) for x, _, _ in parts]                     # [B_i, N_i, D]
    layout = PackedLayout.of([(h.shape[0], h.shape[1]) for h in embedded], embedded[0].device)
    hs = join([h.reshape(-1, h.shape[-1]) for h in embedded])            # [T, D]
    t = join([t for _, t, _ in parts])
    cond = {k: join([c[k] for _, _, c in parts]) for k, v in parts[0][2].items() if v is not None}
    if pipe.family == "dit":
        hs = _dit(m, hs, t, cond["class_labels"], layout)
    else:
        hs = _pixart(m, hs, t, cond, layout)
    return unpatchify(hs, layout, [x.shape[-2:] for x, _, _ in parts], pipe.patch_size, m.out_channels)


def _dit(m: Any, hs: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    tok = layout.per_token
    for block in m.transformer_blocks:
        n1 = block.norm1  # AdaLayerNormZero
        emb = n1.linear(n1.silu(n1.emb(t, labels, hidden_dtype=hs.dtype)))   # [R, 6D]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        x = n1.norm(hs) * tok(1 + scale_msa) + tok(shift_msa)
        hs = tok(gate_msa) * self_attention(block.attn1, x, layout) + hs
        x = block.norm3(hs) * tok(1 + scale_mlp) + tok(shift_mlp)
        hs = tok(gate_mlp) * block.ff(x) + hs
    conditioning = m.transformer_blocks[0].norm1.emb(t, labels, hidden_dtype=hs.dtype)
    shift, scale = m.proj_out_1(F.silu(conditioning)).chunk(2, dim=1)
    hs = m.norm_out(hs) * tok(1 + scale) + tok(shift)
    return m.proj_out_2(hs)                                               # [T, p*p*C_out]


def _pixart(m: Any, hs: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], layout: PackedLayout) -> torch.Tensor:
    tok = layout.per_token
    rows = t.shape[0]
    enc_bias = ((1 - cond["mask"].to(hs.dtype)) * -10000.0).unsqueeze(1)   # [R, 1, L]
    added = {"resolution": cond.get("resolution"), "aspect_ratio": cond.get("aspect_ratio")}
    tt, emb_t = m.adaln_single(t, added, batch_size=rows, hidden_dtype=hs.dtype)
    enc = cond["embeds"]
    if m.caption_projection is not None:
        enc = m.caption_projection(enc).view(rows, -1, hs.shape[-1])      # [R, L, D]
    for block in m.transformer_blocks:
        mods = block.scale_shift_table[None] + tt.reshape(rows, 6, -1)   # [R, 6, D]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods.chunk(6, dim=1)
        x = block.norm1(hs) * tok(1 + scale_msa) + tok(shift_msa)
        hs = tok(gate_msa) * self_attention(block.attn1, x, layout) + hs
        if block.attn2 is not None:
            hs = _cross_attention(block.attn2, hs, enc, enc_bias, layout) + hs
        x = block.norm2(hs) * tok(1 + scale_mlp) + tok(shift_mlp)
        hs = tok(gate_mlp) * block.ff(x) + hs
    shift, scale = (m.scale_shift_table[None] + emb_t[:, None]).chunk(2, dim=1)
    hs = m.norm_out(hs)
    hs = hs * tok(1 + scale) + tok(shift)
    return m.proj_out(hs)


def _cross_attention(a: Any, x: torch.Tensor, enc: torch.Tensor, bias: torch.Tensor, layout: PackedLayout
                     ) -> torch.Tensor:
    q = a.to_q(x)                                                         # [T, H * hd]
    k, v = a.to_k(enc), a.to_v(enc)                                       # [R, L, H * hd]
    length = enc.shape[1]
    outs = []
    for start, row, b, n in layout.parts:
        mask = a.prepare_attention_mask(bias[row:row + b], length, b).view(b, a.heads, -1, length)
        outs.append(F.scaled_dot_product_attention(
            split_heads(q[start:start + b * n], b, a.heads), split_heads(k[row:row + b], b, a.heads),
            split_heads(v[row:row + b], b, a.heads), attn_mask=mask, dropout_p=0.0, is_causal=False))
    return a.to_out[1](a.to_out[0](merge_heads(outs).to(q.dtype)))
