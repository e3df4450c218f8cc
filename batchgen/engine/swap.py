"""Host KV store: the KV [layers, tokens, W] of coroutines that wait in host memory (evicted
from the pool, or resumed with KV into a pool that had no room), within swap_space_bytes.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..runtime.executor import Executor
from ..runtime.policy import prefer_transfer
from ..runtime.sequence import SeqId, SeqStatus, Sequence


class HostKV:
    def __init__(self, executor: Executor, kv_bytes_per_token: int, swap_space_bytes: int,
                 host_link_bytes_per_s: int, recompute_tokens_per_s: Callable[[], float]) -> None:
        self.executor, self.kv_bytes_per_token = executor, kv_bytes_per_token
        self.swap_space_bytes, self.host_link_bytes_per_s = swap_space_bytes, host_link_bytes_per_s
        self.recompute_tokens_per_s = recompute_tokens_per_s
        self.kv: dict[SeqId, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(kv.numel() * kv.element_size() for kv in self.kv.values())

    def fits(self, num_tokens: int) -> bool:
        return self.nbytes + num_tokens * self.kv_bytes_per_token <= self.swap_space_bytes

    def swap_out(self, seq: Sequence, blocks: list[int], num_computed: int) -> None:
        """Keep an evicted coroutine's KV in host memory when that beats recomputing it."""
        nbytes = num_computed * self.kv_bytes_per_token
        if self.nbytes + nbytes > self.swap_space_bytes or not prefer_transfer(
                num_computed, nbytes, self.host_link_bytes_per_s, self.recompute_tokens_per_s()):
            return
        self.park(seq, self.executor.read_kv(blocks, num_computed), num_computed, "evict:swap-out")

    def park(self, seq: Sequence, kv: torch.Tensor, num_tokens: int, why: str) -> None:
        self.kv[seq.seq_id] = kv
        seq.num_swapped = num_tokens
        seq.transition(SeqStatus.SWAPPED, why)

    def swap_in(self, seq: Sequence) -> None:
        """Back into the pool blocks the scheduler gave it."""
        self.executor.write_kv(seq.block_ids, self.kv.pop(seq.seq_id))

    def get(self, seq_id: SeqId) -> torch.Tensor:
        return self.kv[seq_id]

    def drop(self, seq_id: SeqId) -> None:
        self.kv.pop(seq_id, None)
