"""Which expert eviction moves fewer bytes: routing-aware or layer order alone? (torch-free)

Drives the real policy code (batchgen/policy/expert_eviction.py: pick_victims, RoutingStats) with a
synthetic routing trace: L MoE layers of E experts, each stage routes T tokens top-k with a
Zipf-skewed expert popularity per layer (real MoE routers are skewed: a few experts take a large
share of tokens), a pool that holds a fraction of all experts. Counts the experts brought in.

    python benchmarks/bench_offload_eviction.py [--layers 24 --experts 64 --top-k 4 --tokens 32]
"""
from __future__ import annotations

import argparse
import random

from batchgen.policy.expert_eviction import EVICTIONS, RoutingStats, pick_victims


def trace(layers: int, experts: int, top_k: int, tokens: int, skew: float, stages: int, seed: int) -> list[list[int]]:
    """Per stage (layers in order, forward after forward): the experts its tokens need."""
    rng = random.Random(seed)
    popularity = []
    for _ in range(layers):
        order = list(range(experts))
        rng.shuffle(order)  # each layer has its own hot experts
        w = [0.0] * experts
        for rank, e in enumerate(order):
            w[e] = 1.0 / (rank + 1) ** skew
        popularity.append(w)
    out = []
    for s in range(stages):
        w = popularity[s % layers]
        needed: set[int] = set()
        for _ in range(tokens):
            needed.update(_sample_distinct(rng, w, top_k))
        out.append(sorted(needed))
    return out


def _sample_distinct(rng: random.Random, w: list[float], k: int) -> set[int]:
    chosen: set[int] = set()
    while len(chosen) < k:
        chosen.add(rng.choices(range(len(w)), weights=w)[0])
    return chosen


def loads(eviction: str, stages: list[list[int]], layers: int, slots: int) -> int:
    positions = {layer: layer for layer in range(layers)}
    resident: dict[tuple[int, int], int] = {}
    free, stats, brought, tick = slots, RoutingStats(), 0, 0
    for s, needed in enumerate(stages):
        layer, tick = s % layers, tick + 1
        stats.observe(layer, 1 + max(max(n) for n in stages), needed)
        missing = [e for e in needed if (layer, e) not in resident]
        take = max(0, len(missing) - free)
        free -= len(missing) - take
        keep = {(layer, e) for e in needed}
        cands = [(l, e, t) for (l, e), t in resident.items() if (l, e) not in keep]
        for key in pick_victims(take, cands, positions[layer], positions, eviction, stats):
            del resident[key]
        for e in needed:
            resident[(layer, e)] = tick
        brought += len(missing)
    return brought


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per MoE stage (the expert batch)")
    ap.add_argument("--forwards", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    total = args.layers * args.experts
    print(f"{args.layers} layers x {args.experts} experts, top-{args.top_k}, {args.tokens} tokens per stage")
    print(f"{'skew':>5} {'pool':>6} " + " ".join(f"{name:>12}" for name in EVICTIONS) + "   routing/layer-order")
    for skew in (0.0, 0.8, 1.2):
        stages = trace(args.layers, args.experts, args.top_k, args.tokens, skew, args.layers * args.forwards, args.seed)
        for fraction in (0.25, 0.5):
            slots = max(int(total * fraction), args.experts)
            counts = {name: loads(name, stages, args.layers, slots) for name in EVICTIONS}
            ratio = counts["routing"] / counts["layer-order"]
            print(f"{skew:5.1f} {fraction:6.0%} " + " ".join(f"{counts[n]:12d}" for n in EVICTIONS) + f"   {ratio:.3f}")


if __name__ == "__main__":
    main()
