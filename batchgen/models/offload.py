"""Routed experts spilled to host memory: a device pool of expert slots, filled on demand.

With `expert_memory_bytes` below what the routed experts need, their weights stay in host
memory (pinned on CUDA) and the device holds a pool of `slots` experts. A MoE stage asks for the
experts its tokens were routed to; the missing ones are copied into free or evicted slots, and
the kernel runs on the pool with the token->expert ids remapped to slots.

Eviction knows the order: every forward visits the MoE layers first to last, so the resident
expert needed furthest in the future belongs to the layer just before this one, then the one
before that, and so on round to the next layer. Evicting in that order (Belady's choice for a
cyclic sweep) keeps whole layers resident across forwards; least-recently-used would evict
exactly the layer needed next and get no hits at all once the pool is smaller than a forward's
working set. Within a layer, the least recently used expert goes first.

The runtime runs each layer's MoE stage once per forward on all attention micro-batches
combined, so one copy of an expert serves the whole expert batch: the larger that batch, the
fewer bytes cross the host link per generated token.

The pool must hold one MoE layer's experts (a stage may need all of them); shared experts and
everything else stay resident. Copies go on the current stream (ordered before the kernel
that reads them); there is no prefetch of the next layer yet.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..errors import ModelLoadError
from .weights import MoEWeights


@dataclass(slots=True)
class ExpertCacheStats:
    hits: int = 0  # experts a stage needed that were already in the pool
    loads: int = 0  # experts copied host -> pool
    bytes_loaded: int = 0


@dataclass(slots=True)
class HostExperts:
    """One MoE layer's routed experts in host memory."""

    w13: torch.Tensor  # [E, 2N, H]
    w2: torch.Tensor  # [E, H, N]


class ExpertCache:
    def __init__(self, layers: dict[int, HostExperts], device: torch.device, slots: int) -> None:
        """layers: MoE layer index -> its experts on the host (all of one shape)."""
        first = next(iter(layers.values()))
        shapes = {(tuple(h.w13.shape[1:]), tuple(h.w2.shape[1:]), h.w13.dtype) for h in layers.values()}
        if len(shapes) != 1:
            raise ModelLoadError(f"expert offload needs one expert shape across MoE layers, found {sorted(shapes)}")
        self.layers, self.device, self.slots = layers, device, slots
        self.pool13 = torch.empty((slots, *first.w13.shape[1:]), dtype=first.w13.dtype, device=device)
        self.pool2 = torch.empty((slots, *first.w2.shape[1:]), dtype=first.w2.dtype, device=device)
        self.expert_bytes = self.bytes_per_expert(first.w13, first.w2)
        self._order = sorted(layers)  # forward order of the MoE layers
        self._position = {layer: i for i, layer in enumerate(self._order)}
        # per layer: expert -> slot, least recently used first
        self._resident: dict[int, OrderedDict[int, int]] = {layer: OrderedDict() for layer in layers}
        self._free = list(range(slots - 1, -1, -1))
        self.stats = ExpertCacheStats()

    @staticmethod
    def bytes_per_expert(w13: torch.Tensor, w2: torch.Tensor) -> int:
        return (w13[0].numel() + w2[0].numel()) * w13.element_size()

    def resident(self, layer: int) -> list[int]:
        """Experts of `layer` in the pool now."""
        return sorted(self._resident[layer])

    def fetch(self, layer: int, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """topk_ids [T, A] (expert ids of `layer`) -> (pool w13 [S, 2N, H], pool w2 [S, H, N],
        topk ids remapped to pool slots [T, A]), with every needed expert in the pool."""
        host, resident = self.layers[layer], self._resident[layer]
        needed = torch.unique(topk_ids).tolist()
        keep = set(needed)
        missing = [e for e in needed if e not in resident]
        for e in needed:
            if e in resident:
                resident.move_to_end(e)
        for e in missing:
            slot = self._free.pop() if self._free else self._evict(layer, keep)
            self.pool13[slot].copy_(host.w13[e], non_blocking=True)
            self.pool2[slot].copy_(host.w2[e], non_blocking=True)
            resident[e] = slot
        self.stats.hits += len(needed) - len(missing)
        self.stats.loads += len(missing)
        self.stats.bytes_loaded += len(missing) * self.expert_bytes
        lut = torch.zeros(host.w13.shape[0], dtype=torch.long)
        lut[needed] = torch.tensor([resident[e] for e in needed], dtype=torch.long)
        return self.pool13, self.pool2, lut.to(topk_ids.device)[topk_ids]

    def _evict(self, layer: int, keep: set[int]) -> int:
        """Free the slot whose expert is needed furthest in the future (see the module docstring);
        never one of `keep` (this stage's experts): slots >= one layer's experts guarantees one."""
        n, here = len(self._order), self._position[layer]
        for back in range(1, n + 1):  # the layer just before this one first; this layer last
            victim = self._order[(here - back) % n]
            pool = self._resident[victim]
            for e in pool:  # least recently used first
                if victim != layer or e not in keep:
                    return pool.pop(e)
        raise AssertionError("expert pool smaller than one layer's experts")


def plan_offload(moe_layers: dict[int, MoEWeights], budget: int | None, device: torch.device) -> ExpertCache | None:
    """An ExpertCache when `budget` bytes cannot hold every routed expert; None when they fit
    (or no budget is set). Takes each layer's experts out of its MoEWeights (w13/w2 become None)
    into host memory, pinned on CUDA, one layer at a time so the host never holds two copies of
    more than one layer."""
    if budget is None or not moe_layers:
        return None
    sizes = {i: (ExpertCache.bytes_per_expert(f.w13, f.w2), f.w13.shape[0])  # type: ignore[arg-type,union-attr]
             for i, f in moe_layers.items()}
    per_expert = max(size for size, _ in sizes.values())
    total = sum(size * count for size, count in sizes.values())
    if budget >= total:
        return None
    widest = max(count for _, count in sizes.values())
    if budget < widest * per_expert:
        raise ModelLoadError(f"expert_memory_bytes={budget} cannot hold one MoE layer's {widest} experts "
                             f"(at least {widest * per_expert} bytes; all routed experts take {total})")
    pin = device.type == "cuda"
    host: dict[int, HostExperts] = {}
    for i, f in moe_layers.items():
        w13, w2 = f.w13.cpu(), f.w2.cpu()  # type: ignore[union-attr]
        f.w13 = f.w2 = None  # the cache's host copy is the only one from here on
        host[i] = HostExperts(w13.pin_memory() if pin else w13, w2.pin_memory() if pin else w2)
    return ExpertCache(host, device, budget // per_expert)
