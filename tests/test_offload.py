"""Routed experts spilled to host memory: the pool streams them in and greedy tokens stay exact.

On this CPU-only machine "device" and "host" are the same memory, so these tests prove the
mechanism (which experts are where, when they are copied, that the remapped kernel call is
exact), not the speed it buys on an accelerator.
"""
from __future__ import annotations

import pytest
import tiny_models
import torch

from batchgen import Engine, ModelLoadError, SamplingParams
from batchgen.models.offload import ExpertCache, HostExperts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def one_layer_of_experts(engine: Engine) -> int:
    """Bytes of one MoE layer's routed experts: the smallest pool that can work."""
    ffn = next(layer.ffn for layer in engine.model.weights.layers if getattr(layer.ffn, "w13", None) is not None)
    return ExpertCache.bytes_per_expert(ffn.w13, ffn.w2) * ffn.w13.shape[0]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_spilled_experts_give_transformers_tokens(checkpoint_factory, prompt_ids, arch: str) -> None:
    model_dir = checkpoint_factory(arch)
    resident = Engine(model_dir, kv_cache_bytes=16 << 20)
    budget = one_layer_of_experts(resident)
    engine = Engine(model_dir, kv_cache_bytes=16 << 20, expert_memory_bytes=budget)
    assert engine.model.experts is not None and engine.model.experts.slots == budget // engine.model.experts.expert_bytes
    assert all(getattr(layer.ffn, "w13", None) is None for layer in engine.model.weights.layers
               if hasattr(layer.ffn, "router"))  # no resident copy left behind
    prompts = prompt_ids[:4]
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == tiny_models.reference_generate(model_dir, prompt, GREEDY.max_tokens, ignore_eos=True)
    stats = engine.stats_summary()
    # more than one layer's experts are used but only one layer's fit: experts were evicted and reloaded
    assert stats["expert_loads"] > engine.model.experts.slots
    assert stats["expert_bytes_loaded"] == stats["expert_loads"] * engine.model.experts.expert_bytes


def test_a_pool_that_holds_every_expert_is_not_a_cache(checkpoint_factory) -> None:
    model_dir = checkpoint_factory("mixtral")
    engine = Engine(model_dir, kv_cache_bytes=16 << 20, expert_memory_bytes=1 << 40)
    assert engine.model.experts is None and "expert_loads" not in engine.stats_summary()


def test_a_pool_smaller_than_one_layer_fails_at_load(checkpoint_factory) -> None:
    model_dir = checkpoint_factory("mixtral")
    budget = one_layer_of_experts(Engine(model_dir, kv_cache_bytes=16 << 20)) - 1
    with pytest.raises(ModelLoadError, match=r"expert_memory_bytes=\d+ cannot hold one MoE layer's 8 experts"):
        Engine(model_dir, expert_memory_bytes=budget)
    with pytest.raises(ValueError, match="expert_memory_bytes"):
        Engine(model_dir, expert_memory_bytes=0)


def host_layers(num_layers: int, experts: int) -> dict[int, HostExperts]:
    torch.manual_seed(0)
    return {2 * i + 1: HostExperts(torch.randn(experts, 6, 3), torch.randn(experts, 3, 3))  # odd: sparse MoE layers
            for i in range(num_layers)}


def test_fetched_slots_always_hold_the_requested_experts() -> None:
    layers = host_layers(3, 4)
    cache = ExpertCache(layers, torch.device("cpu"), slots=5)
    rng = torch.Generator().manual_seed(1)
    for _ in range(300):
        layer = list(layers)[int(torch.randint(0, 3, (1,), generator=rng))]
        ids = torch.randint(0, 4, (int(torch.randint(1, 6, (1,), generator=rng)), 2), generator=rng)
        w13, w2, slots = cache.fetch(layer, ids)
        for e, slot in zip(ids.flatten().tolist(), slots.flatten().tolist()):
            assert torch.equal(w13[slot], layers[layer].w13[e]) and torch.equal(w2[slot], layers[layer].w2[e])
    assert cache.stats.loads + cache.stats.hits > 0 and cache.stats.loads > 12  # it did evict and reload


def test_eviction_keeps_whole_layers_across_forwards() -> None:
    """Pool of 8 for 3 layers x 4 experts, every expert used each forward: evicting the layer
    needed furthest ahead (Belady's choice) reloads one layer and two layers in turn, 6 of 12 per
    forward; least-recently-used would evict the very layer needed next and reload all 12."""
    layers = host_layers(3, 4)
    cache = ExpertCache(layers, torch.device("cpu"), slots=8)
    every = torch.arange(4).reshape(2, 2)
    for layer in sorted(layers):  # the first forward fills the pool
        cache.fetch(layer, every)
    loads, hits = cache.stats.loads, cache.stats.hits
    for _ in range(4):
        for layer in sorted(layers):
            cache.fetch(layer, every)
    assert (cache.stats.loads - loads, cache.stats.hits - hits) == (24, 24)
    partial = ExpertCache(layers, torch.device("cpu"), slots=8)
    partial.fetch(1, torch.tensor([[0, 1]]))
    partial.fetch(3, every)
    partial.fetch(3, torch.tensor([[2, 3]]))  # a hit: layer 3 keeps all four
    partial.fetch(5, every)  # needs 2 more slots: taken from layer 3, the one just before
    assert partial.resident(1) == [0, 1] and len(partial.resident(3)) == 2 and partial.resident(5) == [0, 1, 2, 3]
    assert partial.resident(3) == [2, 3]  # within a layer the least recently used went first


def test_micro_batched_attention_still_loads_each_expert_once_per_forward(checkpoint_factory, prompt_ids) -> None:
    """The MoE stage combines every attention micro-batch, so splitting attention costs no
    extra expert copies: the same loads as one attention batch, the same tokens."""
    model_dir = checkpoint_factory("mixtral")
    budget = one_layer_of_experts(Engine(model_dir, kv_cache_bytes=16 << 20))
    runs = {}
    for kv_tokens in (None, 64):
        engine = Engine(model_dir, kv_cache_bytes=16 << 20, expert_memory_bytes=budget, attention_kv_tokens=kv_tokens)
        tokens = [o.token_ids for o in engine.generate(prompt_ids[:6], GREEDY)]
        runs[kv_tokens] = (tokens, engine.stats_summary())
    (one_tokens, one), (micro_tokens, micro) = runs[None], runs[64]
    assert micro["attention_batch_mean"] < one["attention_batch_mean"]  # attention really was split
    assert micro_tokens == one_tokens and micro["expert_loads"] == one["expert_loads"]
