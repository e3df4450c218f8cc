"""Request admission: a caller's (prompt, sampling) checked against this engine (vocabulary,
context length, KV pool, grammars) and turned into a Sequence, or into one that finished at once
with finish_reason 'error'. Resume runs the same checks on a coroutine that comes from elsewhere.
"""
from __future__ import annotations

import random
from collections.abc import Sequence as Seq
from typing import Any

from ..errors import RequestError
from ..runtime.requests import check_length, check_params, prompt_to_ids
from ..runtime.sequence import SeqId, Sequence
from ..sampling_params import SamplingParams
from ..structured.rows import RowGrammars
from ..tokenizer import ChatPrompt, Tokenizer, check_chat

Prompt = str | list[int] | ChatPrompt  # a conversation is rendered by this engine's chat template


class Intake:
    """Admits requests into one engine: what it checks is fixed when the engine is built."""

    def __init__(self, vocab_size: int, tokenizer: Tokenizer | None, max_model_len: int, pool_tokens: int,
                 grammars: RowGrammars, seed: int) -> None:
        self.vocab_size, self.tokenizer, self.max_model_len = vocab_size, tokenizer, max_model_len
        self.pool_tokens = pool_tokens  # the KV pool's capacity: a longer row could never run
        self.grammars = grammars
        self._rng = random.Random(seed)  # draws the seeds of requests that set none

    def admit(self, seq_id: SeqId, prompt: Prompt, params: SamplingParams | None, index: int) -> Sequence:
        """-> the request as a waiting Sequence; a bad one comes back finished with finish_reason
        'error' and a message that names the field and the value."""
        params = SamplingParams() if params is None else params
        seed = getattr(params, "seed", None)
        seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else self._rng.getrandbits(63)
        try:
            params = check_params(params, self.vocab_size)
            ids = self.prompt_ids(prompt)
            check_length(len(ids), params, self.max_model_len, self.pool_tokens)
            self.grammars.check(params)  # compiled once per distinct spec
        except RequestError as exc:
            seq = Sequence(seq_id, index, [], params, seed)
            seq.finish("error", str(exc))
            return seq
        return Sequence(seq_id, index, ids, params, seed, logprobs=[] if params.logprobs is not None else None)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if not isinstance(prompt, ChatPrompt):
            return prompt_to_ids(prompt, self.tokenizer, self.vocab_size)
        check_chat(prompt)  # a malformed conversation is named even where no tokenizer ships
        if self.tokenizer is None:
            raise RequestError("messages: this model directory has no tokenizer.json")
        return prompt_to_ids(self.tokenizer.chat_ids(prompt), self.tokenizer, self.vocab_size)

    def check_resumable(self, seq: Sequence) -> None:
        """Raise RequestError where a coroutine cannot continue here: this engine's context and
        pool may be smaller than the one it came from."""
        check_params(seq.params, self.vocab_size)
        check_length(len(seq.prompt_ids), seq.params, self.max_model_len, self.pool_tokens)
        self.grammars.check(seq.params)


def broadcast_params(prompts: Seq[Prompt], sampling: SamplingParams | Seq[SamplingParams] | None
                     ) -> list[SamplingParams | Any]:
    """One SamplingParams per prompt: a single one (or None, the defaults) applies to all."""
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a list of prompts (strings or token-id lists), not one string")
    if sampling is None or isinstance(sampling, SamplingParams):
        return [sampling or SamplingParams()] * len(prompts)
    sampling = list(sampling)
    if len(sampling) != len(prompts):
        raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts")
    return sampling
