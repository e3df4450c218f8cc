"""batchgen: batch (offline) inference of Mixture-of-Experts LLMs, built on Dask."""
from __future__ import annotations

from .config import EngineConfig
from .engine import Engine
from .errors import BatchgenError, ModelLoadError, RequestError, StateError, UnsupportedModelError
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "BatchgenError", "Engine", "EngineConfig", "ModelLoadError", "RequestError", "RequestOutput",
    "SamplingParams", "StateError", "UnsupportedModelError",
]
