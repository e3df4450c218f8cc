"""A diffusers model folder loaded into its module (transformer, VAE), failures as ModelLoadError.

diffusers keeps some modules of some models in fp32 whatever the dtype (`_keep_in_fp32_modules`:
Wan's time embedding, norms, modulation tables, rotary tables), and loads such a model only with
`accelerate` installed (low_cpu_mem_usage). Without it we load the weights in fp32 through the
same from_pretrained, then cast every other parameter to the dtype: the same tensors, without a
dependency the rest of batchgen does not need (but 4 bytes a parameter while loading: install
accelerate for a large checkpoint, e.g. Wan 2.1 14B, and diffusers loads it in its dtype).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from ...errors import ModelLoadError


def load_module(cls: Any, folder: Path, torch_dtype: Any) -> Any:
    """diffusers' from_pretrained; any failure, or weights missing for the config, -> ModelLoadError."""
    import torch

    keep = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
    plain = bool(keep) and importlib.util.find_spec("accelerate") is None
    load_cls = type(cls.__name__, (cls,), {"_keep_in_fp32_modules": None}) if plain else cls
    try:
        kw = {"torch_dtype": torch.float32, "low_cpu_mem_usage": False} if plain else {"torch_dtype": torch_dtype}
        module, info = load_cls.from_pretrained(folder, output_loading_info=True, **kw)
    except Exception as exc:  # noqa: BLE001 - OSError, ValueError, NotImplementedError, SafetensorError, ...
        raise ModelLoadError(f"{folder}: cannot load {cls.__name__} ({type(exc).__name__}: {exc})") from exc
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ModelLoadError(f"{folder}: {cls.__name__} weights missing for its config.json: "
                             f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} ({len(missing)} tensors)")
    if plain and torch_dtype != torch.float32:
        for name, p in module.named_parameters():
            if not any(k in name.split(".") for k in keep):  # diffusers' own test of a kept name
                p.data = p.data.to(torch_dtype)
    if plain:
        module._keep_in_fp32_modules = list(keep)  # module.dtype (diffusers) then skips the kept ones
    return module
