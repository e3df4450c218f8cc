"""What a finished request hands back."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestOutput:
    index: int  # position of the request in the caller's input
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (vLLM's name)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)
