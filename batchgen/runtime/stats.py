"""Counters the runtime keeps: batch sizes at attention and at the MoE stage, preemptions, tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median


@dataclass(slots=True)
class RuntimeStats:
    forwards: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    attention_batches: list[int] = field(default_factory=list)  # tokens per attention micro-batch
    moe_batches: list[int] = field(default_factory=list)  # tokens per MoE stage call
    expert_call_tokens: list[int] = field(default_factory=list)  # tokens per (stage call, active expert)

    def summary(self) -> dict[str, float]:
        def mean(xs: list[int]) -> float:
            return sum(xs) / len(xs) if xs else 0.0

        return {
            "forwards": self.forwards,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "preemptions": self.preemptions,
            "attention_batch_mean": mean(self.attention_batches),
            "moe_batch_mean": mean(self.moe_batches),
            "tokens_per_expert_call_mean": mean(self.expert_call_tokens),
            "tokens_per_expert_call_p50": float(median(self.expert_call_tokens)) if self.expert_call_tokens else 0.0,
        }

    def trim(self, keep: int = 100_000) -> None:
        """Bound memory on long jobs: keep the most recent samples."""
        for xs in (self.attention_batches, self.moe_batches, self.expert_call_tokens):
            del xs[:-keep]
