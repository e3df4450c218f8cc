"""The MMDiT forward (SD3, Flux) for a group of one latent shape, at a timestep per sample: the
inputs and calls diffusers' StableDiffusion3Pipeline and FluxPipeline make, per row.

Not token-packed: joint attention runs over each sample's text and image tokens together and Flux
rotates them by positions that depend on the latent shape, so several shapes would need our own
copy of the blocks (packed.py does that for DiT and PixArt). Trajectories of one shape share a
forward at any timesteps; each shape is its own forward.

Shapes: B rows (CFG's unconditional rows included), C latent channels, h x w latent, N = hw/4
Flux tokens (2x2 patches packed into 4C channels), L text tokens, D joint width, P pooled width.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

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


def pack(x: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, N, 4C] (FluxPipeline._pack_latents)."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(z: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, N, 4C] -> [B, C, h, w] (FluxPipeline._unpack_latents, in latent pixels)."""
    b, _, c4 = z.shape
    return z.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c4 // 4, h, w)


def image_ids(rows: int, cols: int, device: Any, dtype: torch.dtype) -> torch.Tensor:
    """[rows x cols, 3] rope positions of the packed tokens (FluxPipeline._prepare_latent_image_ids)."""
    ids = torch.zeros(rows, cols, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(rows)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, 3).to(device=device, dtype=dtype)
