"""Flux's latent layout, as FluxPipeline writes it: 2x2 patches of the [C, h, w] latents packed
into tokens of 4C channels, and the rope positions of those tokens.
"""
from __future__ import annotations

from typing import Any

import torch


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
