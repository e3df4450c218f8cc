"""Routed experts tiered over device pool, host memory and the checkpoint on disk: greedy tokens
stay those of the fully resident engine (itself token-exact with transformers).

On this CPU-only machine "device" and "host" are the same memory, so these tests prove the
mechanism (which experts are where, what is read from disk and when, that the remapped kernel
call is exact, that an unreadable expert fails only its rows), not the speed it buys on a GPU.
"""
from __future__ import annotations

import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import tiny_models
import torch

from batchgen import Engine, ModelLoadError, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
KV = 16 << 20
ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"]


def one_layer_of_experts(engine: Engine) -> int:
    """Bytes of one MoE layer's routed experts: the smallest budget that can work."""
    ffn = next(layer.ffn for layer in engine.model.weights.layers if getattr(layer.ffn, "w13", None) is not None)
    return (ffn.w13[0].numel() + ffn.w2[0].numel()) * ffn.w13.element_size() * ffn.w13.shape[0]


def tier_options(one_layer: int) -> dict[str, dict[str, int]]:
    return {
        "device-pool": {"expert_memory_bytes": one_layer},  # host holds all, pool of one layer
        "host-from-disk": {"expert_host_memory_bytes": one_layer},  # CPU: the host cache is the pool
        "three-tiers": {"expert_memory_bytes": one_layer, "expert_host_memory_bytes": one_layer * 3 // 2},
    }


@pytest.fixture(scope="module")
def resident_runs(checkpoint_factory, prompt_ids) -> dict[str, tuple[Path, int, list[list[int]]]]:
    out = {}
    for arch in ARCHS:
        model_dir = checkpoint_factory(arch)
        engine = Engine(model_dir, kv_cache_bytes=KV)
        out[arch] = (model_dir, one_layer_of_experts(engine),
                     [o.token_ids for o in engine.generate(prompt_ids[:6], GREEDY)])
    return out


@pytest.mark.parametrize("tiers", ["device-pool", "host-from-disk", "three-tiers"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_tier_combination_gives_the_resident_tokens(resident_runs, prompt_ids, arch: str, tiers: str) -> None:
    model_dir, one_layer, expected = resident_runs[arch]
    engine = Engine(model_dir, kv_cache_bytes=KV, **tier_options(one_layer)[tiers])
    store = engine.model.experts
    assert store is not None
    assert all(getattr(layer.ffn, "w13", None) is None for layer in engine.model.weights.layers
               if hasattr(layer.ffn, "router"))  # no resident copy left behind
    assert [o.token_ids for o in engine.generate(prompt_ids[:6], GREEDY)] == expected
    stats = engine.stats_summary()
    assert stats["expert_hit_rate_device"] < 1.0  # experts were evicted and brought back
    if tiers == "device-pool":
        assert stats["expert_bytes_from_disk_total"] == 0 and stats["expert_bytes_from_host_total"] > 0
    else:  # nothing but the headers was read at load: every expert byte came from disk since
        assert stats["expert_bytes_from_disk_total"] >= store.expert_bytes * len(store.num_experts)
        assert stats["expert_bytes_from_disk_total"] == stats["expert_disk_reads"] * store.expert_bytes
        assert stats["expert_bytes_from_disk"] == stats["expert_bytes_from_disk_total"] / stats["generated_tokens"]
    if tiers == "three-tiers":
        assert 0.0 < stats["expert_hit_rate_host"] < 1.0 and stats["expert_bytes_from_host"] > 0
    if tiers == "host-from-disk":  # one memory, one tier: the host rate is the pool's
        assert stats["expert_hit_rate_host"] == stats["expert_hit_rate_device"]
    engine.close()


def test_transformers_agrees_with_experts_read_from_disk(checkpoint_factory, prompt_ids) -> None:
    model_dir = checkpoint_factory("qwen3_moe")
    one_layer = one_layer_of_experts(Engine(model_dir, kv_cache_bytes=KV))
    engine = Engine(model_dir, kv_cache_bytes=KV, expert_host_memory_bytes=one_layer)
    for prompt, out in zip(prompt_ids[:2], engine.generate(prompt_ids[:2], GREEDY)):
        assert out.token_ids == tiny_models.reference_generate(model_dir, prompt, GREEDY.max_tokens, ignore_eos=True)


@pytest.mark.parametrize("prefetch", ["history", "router", "none"])
@pytest.mark.parametrize("eviction", ["routing", "layer-order"])
def test_prefetch_and_eviction_policies_keep_tokens_exact(resident_runs, prompt_ids, prefetch: str, eviction: str) -> None:
    model_dir, one_layer, expected = resident_runs["olmoe"]
    engine = Engine(model_dir, kv_cache_bytes=KV, expert_host_memory_bytes=one_layer * 2,
                    expert_prefetch=prefetch, expert_eviction=eviction, expert_overlap_reads=eviction == "routing")
    assert [o.token_ids for o in engine.generate(prompt_ids[:6], GREEDY)] == expected
    stats = engine.stats_summary()
    if prefetch == "none":
        assert stats["expert_prefetch_reads"] == 0 and stats["expert_prefetch_accuracy"] == 0.0
    else:  # experts were read ahead in the reader thread and stages then used them
        assert stats["expert_prefetch_reads_used"] > 0
        assert stats["expert_prefetch_reads_used"] <= stats["expert_prefetch_reads"]
        assert 0.0 < stats["expert_prefetch_accuracy"] <= 1.0


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_micro_batches_preemption_and_suspend_resume_with_experts_on_disk(resident_runs, prompt_ids, arch: str) -> None:
    model_dir, one_layer, _ = resident_runs[arch]
    prompts = prompt_ids[:6]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in Engine(model_dir, kv_cache_bytes=KV).generate(prompts, params)]
    # a small KV pool (preemption) and micro-batched attention, experts from disk
    small = Engine(model_dir, num_kv_blocks=24, block_size=8, attention_kv_tokens=64,
                   expert_host_memory_bytes=one_layer)
    outs = small.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected and sum(o.num_preemptions for o in outs) > 0
    # suspend on one tiered engine, resume on another
    first = Engine(model_dir, kv_cache_bytes=KV, expert_host_memory_bytes=one_layer)
    second = Engine(model_dir, kv_cache_bytes=KV, expert_memory_bytes=one_layer, expert_host_memory_bytes=one_layer)
    sid = first.add_request(prompts[2], params)
    for _ in range(5):
        first.step()
    moved = second.resume(pickle.loads(pickle.dumps(first.suspend(sid))))
    while not second.get(moved).is_finished:
        second.step()
    assert second.pop_output(moved).token_ids == expected[2]


def test_budgets_below_one_layer_fail_at_load_naming_the_minimum(checkpoint_factory) -> None:
    model_dir = checkpoint_factory("mixtral")
    one_layer = one_layer_of_experts(Engine(model_dir, kv_cache_bytes=KV))
    for option in ("expert_memory_bytes", "expert_host_memory_bytes"):
        with pytest.raises(ModelLoadError, match=rf"{option}={one_layer - 1} cannot hold one MoE layer's 8 experts "
                                                 rf"\(at least {one_layer} bytes"):
            Engine(model_dir, **{option: one_layer - 1})
        with pytest.raises(ValueError, match=option):
            Engine(model_dir, **{option: 0})
    with pytest.raises(ValueError, match="expert_host_memory_bytes must be a byte count or a size like '2GiB'"):
        Engine(model_dir, expert_host_memory_bytes="lots")
    with pytest.raises(ValueError, match="expert_eviction must be one of"):
        Engine(model_dir, expert_memory_bytes=one_layer, expert_eviction="random")


def test_budgets_take_human_sizes_and_a_budget_that_fits_everything_offloads_nothing(checkpoint_factory) -> None:
    model_dir = checkpoint_factory("mixtral")
    engine = Engine(model_dir, kv_cache_bytes="16MiB", expert_host_memory_bytes="1 GiB", expert_memory_bytes="1GiB")
    assert engine.config.expert_host_memory_bytes == 1 << 30 and engine.config.kv_cache_bytes == 16 << 20
    assert engine.model.experts is None and "expert_hit_rate_device" not in engine.stats_summary()


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A private copy of a checkpoint directory, for a test to damage."""
    shutil.copytree(src, dst)
    return dst


def last_expert_piece(engine: Engine) -> tuple[tuple[int, int], Path, int]:
    """The (layer, expert) whose bytes lie last in a weights file, that file, and their offset."""
    store = engine.model.experts
    assert store is not None and store.disk is not None
    (key, piece) = max(((k, p) for k, ps in store.disk.pieces.items() for p in ps), key=lambda kp: kp[1].offset)
    return key, piece.file, piece.offset


def routes_to(model_dir: Path, prompt: list[int], layer: int, expert: int) -> bool:
    """Does this one-token forward route to (layer, expert)? (the resident engine, alone)"""
    engine = Engine(model_dir, kv_cache_bytes=KV)
    seen: list[torch.Tensor] = []
    stage = engine.model.ffn_stage

    def spy(i: int, hidden: torch.Tensor, on_route=None, next_rows=None) -> torch.Tensor:
        return stage(i, hidden, (lambda ids: (seen.append(ids), on_route(ids))) if i == layer and on_route else on_route,
                     next_rows)

    engine.model.ffn_stage = spy  # type: ignore[method-assign]
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    return any(bool((ids == expert).any()) for ids in seen)


@pytest.mark.parametrize("overlap", [False, True], ids=["reads-in-stage", "reads-overlapped"])
def test_a_checkpoint_truncated_mid_job_fails_only_the_rows_that_need_the_lost_expert(
        checkpoint_factory, tmp_path: Path, overlap: bool) -> None:
    src = checkpoint_factory("mixtral")
    model_dir = copy_checkpoint(src, tmp_path / "model")
    one_layer = one_layer_of_experts(Engine(model_dir, kv_cache_bytes=KV))
    prompts = [[t] for t in range(5, 29)]  # one token each: a row routes to few experts
    resident = Engine(model_dir, kv_cache_bytes=KV)
    expected = [o.token_ids for o in resident.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))]
    engine = Engine(model_dir, kv_cache_bytes=KV, expert_host_memory_bytes=one_layer, expert_overlap_reads=overlap)
    (layer, expert), weights_file, offset = last_expert_piece(engine)
    os.truncate(weights_file, offset + 16)  # after load: the engine was fine, then the file lost its tail
    outs = engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    lost = [routes_to(src, p, layer, expert) for p in prompts]
    assert 0 < sum(lost) < len(prompts)
    for out, needs_lost, want in zip(outs, lost, expected):
        if needs_lost:
            assert out.finish_reason == "error" and out.token_ids == []
            assert f"weights file {weights_file.name} is truncated: expert {expert} of layer {layer}" in out.error
        else:
            assert out.finish_reason == "length" and out.token_ids == want and out.error is None


def test_a_checkpoint_deleted_mid_job_is_still_read_from_its_open_files(checkpoint_factory, tmp_path: Path,
                                                                         prompt_ids) -> None:
    model_dir = copy_checkpoint(checkpoint_factory("qwen2_moe"), tmp_path / "model")
    one_layer = one_layer_of_experts(Engine(model_dir, kv_cache_bytes=KV))
    expected = [o.token_ids for o in Engine(model_dir, kv_cache_bytes=KV).generate(prompt_ids[:3], GREEDY)]
    engine = Engine(model_dir, kv_cache_bytes=KV, expert_host_memory_bytes=one_layer)
    for f in model_dir.glob("*.safetensors"):
        f.unlink()
    assert [o.token_ids for o in engine.generate(prompt_ids[:3], GREEDY)] == expected


def test_a_checkpoint_truncated_before_load_fails_fast(checkpoint_factory, tmp_path: Path) -> None:
    src = checkpoint_factory("olmoe")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for f in src.iterdir():
        data = f.read_bytes()
        (model_dir / f.name).write_bytes(data[:len(data) - 64] if f.suffix == ".safetensors" else data)
    with pytest.raises(ModelLoadError):
        Engine(model_dir, expert_host_memory_bytes=1 << 20)


@pytest.mark.parametrize("tiers,parts", [("three-tiers", False), ("host-from-disk", False), ("host-from-disk", True)])
@pytest.mark.parametrize("prefetch", ["none", "router", "history"])
def test_fetched_slots_hold_the_checkpoints_experts_in_every_tier(resident_runs, tiers: str, parts: bool,
                                                                  prefetch: str) -> None:
    """Random stages (any layer order, so reads ahead are often for a layer that does not come
    next and stay in flight, holding their slots) against the resident weights, with a slow disk:
    whatever tier an expert came from, the slot the kernel is pointed at holds exactly it."""
    model_dir, one_layer, _ = resident_runs["qwen3_moe"]
    resident = Engine(model_dir, kv_cache_bytes=KV).model.weights.layers
    options = tier_options(one_layer)[tiers]
    if tiers == "host-from-disk":
        options = {"expert_host_memory_bytes": one_layer * 3 // 2}
    engine = Engine(model_dir, kv_cache_bytes=KV, expert_prefetch=prefetch, expert_overlap_reads=parts, **options)
    store = engine.model.experts
    assert store is not None and store.disk is not None
    read = store.disk.read

    def slow_read(*args: object) -> int:
        time.sleep(0.002)
        return read(*args)  # type: ignore[arg-type]
    store.disk.read = slow_read  # type: ignore[method-assign]
    rng = torch.Generator().manual_seed(3)
    x = torch.randn(4, engine.model.spec.hidden_size, generator=rng)
    for _ in range(200):
        layer = store.order[int(torch.randint(0, len(store.order), (1,), generator=rng))]
        ids = torch.randint(0, store.num_experts[layer], (int(torch.randint(1, 6, (1,), generator=rng)), 2),
                            generator=rng)
        if parts:  # each needed expert in exactly one part, correct while that part is computed
            seen: list[int] = []
            for w13, w2, slots in store.fetch_parts(layer, x, ids):
                for e, slot in zip(ids.flatten().tolist(), slots.flatten().tolist()):
                    if slot >= 0:
                        seen.append(e)
                        assert torch.equal(w13[slot], resident[layer].ffn.w13[e])
                        assert torch.equal(w2[slot], resident[layer].ffn.w2[e])
            assert sorted(set(seen)) == sorted(set(ids.flatten().tolist())) and len(seen) == ids.numel()
            continue
        w13, w2, slots = store.fetch(layer, x, ids)
        for e, slot in zip(ids.flatten().tolist(), slots.flatten().tolist()):
            assert torch.equal(w13[slot], resident[layer].ffn.w13[e]) and torch.equal(w2[slot], resident[layer].ffn.w2[e])
    assert store.stats.disk_reads > sum(store.num_experts.values()) // 2  # it did evict and read again
    assert (store.stats.prefetch_reads > 0) == (prefetch != "none")
    engine.close()


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_a_host_resident_kv_pool_runs_attention_there_with_the_same_tokens(resident_runs, prompt_ids, arch: str) -> None:
    """kv_cache_on_host: the pool and the attention stage live in host memory (on this CPU-only
    machine the same memory as the device, so this proves the path, not the GPU transfer)."""
    model_dir, one_layer, expected = resident_runs[arch]
    engine = Engine(model_dir, kv_cache_bytes=KV, kv_cache_on_host=True, attention_kv_tokens=64,
                    expert_host_memory_bytes=one_layer)
    # attention_stage takes the host branch whenever these are set
    assert engine.executor.cache.device.type == "cpu" and engine.model._host_attention is not None
    assert [o.token_ids for o in engine.generate(prompt_ids[:6], GREEDY)] == expected
    assert Engine(model_dir, kv_cache_bytes=KV).model._host_attention is None  # off by default


def test_each_expert_is_fetched_once_per_moe_stage_however_many_micro_batches_joined(resident_runs, prompt_ids) -> None:
    """The MoE stage combines every attention micro-batch, so splitting attention costs no extra
    expert reads: the same reads as one attention batch, the same tokens."""
    model_dir, one_layer, expected = resident_runs["mixtral"]
    runs = {}
    for kv_tokens in (1 << 30, 64):  # one attention batch; micro-batches of <= 64 KV tokens
        engine = Engine(model_dir, kv_cache_bytes=KV, expert_host_memory_bytes=one_layer,
                        attention_kv_tokens=kv_tokens, expert_prefetch="none")
        tokens = [o.token_ids for o in engine.generate(prompt_ids[:6], GREEDY)]
        runs[kv_tokens] = (tokens, engine.stats_summary())
    (one_tokens, one), (micro_tokens, micro) = runs[1 << 30], runs[64]
    assert micro["attention_batch_mean"] < one["attention_batch_mean"]  # attention really was split
    assert micro_tokens == one_tokens == expected
    assert micro["expert_disk_reads"] == one["expert_disk_reads"] and micro["moe_batch_mean"] == one["moe_batch_mean"]


def test_offloading_experts_raises_the_batch_defaults(resident_runs) -> None:
    model_dir, one_layer, _ = resident_runs["mixtral"]
    plain = Engine(model_dir, kv_cache_bytes=KV).config
    fits = Engine(model_dir, kv_cache_bytes=KV, expert_host_memory_bytes=1 << 30).config  # offloads nothing
    tiered = Engine(model_dir, kv_cache_bytes=KV, expert_host_memory_bytes=one_layer).config
    assert (plain.max_num_seqs, plain.attention_kv_tokens) == (256, None) == (fits.max_num_seqs, fits.attention_kv_tokens)
    assert (tiered.max_num_seqs, tiered.attention_kv_tokens) == (1024, 4096)
    mine = Engine(model_dir, kv_cache_bytes=KV, expert_host_memory_bytes=one_layer, max_num_seqs=8,
                  attention_kv_tokens=128).config
    assert (mine.max_num_seqs, mine.attention_kv_tokens) == (8, 128)


def test_experts_computed_in_disjoint_parts_give_exactly_the_one_call_result() -> None:
    from batchgen_kernels import fused_moe_reference, fused_moe_reference_into

    g = torch.Generator().manual_seed(0)
    T, H, N, E, A = 37, 16, 8, 6, 3
    x, w13, w2 = torch.randn(T, H, generator=g), torch.randn(E, 2 * N, H, generator=g), torch.randn(E, H, N, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])
    weights = torch.rand(T, A, generator=g)
    whole = fused_moe_reference(x, w13, w2, weights, ids)
    slot_out = x.new_zeros(T * A, H)
    for part in ({0, 3}, {1}, {2, 4, 5}):
        mask = torch.tensor([[int(e) in part for e in row] for row in ids.tolist()])
        fused_moe_reference_into(slot_out, x, w13, w2, weights, torch.where(mask, ids, -1))
    assert torch.equal(slot_out.view(T, A, H).sum(dim=1), whole)  # bit for bit, not just close


def test_a_closed_engine_says_so_instead_of_reading_closed_files(resident_runs, prompt_ids) -> None:
    model_dir, one_layer, _ = resident_runs["mixtral"]
    engine = Engine(model_dir, kv_cache_bytes=KV, expert_host_memory_bytes=one_layer)
    engine.close()
    with pytest.raises(RuntimeError, match="this engine was closed"):
        engine.generate(prompt_ids[:1], GREEDY)


def test_the_router_guesses_the_last_layers_experts_from_its_rows(resident_runs, prompt_ids) -> None:
    """The last layer's expert stage runs the sampling rows alone, so the router predictor
    guesses its experts from those rows (at most one a prompt, none for a prompt chunk that
    samples nothing), not from every prompt row."""
    model_dir, one_layer, expected = resident_runs["olmoe"]
    prompts = prompt_ids[:6]
    for budget in (2048, 8):  # every prompt in one forward; prompts in chunks of 8 tokens
        engine = Engine(model_dir, kv_cache_bytes=KV, expert_host_memory_bytes=one_layer * 2,
                        expert_prefetch="router", max_num_batched_tokens=budget)
        store, last = engine.model.experts, engine.model.num_layers - 1
        assert store is not None and engine.model.is_moe_layer(last)
        guessed: list[int] = []  # rows each guess for the last layer was made from
        predict = store.router_predict

        def spy(layer: int, x: torch.Tensor, last: int = last, guessed: list[int] = guessed,
                predict=predict) -> list[int]:
            if layer == last:
                guessed.append(x.shape[0])
            return predict(layer, x)

        store.router_predict = spy
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
        assert guessed and max(guessed) <= len(prompts) < sum(map(len, prompts))
        if budget == 2048:
            assert guessed[0] == len(prompts)  # the prompts' forward
        else:
            assert 0 in guessed  # a chunk that samples nothing: nothing to guess from
