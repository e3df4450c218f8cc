"""Image engines on the cluster runtime: the EngineSpec of a diffusion pipeline (the key under
which a worker keeps its engine for every image job: batchgen.diffuse, file jobs and the
elastic driver alike)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ...cluster.spec import EngineSpec

IMAGE_ENGINE = "batchgen.diffusion.engine.diffusion_engine:DiffusionEngine"
# DiffusionEngine's keyword arguments (tests/diffusion keep the two equal): named here so that a
# client checks engine_options without importing torch and diffusers
ENGINE_OPTIONS = frozenset({"dtype", "device", "policy", "max_batch_rows", "max_batch_tokens",
                            "max_sequence_length", "cost", "max_image_tokens", "restore_heap_reuse"})


def image_spec(model: str | Path, options: dict[str, Any] | None = None) -> EngineSpec:
    """The spec of `model`'s image engine (TypeError naming an unknown option)."""
    return EngineSpec.make(model, options, factory=IMAGE_ENGINE, known=ENGINE_OPTIONS)
