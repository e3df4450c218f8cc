"""Automatic prefix caching: full KV blocks found again by a hash of everything before them.

Block i of a sequence is named by a chain hash: H_i = blake2b(H_{i-1} || tokens of block i),
H_-1 = a root that covers whatever else decides KV content besides the tokens (nothing today:
the model, its dtype and the block size belong to the engine, whose pool this is; a future
adapter or cache salt goes into `salt`). Equal names mean equal token prefixes, so a block
computed by one sequence holds exactly the KV another with the same prefix would compute.
128-bit digests: a collision would silently hand a row wrong KV, so no 64-bit hash.

Rules that keep sharing safe:
- only full blocks, and only once the forward that filled them has finished, are registered
  (a block being written is never shared; a sequence never writes below its num_computed);
- a match leaves at least the last token to compute, so every admission yields logits;
- the allocator counts holders; an idle cached block is evicted least recently freed first.
No torch: the engine and the scheduler drive it, tests run it without a model.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from .kv_cache import BlockAllocator
from .sequence import Sequence

ROOT = b"batchgen-prefix-cache-v1"


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def _tokens(seq: Sequence, start: int, end: int) -> list[int]:
    """(prompt + output)[start:end] without building the concatenation."""
    p = seq.prompt_ids
    if end <= len(p):
        return p[start:end]
    if start >= len(p):
        return seq.output_ids[start - len(p):end - len(p)]
    return p[start:] + seq.output_ids[:end - len(p)]


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # tokens of admitted rows looked up in the cache (vLLM's prefix_cache_queries)
    hits: int = 0  # of those, tokens whose KV was found cached
    deferred: int = 0  # admissions put off one step because a running row was computing their prefix

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, salt: bytes = b"") -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.root = hashlib.blake2b(ROOT + salt, digest_size=16).digest()
        self.stats = PrefixCacheStats()

    def hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chain hashes of seq's first num_blocks full blocks (computed once, kept on seq)."""
        hs, bs = seq.block_hashes, self.block_size
        while len(hs) < num_blocks:
            i = len(hs)
            hs.append(block_hash(hs[-1] if hs else self.root, _tokens(seq, i * bs, (i + 1) * bs)))
        return hs[:num_blocks] if len(hs) > num_blocks else hs

    def sort_key(self, seq: Sequence) -> tuple[bytes, ...]:
        """Rows sorted by this lie in prefix-trie order: rows sharing k leading blocks are adjacent."""
        return tuple(self.hashes(seq, len(seq.prompt_ids) // self.block_size))

    def match(self, seq: Sequence) -> list[int]:
        """Cached blocks of seq's longest cached prefix, leaving at least its last token out."""
        limit = (seq.num_tokens - 1) // self.block_size
        return self.allocator.lookup(self.hashes(seq, limit)) if limit else []

    def waits_for(self, seq: Sequence, num_hits: int, pending: set[bytes]) -> bool:
        """Is seq's first uncached block being computed by this forward (so it is cheaper to
        admit seq next step and find it cached)?"""
        if not pending or num_hits >= (seq.num_tokens - 1) // self.block_size:
            return False
        return self.hashes(seq, num_hits + 1)[num_hits] in pending

    def completing(self, seq: Sequence, num_new: int) -> list[bytes]:
        """Hashes of the blocks seq fills by computing num_new more tokens."""
        bs = self.block_size
        first, end = seq.num_computed // bs, (seq.num_computed + num_new) // bs
        return self.hashes(seq, end)[first:end] if end > first else []

    def register(self, seq: Sequence) -> None:
        """Register seq's full, computed blocks not registered yet (call between forwards)."""
        full = min(seq.num_computed // self.block_size, len(seq.block_ids))
        if full <= seq.num_registered_blocks:
            return
        hs = self.hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.allocator.register(seq.block_ids[i], hs[i])
        seq.num_registered_blocks = full

    def admitted(self, seq: Sequence, num_hit_tokens: int) -> None:
        self.stats.queries += seq.num_tokens
        self.stats.hits += num_hit_tokens
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_hit_tokens

    def summary(self) -> dict[str, float]:
        s = self.stats
        return {"prefix_cache_queries": s.queries, "prefix_cache_hits": s.hits, "prefix_cache_hit_rate": s.hit_rate,
                "prefix_cache_deferred": s.deferred, "prefix_cache_blocks": self.allocator.num_cached,
                "prefix_cache_evicted_blocks": self.allocator.evicted}

    def status(self) -> str:
        """The progress line's figure ('' before any lookup)."""
        if not self.stats.queries:
            return ""
        return f"prefix cache: {100 * self.stats.hit_rate:.0f}% of prompt tokens hit"
