"""The MMDiT forward (SD3, Flux) for a group of one latent shape, at a timestep per sample: the
inputs and calls diffusers' StableDiffusion3Pipeline and FluxPipeline make, per row.

Degree-1 forwards run token-packed instead (packed_sd3.py, packed_flux.py); this one runs a
transformer those do not (forward.predict): trajectories of one shape share a forward at any
timesteps, and each shape is its own forward.

Shapes: B rows (CFG's unconditional rows included), C latent channels, h x w latent, N = hw/4
Flux tokens (2x2 patches packed into 4C channels), L text tokens, D joint width, P pooled width.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .flux_latents import image_ids, pack, unpack

if TYPE_CHECKING:
    from .pipeline import Pipeline


def timing_cond(pipe: Pipeline, rows: int) -> dict[str, torch.Tensor]:
    """Random conditioning of the right shapes for `rows` rows: what a timed forward needs."""
    cfg = pipe.transformer.config
    cond = {"embeds": torch.randn(rows, pipe.text_length, int(cfg.joint_attention_dim)),
            "pooled": torch.randn(rows, int(cfg.pooled_projection_dim))}
    if pipe.guidance_embeds:
        cond["guidance"] = torch.full((rows,), 3.5)
    return cond


def predict_mmdit(pipe: Pipeline, x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
    """x: [B, C, h, w] latents, t: [B] the schedulers' timesteps (sigma x 1000) -> the predicted
    velocity [B, C, h, w]."""
    m = pipe.transformer
    if pipe.family == "sd3":
        return m(hidden_states=x, timestep=t, encoder_hidden_states=cond["embeds"], pooled_projections=cond["pooled"],
                 return_dict=False)[0]
    b, c, h, w = x.shape
    text_ids = torch.zeros(cond["embeds"].shape[1], 3, device=x.device, dtype=cond["embeds"].dtype)
    out = m(hidden_states=pack(x), timestep=t.to(x.dtype) / 1000, guidance=cond.get("guidance"),
            pooled_projections=cond["pooled"], encoder_hidden_states=cond["embeds"], txt_ids=text_ids,
            img_ids=image_ids(h // 2, w // 2, x.device, x.dtype), return_dict=False)[0]
    return unpack(out, h, w)
