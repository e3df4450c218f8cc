"""KV block allocator: bookkeeping only, no torch. Block b holds cache slots [b*bs, (b+1)*bs)."""
from __future__ import annotations

from dataclasses import dataclass, field


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class BlockAllocator:
    num_blocks: int
    block_size: int
    _free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {self.num_blocks}, {self.block_size}")
        # pop() from the end hands out low block ids first
        self._free = list(range(self.num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def extra_blocks(self, have: int, num_tokens: int) -> int:
        """Blocks to add to `have` so that `num_tokens` tokens fit."""
        return max(0, blocks_for(num_tokens, self.block_size) - have)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked {n} blocks, {len(self._free)} free")
        if n <= 0:
            return []
        blocks = self._free[-n:]  # the same ids, in the same order, as n pops from the end
        del self._free[-n:]
        blocks.reverse()
        return blocks

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
