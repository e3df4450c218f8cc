"""Turning a caller's (prompt, sampling) into token ids, or into a message naming what is wrong."""
from __future__ import annotations

from typing import Any

from ..errors import RequestError
from ..sampling_params import SamplingParams
from ..tokenizer import Tokenizer


def prompt_to_ids(prompt: Any, tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    """str | list[int] -> token ids; raises RequestError naming the field and the value."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt must not be empty, got ''")
        if tokenizer is None:
            raise RequestError("prompt: this model directory has no tokenizer.json; pass token ids instead")
        ids = tokenizer.encode(prompt)
        if not ids:
            raise RequestError(f"prompt {prompt[:40]!r} encodes to no tokens")
        return ids
    if isinstance(prompt, (list, tuple)) or (hasattr(prompt, "tolist") and not isinstance(prompt, (bytes, dict))):
        ids = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
        if not ids:
            raise RequestError("prompt must not be empty, got []")
        if isinstance(ids[0], (str, list, tuple)):
            raise RequestError(f"prompt: a list of several prompts is not supported (one prompt per request); "
                               f"got a list starting with {ids[0]!r:.40}")
        for i, tok in enumerate(ids):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
                raise RequestError(f"prompt token id {tok!r} at position {i} is outside the vocabulary "
                                   f"[0, {vocab_size})")
        return ids
    raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def check_params(params: Any, vocab_size: int) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling must be a SamplingParams, got {type(params).__name__}")
    message = params.validate(vocab_size)
    if message:
        raise RequestError(message)
    return params


def check_length(num_prompt: int, params: SamplingParams, max_model_len: int, pool_tokens: int | None = None) -> None:
    """pool_tokens None: the KV pool is not known here (a driver without the engine); skip that check."""
    if num_prompt >= max_model_len:
        raise RequestError(f"prompt has {num_prompt} tokens; the model's context (max_model_len) is "
                           f"{max_model_len}, leaving no room to generate")
    # the last sampled token is never fed back, so it needs no KV slot
    need = min(num_prompt + params.max_tokens, max_model_len) - 1
    if pool_tokens is not None and need > pool_tokens:
        raise RequestError(f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) needs {need} KV "
                           f"tokens; this engine's KV pool holds {pool_tokens}")
