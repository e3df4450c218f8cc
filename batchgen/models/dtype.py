"""Which dtype an engine computes in: `dtype="auto"` as vLLM resolves it.

auto = the checkpoint's own dtype (config.json `dtype`, as transformers 5 writes it, or
`torch_dtype`, as older snapshots do) on an accelerator, so a bf16 checkpoint runs in bf16 on a
GPU instead of silently paying 2-4x for fp32; float32 on CPU, where bf16/fp16 GEMMs are slower
than fp32 on most cores and fp32 is what the transformers-parity tests compare. A float32
checkpoint stays float32 everywhere. A bf16 checkpoint on a CUDA device without bf16 support
(compute capability < 8) runs in float16, as vLLM does.

`auto_dtype_name` is pure (config dict and device facts in, a name out), so the CUDA decision is
tested on a machine without one.
"""
from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedModelError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
# names config.json may carry for the checkpoint's dtype (torch's own spellings included)
_CHECKPOINT = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
               "half": "float16", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def checkpoint_dtype_name(cfg: dict[str, Any]) -> str | None:
    """config.json's dtype as one of float32 / bfloat16 / float16; None when it names none (or
    one we do not compute in, e.g. float8: such a checkpoint is upcast, see auto_dtype_name)."""
    for key in ("dtype", "torch_dtype"):
        value = cfg.get(key)
        if isinstance(value, str):
            name = value.removeprefix("torch.")
            if name in _CHECKPOINT:
                return _CHECKPOINT[name]
    text = cfg.get("text_config")  # multimodal wrappers keep the language model's config here
    return checkpoint_dtype_name(text) if isinstance(text, dict) else None


def auto_dtype_name(cfg: dict[str, Any], device_type: str, bf16_supported: bool = True) -> str:
    """dtype="auto" for this checkpoint on a device of `device_type` ("cpu", "cuda", ...).

    CPU: float32. Elsewhere: the checkpoint's dtype (float32 when config.json names none: the
    transformers default); bf16 becomes float16 where the device lacks bf16 (`bf16_supported`)."""
    if device_type == "cpu":
        return "float32"
    name = checkpoint_dtype_name(cfg) or "float32"
    if name == "bfloat16" and not bf16_supported:
        return "float16"
    return name


def resolve_dtype(dtype: str | torch.dtype, cfg: dict[str, Any], device: torch.device) -> torch.dtype:
    """An engine's dtype option -> the torch dtype it computes in on `device`."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        bf16 = device.type != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False)
        dtype = auto_dtype_name(cfg, device.type, bf16)
    if dtype not in DTYPES:
        raise UnsupportedModelError(f"dtype {dtype!r} is not supported (choose from {sorted(DTYPES)} or 'auto')")
    return DTYPES[dtype]
