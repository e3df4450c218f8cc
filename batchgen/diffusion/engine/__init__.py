"""One device's image engine: requests, trajectories as explicit state, admission, one
denoising step for combined trajectories, and DiffusionEngine over them."""
from __future__ import annotations

import importlib
from typing import Any

# `from batchgen.diffusion.engine import DiffusionEngine` kept working from when this was a module
_EXPORTS = {"DiffusionEngine": "batchgen.diffusion.engine.diffusion_engine",
            "ImageOutput": "batchgen.diffusion.engine.diffusion_engine"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'batchgen.diffusion.engine' has no attribute {name!r}")
