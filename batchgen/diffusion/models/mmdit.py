"""The MMDiT forward (SD3, Flux) for a group of one latent shape, at a timestep per sample: the
inputs and calls diffusers' StableDiffusion3Pipeline and FluxPipeline make, per row.

Degree-1 forwards run token-packed instead (packed_sd3.py, packed_flux.py); this one runs a
transformer those do not (forward.predict): trajectories of one shape share a forward at any
timesteps, and each shape is its own forward. Sequence-parallel forwards run here, diffusers'
blocks with the Ulysses attention processors of parallel/sp_mmdit.py.

Shapes: B rows (CFG's unconditional rows included), C latent channels, h x w latent, N = hw/4
Flux tokens (2x2 patches packed into 4C channels), L text tokens, D joint width, P pooled width.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from ..parallel.sp_mmdit import flux_attention, sd3_attention
from .flux_latents import image_ids, pack, unpack

if TYPE_CHECKING:
    from ..parallel.sp import UlyssesShard
    from .pipeline import Pipeline


def timing_cond(pipe: Pipeline, rows: int) -> dict[str, torch.Tensor]:
    """Random conditioning of the right shapes for `rows` rows: what a timed forward needs."""
    cfg = pipe.transformer.config
    cond = {"embeds": torch.randn(rows, pipe.text_length, int(cfg.joint_attention_dim)),
            "pooled": torch.randn(rows, int(cfg.pooled_projection_dim))}
    if pipe.guidance_embeds:
        cond["guidance"] = torch.full((rows,), 3.5)
    return cond


def predict_mmdit(pipe: Pipeline, x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor],
                  sp: UlyssesShard | None = None) -> torch.Tensor:
    """x: [B, C, h, w] latents, t: [B] the schedulers' timesteps (sigma x 1000) -> the predicted
    velocity [B, C, h, w]. sp: Ulysses over the image tokens (parallel/sp_mmdit.py), the same
    inputs on every member."""
    m = pipe.transformer
    if pipe.family == "sd3":
        if sp is not None:
            return _sd3_sharded(m, x, t, cond, sp)
        return m(hidden_states=x, timestep=t, encoder_hidden_states=cond["embeds"], pooled_projections=cond["pooled"],
                 return_dict=False)[0]
    b, c, h, w = x.shape
    length = cond["embeds"].shape[1]
    text_ids = torch.zeros(length, 3, device=x.device, dtype=cond["embeds"].dtype)
    tokens = pack(x)
    with contextlib.ExitStack() as stack:
        if sp is not None:  # this member's tokens in, its tokens out; the rotary table is the whole image's
            tokens = sp.scatter_tokens(tokens)
            stack.enter_context(flux_attention(sp, m, length))
        out = m(hidden_states=tokens, timestep=t.to(x.dtype) / 1000, guidance=cond.get("guidance"),
                pooled_projections=cond["pooled"], encoder_hidden_states=cond["embeds"], txt_ids=text_ids,
                img_ids=image_ids(h // 2, w // 2, x.device, x.dtype), return_dict=False)[0]
    return unpack(out if sp is None else sp.gather_tokens(out), h, w)


def _sd3_sharded(m: Any, x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], sp: UlyssesShard
                 ) -> torch.Tensor:
    """SD3Transformer2DModel.forward with the image tokens sharded after the patch embedding (its
    positions are cropped for the whole latent) and gathered before the unpatchify."""
    hs = sp.scatter_tokens(m.pos_embed(x))                               # [B, n_me, D]
    temb = m.time_text_embed(t, cond["pooled"])
    enc = m.context_embedder(cond["embeds"])
    with sd3_attention(sp, m):
        for block in m.transformer_blocks:
            enc, hs = block(hidden_states=hs, encoder_hidden_states=enc, temb=temb)
    hs = sp.gather_tokens(m.proj_out(m.norm_out(hs, temb)))             # [B, N, p p C_out]
    p = m.config.patch_size
    hs = hs.reshape(x.shape[0], x.shape[-2] // p, x.shape[-1] // p, p, p, m.out_channels)
    hs = torch.einsum("nhwpqc->nchpwq", hs)
    return hs.reshape(x.shape[0], m.out_channels, x.shape[-2], x.shape[-1])
