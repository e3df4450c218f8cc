"""KV block allocator: bookkeeping only, no torch. Block b holds cache slots [b*bs, (b+1)*bs).

Blocks are reference-counted: a full block whose content hash is registered (prefix_cache.py)
may be held by several sequences at once. When the last holder lets go, a registered block
stays where it is, still findable by its hash, in an idle list ordered by when it was freed; an
allocation takes plain free blocks first and only then evicts the least recently freed idle
block (vLLM's automatic prefix caching does the same). Without registrations this is the plain
free list it always was.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class BlockAllocator:
    num_blocks: int
    block_size: int
    _free: list[int] = field(default_factory=list)  # blocks holding nothing anyone can reuse
    _refs: list[int] = field(default_factory=list)  # holders per block
    _hash_of: dict[int, bytes] = field(default_factory=dict)  # registered block -> content hash
    _by_hash: dict[bytes, int] = field(default_factory=dict)
    # registered blocks nobody holds, least recently freed first: evicted in this order
    _idle: OrderedDict[int, None] = field(default_factory=OrderedDict)
    evicted: int = 0  # registered blocks reused for other content

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {self.num_blocks}, {self.block_size}")
        # pop() from the end hands out low block ids first
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._refs = [0] * self.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (plain free ones and idle cached ones)."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash (held or idle)."""
        return len(self._by_hash)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def extra_blocks(self, have: int, num_tokens: int) -> int:
        """Blocks to add to `have` so that `num_tokens` tokens fit."""
        return max(0, blocks_for(num_tokens, self.block_size) - have)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free) + len(self._idle)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: asked {n} blocks, {self.num_free} free")
        if n <= 0:
            return []
        free = self._free
        if n <= len(free):  # the common case in one slice: the same ids, in the same order, as n pops
            out = free[-n:]
            del free[-n:]
            out.reverse()
        else:
            out = free[::-1]
            free.clear()
            while len(out) < n:  # evict the least recently freed cached blocks
                b, _ = self._idle.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
                self.evicted += 1
                out.append(b)
        refs = self._refs
        for b in out:
            refs[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one hold on each block. Reversed, so a sequence's first blocks (the ones other
        sequences are likeliest to share) become idle last and are evicted last."""
        for b in reversed(blocks):
            r = self._refs[b] - 1
            if r < 0:
                raise RuntimeError(f"KV block {b} freed more often than it was held")
            self._refs[b] = r
            if r == 0:
                if b in self._hash_of:
                    self._idle[b] = None
                else:
                    self._free.append(b)

    # -- prefix caching ----------------------------------------------------------------------------
    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The blocks registered under the leading run of `hashes` (stops at the first miss)."""
        out = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_idle(self, blocks: list[int]) -> int:
        """How many of `blocks` sit idle (taking a hold on them shrinks num_free by this)."""
        if not blocks:  # (every admission without a prefix hit: no generator to build)
            return 0
        return sum(1 for b in blocks if self._refs[b] == 0)

    def share(self, blocks: list[int]) -> None:
        """Take one more hold on each (registered) block; idle ones leave the eviction list."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._idle[b]
            self._refs[b] += 1

    def register(self, block: int, block_hash: bytes) -> bool:
        """Make a held, full block findable by its hash; False when that content is already
        cached in another block (this one then stays private) or the block is registered."""
        if block_hash in self._by_hash or block in self._hash_of:
            return False
        if self._refs[block] < 1:
            raise RuntimeError(f"KV block {block} registered while nobody holds it")
        self._hash_of[block] = block_hash
        self._by_hash[block_hash] = block
        return True
