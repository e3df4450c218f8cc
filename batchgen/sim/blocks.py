"""The runtime's block allocator, counting KV blocks instead of naming them.

The scheduler asks the pool only how many blocks are free and takes or returns lists of them;
what a block's id is matters to the executor that writes KV there, which the simulator does not
have. Handing out placeholder ids keeps every count the scheduler reads exactly as in the
runtime, at the cost of a list multiply instead of a pop per block.
"""
from __future__ import annotations

from ..runtime.kv_cache import BlockAllocator


class BlockCounter(BlockAllocator):
    __slots__ = ("_num_free",)

    def __init__(self, num_blocks: int, block_size: int) -> None:
        BlockAllocator.__init__(self, num_blocks, block_size)  # its checks
        self._free = []
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
        return [-1] * n  # ids are not modelled

    def free(self, blocks: list[int]) -> None:
        self._num_free += len(blocks)
