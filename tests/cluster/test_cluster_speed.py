"""When an engine's rate counts as its capacity (the speed the balancer weighs work by)."""
from __future__ import annotations

from batchgen.policy.speed import at_capacity


def test_rows_waiting_for_their_prefill_turn_are_not_capacity() -> None:
    assert not at_capacity(waiting=28, running=100, max_num_seqs=256, kv_used=0.1)  # the token budget
    assert at_capacity(waiting=28, running=256, max_num_seqs=256, kv_used=0.1)  # the batch is full
    assert at_capacity(waiting=3, running=40, max_num_seqs=256, kv_used=0.85)  # the KV pool is
    assert not at_capacity(waiting=0, running=256, max_num_seqs=256, kv_used=0.95)  # nobody waits
