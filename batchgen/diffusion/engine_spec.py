"""Image engines on the cluster runtime: the EngineSpec of a diffusion pipeline, and a process's
own engine for the elastic driver's loops (which drive an engine from their task's thread)."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..cluster.spec import EngineSpec

if TYPE_CHECKING:
    from .engine import DiffusionEngine

IMAGE_ENGINE = "batchgen.diffusion.engine:DiffusionEngine"
# DiffusionEngine's keyword arguments (tests/diffusion keep the two equal): named here so that a
# client checks engine_options without importing torch and diffusers
ENGINE_OPTIONS = frozenset({"dtype", "device", "policy", "max_batch_rows", "max_batch_tokens",
                            "max_sequence_length", "cost", "max_image_tokens", "restore_heap_reuse"})
_ENGINES: dict[tuple, DiffusionEngine] = {}
_LOCK = threading.Lock()


def image_spec(model: str | Path, options: dict[str, Any] | None = None) -> EngineSpec:
    """The spec of `model`'s image engine (TypeError naming an unknown option)."""
    return EngineSpec.make(model, options, factory=IMAGE_ENGINE, known=ENGINE_OPTIONS)


def process_engine(model: str | Path, options: dict[str, Any]) -> DiffusionEngine:
    """This process's engine for (model, options), loaded on first use."""
    from .engine import DiffusionEngine

    key = (str(Path(model).resolve()), tuple(sorted(options.items())))
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = _ENGINES[key] = DiffusionEngine(model, **options)
    return engine
