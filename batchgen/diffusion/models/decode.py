"""VAE decode of finished trajectories, batched by latent shape, to PIL images."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .wan import decode_wan

if TYPE_CHECKING:
    from .pipeline import Pipeline


@torch.no_grad()
def decode(pipe: Pipeline, latents: list[torch.Tensor]) -> list[np.ndarray]:
    """latents: same-shape [C, h, w] each -> images [H, W, 3] floats in [0, 1]; Wan: [C, F', h, w]
    each -> videos [F, H, W, 3]."""
    if pipe.family == "wan":
        return decode_wan(pipe, latents)
    z = torch.stack(latents)
    scale = pipe.vae.config.scaling_factor
    # DiTPipeline multiplies by 1/scale, PixArt divides, SD3 and Flux divide and shift: kept apart
    # for bit-equal images
    if pipe.family == "dit":
        z = 1 / scale * z
    elif pipe.vae.config.shift_factor is not None and pipe.family in ("sd3", "flux"):
        z = z / scale + pipe.vae.config.shift_factor
    else:
        z = z / scale
    images = pipe.vae.decode(z.to(pipe.vae.dtype)).sample
    images = (images / 2 + 0.5).clamp(0, 1)
    return list(images.cpu().permute(0, 2, 3, 1).float().numpy())


def to_pil(image: np.ndarray) -> Any:
    from PIL import Image

    return Image.fromarray((image * 255).round().astype("uint8"))
