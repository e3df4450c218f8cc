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


def test_the_pool_keeps_recent_experts_and_evicts_the_least_recent() -> None:
    torch.manual_seed(0)
    layers = {layer: HostExperts(torch.randn(4, 6, 3), torch.randn(4, 3, 3)) for layer in (0, 1)}
    cache = ExpertCache(layers, torch.device("cpu"), slots=5)
    ids = torch.tensor([[0, 1], [1, 2]])
    w13, w2, slots = cache.fetch(0, ids)
    for e, s in zip(ids.flatten().tolist(), slots.flatten().tolist()):
        assert torch.equal(w13[s], layers[0].w13[e]) and torch.equal(w2[s], layers[0].w2[e])
    assert (cache.stats.loads, cache.stats.hits) == (3, 0)
    cache.fetch(0, torch.tensor([[2, 2]]))  # a hit: expert 2 of layer 0 is now the most recent
    assert (cache.stats.loads, cache.stats.hits) == (3, 1)
    _, _, slots = cache.fetch(1, torch.tensor([[0, 3], [3, 1]]))  # 3 more: 2 free slots, then evict LRU
    assert cache.stats.loads == 6
    w13, _, _ = cache.fetch(0, torch.tensor([[2, 1]]))  # layer 0's expert 0 went (least recent), 1 and 2 stayed
    assert cache.stats.loads == 6 and cache.stats.hits == 3
    _, _, again = cache.fetch(0, torch.tensor([[0, 0]]))
    assert cache.stats.loads == 7
    assert torch.equal(w13[again[0, 0]], layers[0].w13[0])


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
