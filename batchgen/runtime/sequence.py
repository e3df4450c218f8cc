"""A sequence coroutine's state: small, picklable, torch-free.

A coroutine runs until its next yield point and parks there. Between forwards it parks at the
inter-forward yield point: the only place it is suspended, evicted or migrated, so its state
needs no hidden activations. Inside a forward the executor parks whole attention micro-batches
at each MoE layer's yield point and runs the layer's MoE stage once on all of them combined
(executor.py); a forward always completes, so a Sequence records no intra-forward position.

Token bookkeeping: `token_ids = prompt_ids + output_ids`; the first `num_computed` of them have
their KV in the cache. A forward feeds the rest; when it reaches the end, a token is sampled.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NewType

SeqId = NewType("SeqId", int)


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # parked between forwards without KV (new, or evicted for recompute)
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    SWAPPED = "swapped"  # evicted with its KV kept in host memory
    FINISHED = "finished"


# eq=False: a coroutine is itself, not its field values; the scheduler's `in` / `remove` on its
# queues then compare identities instead of building two tuples of every field per comparison.
@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: SeqId
    request_index: int
    prompt_ids: list[int]
    params: Any  # SamplingParams; typed loosely to keep this module free of the sampler
    seed: int
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    num_swapped: int = 0  # tokens whose KV waits in host memory (status SWAPPED)
    block_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    text: str = ""  # decoded output so far; kept up to date only for requests with stop strings
    text_is_final: bool = False  # text was cut at a stop string; do not re-decode
    decode_offsets: tuple[int, int] = (0, 0)  # incremental detokenization: (prefix, read)
    num_preemptions: int = 0
    # prefix caching: prompt tokens found cached at the first admission (None: not admitted yet)
    num_cached_tokens: int | None = None
    # engine-local (suspend.py leaves them behind): chain hashes of the full blocks computed so
    # far (they depend on the tokens alone), and how many leading blocks are registered
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    # (transition, reason) of recent state changes: migration and eviction stay debuggable
    history: list[tuple[str, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def remaining_tokens(self) -> int:
        """Upper bound on tokens still to generate (max_tokens minus those done)."""
        return max(0, int(self.params.max_tokens) - len(self.output_ids))

    def transition(self, status: SeqStatus, reason: str) -> None:
        self.status = status
        self.history.append((status.value, reason))
        del self.history[:-8]

    def finish(self, reason: str, error: str | None = None, why: str | None = None) -> None:
        self.finish_reason, self.error = reason, error
        self.transition(SeqStatus.FINISHED, f"finish:{why or reason}")

    def drop_kv(self) -> list[int]:
        """Forget the cache (recompute later, unless swapped out); returns the blocks to free."""
        blocks, self.block_ids, self.num_computed = self.block_ids, [], 0
        self.num_registered_blocks = 0
        return blocks


