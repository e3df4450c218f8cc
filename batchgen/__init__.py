"""batchgen: batch (offline) inference of Mixture-of-Experts LLMs, built on Dask.

Names load lazily, so the torch-free parts (batchgen.runtime.policy, .sequence, .kv_cache,
batchgen.sampling_params) import without pulling in torch. Type checkers and IDEs read the
same names from the TYPE_CHECKING imports below.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.cluster.client import connect as connect
    from batchgen.cluster.generate import generate as generate
    from batchgen.cluster.generate import output_meta as output_meta
    from batchgen.config import EngineConfig as EngineConfig
    from batchgen.diffusion.jobs.frame import diffuse as diffuse
    from batchgen.engine import Engine as Engine
    from batchgen.errors import (
        BatchgenError as BatchgenError,
    )
    from batchgen.errors import (
        ModelLoadError as ModelLoadError,
    )
    from batchgen.errors import (
        RequestError as RequestError,
    )
    from batchgen.errors import (
        StateError as StateError,
    )
    from batchgen.errors import (
        UnsupportedModelError as UnsupportedModelError,
    )
    from batchgen.outputs import RequestOutput as RequestOutput
    from batchgen.sampling_params import SamplingParams as SamplingParams
    from batchgen.structured.params import StructuredOutputsParams as StructuredOutputsParams

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "batchgen.engine",
    "EngineConfig": "batchgen.config",
    "RequestOutput": "batchgen.outputs",
    "SamplingParams": "batchgen.sampling_params",
    "StructuredOutputsParams": "batchgen.structured.params",
    "BatchgenError": "batchgen.errors",
    "ModelLoadError": "batchgen.errors",
    "RequestError": "batchgen.errors",
    "StateError": "batchgen.errors",
    "UnsupportedModelError": "batchgen.errors",
    "connect": "batchgen.cluster.client",
    "generate": "batchgen.cluster.generate",
    "output_meta": "batchgen.cluster.generate",
    "diffuse": "batchgen.diffusion.jobs.frame",
}

__all__ = sorted(_EXPORTS)


_SUBMODULES = {"cluster", "demo"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"batchgen.{name}")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)
