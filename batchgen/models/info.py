"""What a driver needs to know about a model without loading its weights: tokenizer, vocabulary,
context length. The batch job front end parses and checks rows with it while the weights live
on the cluster's workers."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from ..tokenizer import Tokenizer
from . import hub
from .loader import generation_eos_ids, load_spec
from .spec import ModelSpec


@dataclass(slots=True)
class ModelInfo:
    model_dir: Path
    tokenizer: Tokenizer | None
    eos_token_ids: list[int]
    vocab_size: int
    max_model_len: int

    @classmethod
    def load(cls, model_dir: str | Path, max_model_len: int | None = None) -> ModelInfo:
        """Fails fast (ModelLoadError / UnsupportedModelError) on what Engine() would refuse to load,
        short of reading the weights."""
        weights_here = not hub.is_hub_id(model_dir)  # a driver fetches no shards; the engine's load checks them
        path = hub.model_dir(model_dir, weights=False)
        _, spec = load_spec(path)
        if weights_here and not any(path.glob("*.safetensors")):
            raise ModelLoadError(f"model directory {str(path)!r} has no *.safetensors weights")
        return cls.for_spec(path, spec, max_model_len)

    @classmethod
    def for_spec(cls, path: Path, spec: ModelSpec, max_model_len: int | None = None) -> ModelInfo:
        """Tokenizer, stop ids and context length of a parsed checkpoint (Engine uses this too)."""
        if max_model_len and max_model_len > spec.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={spec.max_position_embeddings}")
        eos = generation_eos_ids(path, spec.eos_token_ids)
        tokenizer = Tokenizer.from_dir(path, eos)
        return cls(path, tokenizer, tokenizer.eos_token_ids if tokenizer else eos, spec.vocab_size,
                   max_model_len or spec.max_position_embeddings)
