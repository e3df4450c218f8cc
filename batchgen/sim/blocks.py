"""The runtime's block allocator, counting KV blocks instead of naming them.

The scheduler asks the pool only how many blocks are free and takes or returns lists of them;
what a block's id is matters to the executor that writes KV there, which the simulator does not
have. Handing out placeholder ids keeps every count the scheduler reads exactly as in the
runtime, at the cost of a list multiply instead of a pop per block.
"""
from __future__ import annotations

from collections import OrderedDict

from ..runtime.kv_cache import BlockAllocator

NO_ID = -1  # every block's id: ids are not modelled


class BlockCounter(BlockAllocator):
    __slots__ = ("_num_free",)

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:  # BlockAllocator's checks, without its free list of every block
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free, self._refs = [], []
        self._hash_of, self._by_hash, self._idle = {}, {}, OrderedDict()
        self.evicted = 0
        self._num_free = num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self._num_free

    def allocate(self, n: int) -> list[int]:
        if n > self._num_free:
            raise RuntimeError(f"KV pool exhausted: asked {n} blocks, {self._num_free} free")
        if n <= 0:
            return []
        self._num_free -= n
        return [NO_ID] * n

    def take(self, n: int) -> None:
        """allocate(n) for a closing slice, whose rows get their n placeholder ids themselves."""
        if n > self._num_free:
            raise RuntimeError(f"KV pool exhausted: asked {n} blocks, {self._num_free} free")
        self._num_free -= n

    def free(self, blocks: list[int]) -> None:
        self._num_free += len(blocks)
