"""batchgen.diffusion: batch image and video generation with diffusion transformers (DiT,
PixArt-alpha/sigma, SD3, Flux; Wan 2.1 text-to-video).

Trajectories are coroutines whose yield points are denoising steps: explicit picklable state,
combined into shared forwards at different timesteps, suspended and resumed anywhere.
Needs the `batchgen[diffusion]` extra (diffusers, pillow). Names load lazily.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DiffusionEngine": "batchgen.diffusion.engine.diffusion_engine",
    "ImageOutput": "batchgen.diffusion.engine.diffusion_engine",
    "ImageRequest": "batchgen.diffusion.engine.request",
    "CostModel": "batchgen.policy.diffusion_cost",
    "ElasticOptions": "batchgen.policy.diffusion_plan",
    "run_on_cluster": "batchgen.diffusion.distributed.elastic",
    "diffuse": "batchgen.diffusion.jobs.frame",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'batchgen.diffusion' has no attribute {name!r}")
