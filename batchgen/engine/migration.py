"""Migration: a coroutine parked at its inter-forward yield point leaves as bytes (suspend,
snapshot) and continues exactly where it stopped in another engine (adopt), with its KV sent
along or recomputed there.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import RequestError
from ..runtime.executor import Executor
from ..runtime.kv_cache import BlockAllocator
from ..runtime.policy import Scheduler
from ..runtime.sequence import SeqStatus, Sequence
from ..runtime.suspend import CoroutineCodec
from .intake import Intake
from .swap import HostKV


class Migration:
    def __init__(self, codec: CoroutineCodec, executor: Executor, allocator: BlockAllocator, scheduler: Scheduler,
                 host_kv: HostKV, intake: Intake, release: Callable[[Sequence], None], max_num_seqs: int,
                 recompute_tokens_per_s: Callable[[], float]) -> None:
        self.codec, self.executor, self.allocator, self.scheduler = codec, executor, allocator, scheduler
        self.host_kv, self.intake, self.release, self.max_num_seqs = host_kv, intake, release, max_num_seqs
        self.recompute_tokens_per_s = recompute_tokens_per_s

    def suspend(self, seq: Sequence, with_kv: bool | None) -> bytes:
        """The state of a coroutine already taken out of the engine's table; frees what it held.

        with_kv: True sends the KV cache along, False recomputes it on resume, None picks the
        cheaper by the codec's cost model (bytes to send vs tokens to recompute).
        """
        kv = None
        if with_kv is None:
            with_kv = self.codec.prefer_kv(seq.num_computed or seq.num_swapped, self.recompute_tokens_per_s())
        if with_kv and seq.num_computed and seq.block_ids:
            kv = self.executor.read_kv(seq.block_ids, seq.num_computed)
        elif with_kv and seq.num_swapped:
            kv = self.host_kv.get(seq.seq_id)
        if not seq.is_finished:
            self.release(seq)
        return self.codec.encode(seq, kv)

    def snapshot(self, seq: Sequence) -> bytes:
        return self.codec.encode(seq, None)

    def adopt(self, seq: Sequence, kv: torch.Tensor | None) -> None:
        """Place a decoded coroutine: straight into the batch with its KV when there is room, else
        its KV waits in host memory, else it is recomputed; one this engine cannot run fails."""
        if seq.is_finished:
            return
        try:  # this engine's context and pool may be smaller than the one it came from
            self.intake.check_resumable(seq)
        except RequestError as exc:
            seq.finish("error", f"cannot resume here: {exc}")
            return
        n = kv.shape[1] if kv is not None else 0
        if n and self.allocator.can_allocate(self.allocator.extra_blocks(0, n + 1)) \
                and len(self.scheduler.running) < self.max_num_seqs:
            seq.block_ids = self.allocator.allocate(self.allocator.extra_blocks(0, n))
            self.executor.write_kv(seq.block_ids, kv)
            seq.num_computed = n
            seq.transition(SeqStatus.RUNNING, "resume:with-kv")
            self.scheduler.running.append(seq)
            return
        if n and self.host_kv.fits(n):
            self.host_kv.park(seq, kv, n, "resume:kv-to-host")  # no room in the pool now: wait in host memory
        else:
            seq.transition(SeqStatus.WAITING, "resume:recompute")
        seq.num_computed = 0
        self.scheduler.add(seq)
