"""The transformer forward, staged so the token axis is reachable: patch-embed -> (shard tokens)
-> blocks -> output head -> (gather tokens) -> unpatchify. The same code runs degree 1 (sp=None)
and Ulysses sequence parallelism (sp: an sp.UlyssesShard), one timestep per sample. A degree-1
forward of a transformer packed.py can pack runs there instead (one part), like the forwards
that pack several latent shapes, so both see the same arithmetic.

Shapes: B samples (CFG halves included), C latent channels, h x w latent, p patch, N = hw/p^2
tokens, D hidden, L text tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .mmdit import predict_mmdit
from .packed import predict_packed
from .pipeline import MMDIT
from .wan import predict_wan
from .wan_experts import per_expert

if TYPE_CHECKING:
    from ..parallel.sp import UlyssesShard
    from .pipeline import Pipeline


def predict(pipe: Pipeline, x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor],
            sp: UlyssesShard | None = None) -> torch.Tensor:
    """x: [B, C, h, w], t: [B] -> model output [B, C_out, h, w]. cond: DiT {"class_labels": [B]};
    PixArt {"embeds": [B, L, Dc], "mask": [B, L]} (+ "resolution" [B, 2], "aspect_ratio" [B, 1]);
    SD3 / Flux: the rows the engine builds in engine/denoise.py (models/mmdit.py);
    Wan: x [B, C, F', h, w], cond {"embeds": [B, L, D]} (models/wan.py)."""
    if pipe.transformer_2 is not None:  # Wan 2.2: each row through the expert of its timestep
        return per_expert(pipe, [(x, t, cond)], lambda view, parts: [predict(view, *p, sp) for p in parts])[0]
    if pipe.family == "wan" and (sp is not None or not pipe.packs):
        return predict_wan(pipe, x, t, cond, sp)
    if pipe.family in MMDIT and (sp is not None or not pipe.packs):
        return predict_mmdit(pipe, x, t, cond, sp)
    if sp is None and pipe.packs:
        return predict_packed(pipe, [(x, t, cond)])[0]
    m = pipe.transformer
    p = pipe.patch_size
    hp, wp = x.shape[-2] // p, x.shape[-1] // p
    if pipe.family == "dit":
        hs = _dit(m, x, t, cond["class_labels"], sp)
    else:
        hs = _pixart(m, x, t, cond, sp)
    c_out = m.out_channels
    hs = hs.reshape(-1, hp, wp, p, p, c_out)
    hs = torch.einsum("nhwpqc->nchpwq", hs)
    return hs.reshape(-1, c_out, hp * p, wp * p)


def _blocks(m: Any, hs: torch.Tensor, sp: UlyssesShard | None, **kw: Any) -> torch.Tensor:
    if sp is not None:
        hs = sp.scatter_tokens(hs)
        with sp.attention(m):
            for block in m.transformer_blocks:
                hs = block(hs, **kw)
    else:
        for block in m.transformer_blocks:
            hs = block(hs, **kw)
    return hs


def _dit(m: Any, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, sp: UlyssesShard | None) -> torch.Tensor:
    hs = m.pos_embed(x)                                                   # [B, N, D]
    hs = _blocks(m, hs, sp, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                 timestep=t, cross_attention_kwargs=None, class_labels=labels)
    conditioning = m.transformer_blocks[0].norm1.emb(t, labels, hidden_dtype=hs.dtype)
    shift, scale = m.proj_out_1(F.silu(conditioning)).chunk(2, dim=1)
    hs = m.norm_out(hs) * (1 + scale[:, None]) + shift[:, None]
    hs = m.proj_out_2(hs)                                                 # [B, n, p*p*C_out]
    return sp.gather_tokens(hs) if sp is not None else hs


def _pixart(m: Any, x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor],
            sp: UlyssesShard | None) -> torch.Tensor:
    mask = cond["mask"]
    enc_bias = ((1 - mask.to(x.dtype)) * -10000.0).unsqueeze(1)          # [B, 1, L]
    batch = x.shape[0]
    hs = m.pos_embed(x)
    added = {"resolution": cond.get("resolution"), "aspect_ratio": cond.get("aspect_ratio")}
    tt, emb_t = m.adaln_single(t, added, batch_size=batch, hidden_dtype=hs.dtype)
    enc = cond["embeds"]
    if m.caption_projection is not None:
        enc = m.caption_projection(enc).view(batch, -1, hs.shape[-1])
    hs = _blocks(m, hs, sp, attention_mask=None, encoder_hidden_states=enc, encoder_attention_mask=enc_bias,
                 timestep=tt, cross_attention_kwargs=None, class_labels=None)
    shift, scale = (m.scale_shift_table[None] + emb_t[:, None]).chunk(2, dim=1)
    hs = m.norm_out(hs)
    hs = hs * (1 + scale) + shift
    hs = m.proj_out(hs).squeeze(1)
    return sp.gather_tokens(hs) if sp is not None else hs
