"""A text encoder's weights from its component folder (every *.safetensors file in it), on the
device and in the dtype it runs in: shared by our plain-torch T5 and CLIP encoders."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from ...errors import ModelLoadError


def load_encoder_weights(path: Path, what: str, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """name -> tensor of every safetensors file under `path`; `what` names the encoder in the error."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no safetensors weights for the {what}")
    w: dict[str, torch.Tensor] = {}
    for f in files:
        w.update(load_file(str(f)))
    return {k: v.to(device=device, dtype=dtype) for k, v in w.items()}
