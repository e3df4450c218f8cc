"""Routed experts spilled to host memory: a device pool of expert slots, filled on demand.

With `expert_memory_bytes` below what the routed experts need, their weights stay in host
memory (pinned on CUDA) and the device holds a pool of `slots` experts, least recently used out
first. A MoE stage asks for the experts its tokens were routed to; the missing ones are copied
into free or evicted slots, and the kernel runs on the pool with the token->expert ids remapped
to slots. The runtime runs each layer's MoE stage once per forward on all attention
micro-batches combined, so one copy of an expert serves the whole expert batch: the larger that
batch, the fewer bytes cross the host link per generated token.

The pool must hold one MoE layer's experts (a stage may need all of them); shared experts and
everything else stay resident. Copies go on the current stream (ordered before the kernel
that reads them); there is no prefetch of the next layer yet.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..errors import ModelLoadError


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
        self._where: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, LRU first
        self._free = list(range(slots - 1, -1, -1))
        self.stats = ExpertCacheStats()

    @staticmethod
    def bytes_per_expert(w13: torch.Tensor, w2: torch.Tensor) -> int:
        return (w13[0].numel() + w2[0].numel()) * w13.element_size()

    def fetch(self, layer: int, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """topk_ids [T, A] (expert ids of `layer`) -> (pool w13 [S, 2N, H], pool w2 [S, H, N],
        topk ids remapped to pool slots [T, A]), with every needed expert in the pool."""
        host = self.layers[layer]
        needed = torch.unique(topk_ids).tolist()
        slot_of: dict[int, int] = {}
        missing: list[int] = []
        for e in needed:
            slot = self._where.get((layer, e))
            if slot is None:
                missing.append(e)
            else:
                self._where.move_to_end((layer, e))
                slot_of[e] = slot
        for e in missing:
            # slots >= experts per layer, and this stage's hits were moved to the end: the LRU
            # front is never an expert this stage needs
            slot = self._free.pop() if self._free else self._where.popitem(last=False)[1]
            self.pool13[slot].copy_(host.w13[e], non_blocking=True)
            self.pool2[slot].copy_(host.w2[e], non_blocking=True)
            self._where[(layer, e)] = slot
            slot_of[e] = slot
        self.stats.hits += len(needed) - len(missing)
        self.stats.loads += len(missing)
        self.stats.bytes_loaded += len(missing) * self.expert_bytes
        lut = torch.zeros(host.w13.shape[0], dtype=torch.long)
        lut[list(slot_of)] = torch.tensor(list(slot_of.values()), dtype=torch.long)
        return self.pool13, self.pool2, lut.to(topk_ids.device)[topk_ids]


def plan_offload(moe_layers: dict[int, tuple[torch.Tensor, torch.Tensor]], budget: int | None,
                 device: torch.device) -> ExpertCache | None:
    """An ExpertCache when `budget` bytes cannot hold every routed expert; None when they fit
    (or no budget is set). Moves each layer's experts to host memory, pinned on CUDA."""
    if budget is None or not moe_layers:
        return None
    per_expert = max(ExpertCache.bytes_per_expert(w13, w2) for w13, w2 in moe_layers.values())
    total = sum(ExpertCache.bytes_per_expert(w13, w2) * w13.shape[0] for w13, w2 in moe_layers.values())
    if budget >= total:
        return None
    widest = max(w13.shape[0] for w13, _ in moe_layers.values())
    if budget < widest * per_expert:
        raise ModelLoadError(f"expert_memory_bytes={budget} cannot hold one MoE layer's {widest} experts "
                             f"(at least {widest * per_expert} bytes; all routed experts take {total})")
    pin = device.type == "cuda"
    host = {i: HostExperts(w13.cpu().pin_memory() if pin else w13.cpu(), w2.cpu().pin_memory() if pin else w2.cpu())
            for i, (w13, w2) in moe_layers.items()}
    return ExpertCache(host, device, budget // per_expert)
