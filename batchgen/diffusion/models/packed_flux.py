"""Token-packed Flux.1 forward: images of several latent shapes in one forward, as packed.py does
for DiT and PixArt and packed_sd3.py for SD3.

Every op of a Flux block but attention works per token (linear layers, layer norms, q/k RMS
norms per head, the feed-forward) or per sample (the timestep, guidance and pooled-text
modulation). The double-stream blocks keep the images' tokens in one [T, D] matrix and the text
stream as a batch [R, L, D]; the single-stream blocks run over each sample's text and image
tokens together, so there the matrix holds, per sample, its L text tokens then its image tokens
(a part of B_i samples has L + N_i tokens each). Attention runs per part (one latent shape):
text tokens first, then the image's, rotated by that shape's rotary table (text positions 0,
image positions its patch row and column), as diffusers builds them.

The arithmetic is diffusers' FluxTransformer2DModel / FluxTransformerBlock /
FluxSingleTransformerBlock / FluxAttnProcessor (native attention) op for op; an image's numbers
differ from its forward alone only by GEMM blocking, as for any change of batch.
`flux_packable` says which transformers qualify.

Shapes: parts i = 1..P, part i has B_i samples of N_i = h_i w_i / 4 tokens (2x2 patches packed
into 4C channels, flux_latents.pack); R = sum B_i; T = sum B_i N_i; D width; H heads of hd; L text tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..parallel.sp_mmdit import apply_flux_rotary
from .flux_latents import image_ids, pack, unpack
from .packed_parts import PackedLayout, join

Part = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]
Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin [L + N_i, hd]


def flux_packable(transformer: Any) -> str | None:
    """None when the packed forward runs this FluxTransformer2DModel, else why not."""
    blocks = [(f"block {n}", b) for n, b in enumerate(transformer.transformer_blocks)] + \
             [(f"single block {n}", b) for n, b in enumerate(transformer.single_transformer_blocks)]
    for where, block in blocks:
        a = block.attn
        processor = a.processor
        if type(processor).__name__ != "FluxAttnProcessor":
            return f"{where} attention processor is {type(processor).__name__}"
        if getattr(a, "fused_projections", False):
            return f"{where} attention has fused projections"
        if getattr(processor, "_attention_backend", None) is not None \
                or getattr(processor, "_parallel_config", None) is not None:
            return f"{where} attention runs on a set backend or parallel config"
    return None


def predict_flux_packed(pipe: Any, parts: Sequence[Part]) -> list[torch.Tensor]:
    """parts: (x [B_i, C, h_i, w_i], t [B_i] (sigma x 1000), {"embeds": [B_i, L, Dj], "pooled":
    [B_i, P]} (+ Flux-dev's "guidance": [B_i])) -> the predicted velocity [B_i, C, h_i, w_i] per
    part, from one packed forward (the inputs mmdit.predict_mmdit gives diffusers' forward)."""
    m = pipe.transformer
    packed = [pack(x) for x, _, _ in parts]                               # [B_i, N_i, 4C]
    layout = PackedLayout.of([(z.shape[0], z.shape[1]) for z in packed], packed[0].device)
    hs = m.x_embedder(join([z.reshape(-1, z.shape[-1]) for z in packed]))  # [T, D]
    dtype = hs.dtype
    timestep = join([t.to(x.dtype) / 1000 for x, t, _ in parts]).to(dtype) * 1000
    pooled = join([c["pooled"] for _, _, c in parts])
    if "guidance" in parts[0][2]:
        guidance = join([c["guidance"] for _, _, c in parts]).to(dtype) * 1000
        temb = m.time_text_embed(timestep, guidance, pooled)             # [R, D]
    else:
        temb = m.time_text_embed(timestep, pooled)
    embeds = join([c["embeds"] for _, _, c in parts])
    enc = m.context_embedder(embeds)                                      # [R, L, D]
    length = enc.shape[1]
    text_ids = torch.zeros(length, 3, device=embeds.device, dtype=embeds.dtype)
    rotary = [m.pos_embed(torch.cat((text_ids, image_ids(x.shape[-2] // 2, x.shape[-1] // 2, x.device, x.dtype))))
              for x, _, _ in parts]
    for block in m.transformer_blocks:
        enc, hs = _double(block, hs, enc, temb, rotary, layout)
    # the single-stream blocks: each sample's text tokens, then its image tokens
    joint = PackedLayout.of([(b, length + n) for _, _, b, n in layout.parts], hs.device)
    width = hs.shape[-1]
    js = join([torch.cat([enc[row:row + b], hs[start:start + b * n].view(b, n, width)], dim=1).reshape(-1, width)
               for start, row, b, n in layout.parts])                    # [R L + T, D]
    for block in m.single_transformer_blocks:
        js = _single(block, js, temb, rotary, joint)
    hs = join([js[start:start + b * n].view(b, n, width)[:, length:].reshape(-1, width)
               for start, _, b, n in joint.parts])                       # [T, D]
    tok = layout.per_token
    norm = m.norm_out  # AdaLayerNormContinuous: scale first, then shift
    scale, shift = norm.linear(norm.silu(temb).to(hs.dtype)).chunk(2, dim=1)
    hs = m.proj_out(norm.norm(hs) * tok(1 + scale) + tok(shift))         # [T, 4C]
    return [unpack(hs[start:start + b * n].view(b, n, -1), x.shape[-2], x.shape[-1])
            for (start, _, b, n), (x, _, _) in zip(layout.parts, parts)]


def _double(block: Any, hs: torch.Tensor, enc: torch.Tensor, temb: torch.Tensor, rotary: list[Rotary],
            layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """FluxTransformerBlock.forward with per-token modulation and attention per part."""
    tok = layout.per_token
    n1 = block.norm1  # AdaLayerNormZero
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = n1.linear(n1.silu(temb)).chunk(6, dim=1)
    x = n1.norm(hs) * tok(1 + scale_msa) + tok(shift_msa)
    c, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(enc, emb=temb)
    a = block.attn
    q, k, v = (z.unflatten(-1, (-1, a.head_dim)) for z in (a.to_q(x), a.to_k(x), a.to_v(x)))  # [T, H, hd]
    q, k = a.norm_q(q), a.norm_k(k)
    cq, ck, cv = (z.unflatten(-1, (-1, a.head_dim)) for z in (a.add_q_proj(c), a.add_k_proj(c), a.add_v_proj(c)))
    cq, ck = a.norm_added_q(cq), a.norm_added_k(ck)                      # [R, L, H, hd]
    length = enc.shape[1]
    images, texts = [], []
    for (start, row, b, n), cos_sin in zip(layout.parts, rotary):
        span, rows = slice(start, start + b * n), slice(row, row + b)
        out = _attend(*(torch.cat([t[rows], z[span].view(b, n, *z.shape[1:])], dim=1)
                        for t, z in ((cq, q), (ck, k), (cv, v))), cos_sin)  # [b, L + n, H hd]
        texts.append(out[:, :length])
        images.append(out[:, length:].reshape(b * n, -1))
    hs = hs + tok(gate_msa) * a.to_out[1](a.to_out[0](join(images)))
    x = block.norm2(hs) * tok(1 + scale_mlp) + tok(shift_mlp)
    hs = hs + tok(gate_mlp) * block.ff(x)
    enc = enc + c_gate_msa.unsqueeze(1) * a.to_add_out(join(texts))
    c = block.norm2_context(enc) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    enc = enc + c_gate_mlp.unsqueeze(1) * block.ff_context(c)
    if enc.dtype == torch.float16:
        enc = enc.clip(-65504, 65504)
    return enc, hs


def _single(block: Any, js: torch.Tensor, temb: torch.Tensor, rotary: list[Rotary], layout: PackedLayout
            ) -> torch.Tensor:
    """FluxSingleTransformerBlock.forward over [R L + T, D] (each sample's text, then image tokens)."""
    tok = layout.per_token
    shift, scale, gate = block.norm.linear(block.norm.silu(temb)).chunk(3, dim=1)  # AdaLayerNormZeroSingle
    x = block.norm.norm(js) * tok(1 + scale) + tok(shift)
    mlp = block.act_mlp(block.proj_mlp(x))
    a = block.attn
    q, k, v = (z.unflatten(-1, (-1, a.head_dim)) for z in (a.to_q(x), a.to_k(x), a.to_v(x)))  # [RL + T, H, hd]
    q, k = a.norm_q(q), a.norm_k(k)
    outs = []
    for (start, _, b, n), cos_sin in zip(layout.parts, rotary):
        span = slice(start, start + b * n)
        outs.append(_attend(*(z[span].view(b, n, *z.shape[1:]) for z in (q, k, v)), cos_sin).reshape(b * n, -1))
    js = js + tok(gate) * block.proj_out(torch.cat([join(outs), mlp], dim=1))
    if js.dtype == torch.float16:
        js = js.clip(-65504, 65504)
    return js


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: Rotary) -> torch.Tensor:
    """FluxAttnProcessor past the projections: [b, S, H, hd] rotated, attended (diffusers' native
    backend) -> [b, S, H hd]."""
    q, k = apply_flux_rotary(q, *cos_sin), apply_flux_rotary(k, *cos_sin)
    out = F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3),
                                         dropout_p=0.0, is_causal=False).permute(0, 2, 1, 3)
    return out.flatten(2, 3).to(q.dtype)

