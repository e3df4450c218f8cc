"""Wan 2.1 text-to-video (diffusers' WanPipeline) for a group of one latent shape, at a timestep per
sample: its prompt cleaning, text rows, transformer call and VAE decode, as the pipeline makes
them per video (the engine puts each step's rows together: engine/denoise.py).

The transformer is diffusers' WanTransformer3DModel. A degree-1 forward runs token-packed
(packed_wan.py: every latent shape of a step in one forward, at a timestep per sample) unless
the transformer has parts that forward does not run; then diffusers' forward is called as a
whole, one per latent shape (`predict_wan`). A sequence-parallel forward runs its parts with the
tokens sharded (parallel/sp_wan.py: Ulysses self-attention).

Shapes: B rows (CFG's unconditional rows included), C latent channels, F' = (F - 1) / 4 + 1
latent frames of F video frames, h x w latent (pixels / 8), L text tokens, D text width.
"""
from __future__ import annotations

import html
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..parallel.sp_wan import wan_attention

if TYPE_CHECKING:
    from ..parallel.sp import UlyssesShard
    from .pipeline import Pipeline

_SPACES = re.compile(r"\s+")


def prompt_clean(text: str) -> str:
    """WanPipeline's prompt_clean: ftfy's fix_text where installed (as diffusers), HTML entities
    unescaped twice, runs of whitespace as one space, stripped."""
    try:
        import ftfy
    except ImportError:
        pass
    else:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return _SPACES.sub(" ", text).strip()


def text_rows(embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """embeds [B, L, D], mask [B, L] -> embeds zeroed past each prompt's tokens (WanPipeline cuts
    them at the mask's length and pads with zeros: the transformer itself takes no mask)."""
    return torch.where(mask[..., None].bool(), embeds, torch.zeros((), dtype=embeds.dtype, device=embeds.device))


def predict_wan(pipe: Pipeline, x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor],
                sp: UlyssesShard | None = None) -> torch.Tensor:
    """x: [B, C, F', h, w] latents, t: [B] the schedulers' timesteps, cond {"embeds": [B, L, D]} ->
    the predicted velocity [B, C, F', h, w]. sp: Ulysses over its group (every member calls this
    with the same inputs), else diffusers' own forward."""
    m = pipe.transformer
    x = x.to(m.dtype)
    if sp is None:
        return m(hidden_states=x, timestep=t, encoder_hidden_states=cond["embeds"], return_dict=False)[0]
    return _sharded(m, x, t, cond["embeds"], sp)


def _sharded(m: Any, x: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor, sp: UlyssesShard) -> torch.Tensor:
    """WanTransformer3DModel.forward (Wan 2.1: one timestep per sample, no image context) with the
    N = F' h w / (p_h p_w) tokens sharded between patch embedding and the output projection."""
    b, _, frames, height, width = x.shape
    p_t, p_h, p_w = m.config.patch_size
    cos, sin = m.rope(x)                                                   # [1, N, 1, D] each
    hs = m.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()     # [B, N, Dm]
    temb, proj, enc, _ = m.condition_embedder(t, embeds, None)
    proj = proj.unflatten(1, (6, -1))                                      # [B, 6, Dm]
    hs = sp.scatter_tokens(hs)
    me = sp.group.index()
    rotary = (torch.tensor_split(cos, sp.group.size, dim=1)[me], torch.tensor_split(sin, sp.group.size, dim=1)[me])
    with wan_attention(sp, m):
        for block in m.blocks:
            hs = block(hs, enc, proj, rotary)
    shift, scale = (m.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    hs = (m.norm_out(hs.float()) * (1 + scale) + shift).type_as(hs)
    hs = sp.gather_tokens(m.proj_out(hs))                                 # [B, N, p_t p_h p_w C]
    hs = hs.reshape(b, frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
    return hs.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)


def timing_cond(pipe: Pipeline, rows: int) -> dict[str, torch.Tensor]:
    """Random conditioning of the right shape for `rows` rows: what a timed forward needs."""
    return {"embeds": torch.randn(rows, pipe.text_length, int(pipe.transformer.config.text_dim))}


@torch.no_grad()
def decode_wan(pipe: Pipeline, latents: list[torch.Tensor]) -> list[np.ndarray]:
    """latents: same-shape [C, F', h, w] each -> videos [F, H, W, 3] floats in [0, 1]."""
    vae = pipe.vae
    z = torch.stack(latents).to(vae.dtype)
    c = int(vae.config.z_dim)
    mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(z.device, z.dtype)
    # WanPipeline divides by 1 / std (not a multiply by std): kept for bit-equal frames
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(z.device, z.dtype)
    video = vae.decode(z / inv_std + mean, return_dict=False)[0]      # [B, 3, F, H, W]
    video = (video / 2 + 0.5).clamp(0, 1)
    return list(video.cpu().permute(0, 2, 3, 4, 1).float().numpy())
