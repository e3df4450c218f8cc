"""Counters the runtime keeps: batch sizes at attention and at the MoE stage, preemptions, tokens."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

# Samples kept per series: long jobs run billions of expert calls; the recent window is enough.
WINDOW = 100_000


def _window() -> deque[int]:
    return deque(maxlen=WINDOW)


@dataclass(slots=True)
class RuntimeStats:
    forwards: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of prompt_tokens, found in the prefix cache (not computed)
    generated_tokens: int = 0
    preemptions: int = 0
    graph_steps: int = 0  # decode steps replayed from a CUDA graph (runtime/cuda_graphs.py)
    # recent samples (bounded): tokens per attention micro-batch, per MoE stage call, and per
    # (MoE stage call, active expert)
    attention_batches: deque[int] = field(default_factory=_window)
    moe_batches: deque[int] = field(default_factory=_window)
    expert_call_tokens: deque[int] = field(default_factory=_window)

    def summary(self) -> dict[str, float]:
        def mean(xs: deque[int]) -> float:
            return sum(xs) / len(xs) if xs else 0.0

        return {
            "forwards": self.forwards,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "preemptions": self.preemptions,
            "graph_steps": self.graph_steps,
            "attention_batch_mean": mean(self.attention_batches),
            "moe_batch_mean": mean(self.moe_batches),
            "tokens_per_expert_call_mean": mean(self.expert_call_tokens),
            "tokens_per_expert_call_p50": float(median(self.expert_call_tokens)) if self.expert_call_tokens else 0.0,
        }
