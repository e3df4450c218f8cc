"""SlotPool: a fixed number of expert slots on one device, stacked so a kernel can index them.

w13 [S, 2N, H] and w2 [S, H, N]; which (layer, expert) each slot holds, when it was last used,
and which slots are being filled by a read in flight (never evicted until the read lands).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..policy.expert_eviction import RoutingStats, pick_victims

Key = tuple[int, int]  # (MoE layer, expert)


@dataclass(slots=True)
class Pending:
    slot: int
    future: Future  # -> bytes read
    prefetched: bool = True


class SlotPool:
    def __init__(self, slots: int, w13_shape: tuple[int, int], w2_shape: tuple[int, int], dtype: torch.dtype,
                 device: torch.device, pin: bool = False) -> None:
        self.slots, self.device = slots, device
        self.w13 = torch.empty((slots, *w13_shape), dtype=dtype, device=device, pin_memory=pin)
        self.w2 = torch.empty((slots, *w2_shape), dtype=dtype, device=device, pin_memory=pin)
        self.expert_bytes = (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()
        self.where: dict[Key, int] = {}
        self.last_use: dict[Key, int] = {}
        self.pending: dict[Key, Pending] = {}
        self.ready_events: dict[int, object] = {}  # slot -> CUDA event of an async copy into / out of it
        self._free = list(range(slots - 1, -1, -1))
        self.evicted: list[Key] = []  # what the last take() evicted (the store forgets it was read ahead)

    def holds(self, key: Key) -> bool:
        return key in self.where

    def resident(self, layer: int) -> list[int]:
        return sorted(e for (l, e) in self.where if l == layer)

    def num_evictable(self, keep: set[Key]) -> int:
        return len(self._free) + sum(1 for k in self.where if k not in keep)

    def take(self, count: int, keep: set[Key], here: int, positions: dict[int, int], eviction: str,
             stats: RoutingStats | None) -> list[int]:
        """`count` slots: free ones first, then evicted by the policy; never one in `keep` or
        one a read is filling."""
        out = [self._free.pop() for _ in range(min(count, len(self._free)))]
        self.evicted = []
        if len(out) < count:
            residents = [(l, e, self.last_use.get((l, e), 0)) for (l, e) in self.where if (l, e) not in keep]
            for key in pick_victims(count - len(out), residents, here, positions, eviction, stats):
                self.last_use.pop(key, None)
                self.evicted.append(key)
                out.append(self.where.pop(key))
        for slot in out:
            event = self.ready_events.pop(slot, None)
            if event is not None:  # an async copy still reads or writes this slot
                event.synchronize()  # type: ignore[attr-defined]
        return out

    def release(self, slot: int) -> None:
        """Give back a slot taken for a read that failed."""
        self._free.append(slot)

    def put(self, key: Key, slot: int, tick: int) -> None:
        self.where[key] = slot
        self.last_use[key] = tick
