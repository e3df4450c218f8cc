"""Wan 2.1 text-to-video (diffusers' WanPipeline) for a group of one latent shape, at a timestep per
sample: its prompt cleaning, conditioning rows, transformer call and VAE decode, as the pipeline
makes them per video.

The transformer is diffusers' WanTransformer3DModel, called as a whole (its forward takes one
timestep per sample); trajectories of one latent shape [C, F', h, w] share a forward at any
timesteps, and each shape is its own forward (rotary positions depend on the shape).

Shapes: B rows (CFG's unconditional rows included), C latent channels, F' = (F - 1) / 4 + 1
latent frames of F video frames, h x w latent (pixels / 8), L text tokens, D text width.
"""
from __future__ import annotations

import html
import re
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
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


def predict_wan(pipe: Pipeline, x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
    """x: [B, C, F', h, w] latents, t: [B] the schedulers' timesteps, cond {"embeds": [B, L, D]} ->
    the predicted velocity [B, C, F', h, w]."""
    m = pipe.transformer
    return m(hidden_states=x.to(m.dtype), timestep=t, encoder_hidden_states=cond["embeds"], return_dict=False)[0]


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
