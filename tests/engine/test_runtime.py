"""The sequence coroutine runtime: suspend/resume across engines, expert-level batching, swap."""
from __future__ import annotations

import pickle

import pytest
import tiny_models

from batchgen import Engine, SamplingParams, StateError
from batchgen.models import attention, mla
from batchgen.runtime.sequence import SeqStatus

GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=14, temperature=0.8, top_k=50, seed=1234, ignore_eos=True)


def run_to_end(engine: Engine, seq_id) -> list[int]:
    while not engine.get(seq_id).is_finished:
        engine.step()
    return engine.pop_output(seq_id).token_ids


# every pair of (architecture, sampling), (architecture, KV travels or recomputed) and (sampling,
# KV) once: six runs, not the twelve of the whole product
PAIRWISE = [("mixtral", GREEDY, True), ("mixtral", SEEDED, False), ("llama", GREEDY, False), ("llama", SEEDED, True),
            ("deepseek_v3", GREEDY, True), ("deepseek_v3", SEEDED, False)]


@pytest.mark.parametrize(("arch", "params", "with_kv"), PAIRWISE,
                         ids=[f"{'kv-travels' if kv else 'recompute'}-{'greedy' if p is GREEDY else 'seeded'}-{a}"
                              for a, p, kv in PAIRWISE])
def test_suspend_pickle_resume_elsewhere_is_exact(arch: str, params: SamplingParams, with_kv: bool,
                                                  checkpoint_factory, prompt_ids) -> None:
    model_dir = checkpoint_factory(arch)
    prompts = prompt_ids[3:6]
    expected = Engine(model_dir, block_size=8).generate(prompts, params)

    first = Engine(model_dir, block_size=8)
    ids = [first.add_request(p, params, index=i) for i, p in enumerate(prompts)]
    while len(first.get(ids[1]).output_ids) < 5:
        first.step()
    moved = first.get(ids[1])
    assert not moved.is_finished and moved.num_computed > 0
    state = pickle.loads(pickle.dumps(first.suspend(ids[1], with_kv=with_kv)))
    assert first.allocator.num_free + sum(len(first.get(i).block_ids) for i in (ids[0], ids[2])) \
        == first.allocator.num_blocks  # the suspended coroutine's blocks came back at once
    assert len(state) < 64_000 or with_kv

    second = Engine(model_dir, block_size=8)
    resumed = second.resume(state)
    assert second.get(resumed).status is (SeqStatus.RUNNING if with_kv else SeqStatus.WAITING)
    assert run_to_end(second, resumed) == expected[1].token_ids
    assert [run_to_end(first, i) for i in (ids[0], ids[2])] == [expected[0].token_ids, expected[2].token_ids]
    if arch == "llama" and params is GREEDY:
        assert expected[1].token_ids == tiny_models.reference_generate(model_dir, prompts[1], 14, ignore_eos=True)


def test_resume_refuses_another_models_state(checkpoint_factory, prompt_ids) -> None:
    a = Engine(checkpoint_factory("mixtral"), block_size=8)
    sid = a.add_request(prompt_ids[2], GREEDY)
    a.step()
    state = a.suspend(sid)
    with pytest.raises(StateError, match="made for model"):
        Engine(checkpoint_factory("olmoe"), block_size=8).resume(state)
    with pytest.raises(StateError, match="not a batchgen coroutine"):
        a.resume(b"garbage")


def test_moe_batches_are_larger_than_attention_micro_batches(checkpoint_factory, prompt_ids) -> None:
    """A KV budget of 48 tokens allows ~2 short sequences per attention call; the MoE stage of
    each layer still runs once over every micro-batch's tokens."""
    model_dir = checkpoint_factory("mixtral")
    prompts = [p for p in tiny_models.mixed_prompts(model_dir, (5, 9, 13, 2, 7, 11, 3, 6) * 2)]
    engine = Engine(model_dir, block_size=8, attention_kv_tokens=48)
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    summary = engine.stats_summary()
    # the first layer's MoE stage of each forward (every layer is MoE here; the last one's may
    # run the sampling rows alone)
    layers = engine.executor.model.num_layers
    first = list(engine.stats.moe_batches)[::layers]
    assert len(first) == summary["forwards"]
    assert sum(first) / len(first) >= 4 * summary["attention_batch_mean"], summary
    assert summary["tokens_per_expert_call_mean"] > 0
    for p, out in zip(prompts, outs):
        assert out.token_ids == tiny_models.reference_generate(model_dir, p, 8)


@pytest.mark.parametrize("swap_space_bytes, host_link", [(0, 10**10), (1 << 30, 10**12)],
                         ids=["recompute", "host-swap"])
def test_eviction_resumes_by_recompute_or_from_host_memory(checkpoint_factory, prompt_ids,
                                                           swap_space_bytes: int, host_link: int) -> None:
    model_dir = checkpoint_factory("deepseek_v2")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in Engine(model_dir, block_size=8).generate(prompt_ids, params)]
    tight = Engine(model_dir, block_size=8, num_kv_blocks=40, swap_space_bytes=swap_space_bytes,
                   host_link_bytes_per_s=host_link)
    swapped = []
    original = tight.host_kv.swap_out

    def spy(seq, blocks, n):  # record what the engine chose for each eviction
        original(seq, blocks, n)
        swapped.append(seq.status is SeqStatus.SWAPPED)

    tight.host_kv.swap_out = spy  # type: ignore[method-assign]
    assert [o.token_ids for o in tight.generate(prompt_ids, params)] == expected
    assert swapped and all(swapped) == bool(swap_space_bytes) and any(swapped) == bool(swap_space_bytes)
    assert tight.host_kv.kv == {} and tight.host_kv.nbytes == 0


def test_load_reports_remaining_work(checkpoint_factory, prompt_ids) -> None:
    engine = Engine(checkpoint_factory("qwen2_moe"), block_size=8)
    for p in prompt_ids[:4]:
        engine.add_request(p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    before = engine.load_report()
    assert before.waiting == 4 and before.remaining == 40 and set(before.remaining_by_id.values()) == {10}
    engine.step()
    after = engine.load()  # the dict of the older name
    assert after["running"] == 4 and after["remaining_tokens"] == 36 and 0 < after["kv_used_fraction"] < 1


def test_resume_with_kv_into_a_full_pool_waits_in_host_memory(checkpoint_factory, prompt_ids) -> None:
    model_dir = checkpoint_factory("mixtral")
    expected = Engine(model_dir, block_size=8).generate([prompt_ids[6]], GREEDY)[0].token_ids
    first = Engine(model_dir, block_size=8)
    sid = first.add_request(prompt_ids[6], GREEDY)
    for _ in range(3):
        first.step()
    state = first.suspend(sid, with_kv=True)
    busy = Engine(model_dir, block_size=8, num_kv_blocks=30)
    hog = busy.add_request(prompt_ids[7], GREEDY)  # 200 prompt tokens take most of the pool
    busy.step()
    resumed = busy.resume(state)
    assert busy.get(resumed).status is SeqStatus.SWAPPED
    assert run_to_end(busy, resumed) == expected
    run_to_end(busy, hog)
    assert busy.allocator.num_free == busy.allocator.num_blocks and busy.host_kv.nbytes == 0


def test_resume_refuses_a_sequence_too_long_for_this_engine(checkpoint_factory, prompt_ids) -> None:
    model_dir = checkpoint_factory("mixtral")
    first = Engine(model_dir, block_size=8)
    sid = first.add_request(prompt_ids[7], GREEDY)
    first.step()
    small = Engine(model_dir, block_size=8, max_model_len=64)
    out = small.pop_output(small.resume(first.suspend(sid)))
    assert out.finish_reason == "error" and "cannot resume here" in out.error and "max_model_len" in out.error


@pytest.mark.parametrize("arch", ["mixtral", "llama", "deepseek_v3"])
def test_last_layer_runs_on_the_sampling_rows_only(checkpoint_factory, monkeypatch: pytest.MonkeyPatch,
                                                    arch: str) -> None:
    """Past the last layer's KV write only the rows that sample are read: that layer attends for
    those rows alone and its attention stage gives back only them (its KV written for all), its
    FFN/MoE stage gets them (and does not run for a prompt chunk that samples nothing), every
    other stage gets all rows, and the tokens stay transformers'."""
    model_dir = checkpoint_factory(arch)
    prompts = list(tiny_models.mixed_prompts(model_dir, (21, 5, 9)))
    engine = Engine(model_dir, block_size=8, max_num_batched_tokens=16, enable_prefix_caching=False)
    model = engine.executor.model
    last = model.num_layers - 1
    calls: list[tuple[int, int]] = []
    ffn_stage = model.ffn_stage

    def spy(layer, hidden, on_route=None):
        calls.append((layer, hidden.shape[0]))
        return ffn_stage(layer, hidden, on_route)

    model.ffn_stage = spy  # type: ignore[method-assign]
    attended: list[tuple[int, int]] = []  # (layer, rows out) of each attention stage
    attention_stage = model.attention_stage

    def spy_attention(layer, hidden, batch, cache, rows=None):
        out = attention_stage(layer, hidden, batch, cache, rows)
        attended.append((layer, out.shape[0]))
        return out

    model.attention_stage = spy_attention  # type: ignore[method-assign]
    queries: list[int] = []  # rows of each attention computed (the paged attention's queries)
    paged = attention.paged_attention

    def spy_paged(q, *args, **kwargs):
        queries.append(q.shape[0])
        return paged(q, *args, **kwargs)

    monkeypatch.setattr(attention, "paged_attention", spy_paged)
    monkeypatch.setattr(mla, "paged_attention", spy_paged)
    forwards: list[tuple[int, int, list[tuple[int, int]]]] = []  # (rows fed, rows sampling, FFN calls)
    execute = engine.executor.execute

    def forward(plan):
        calls.clear()
        attended.clear()
        queries.clear()
        samplers, logits = execute(plan)
        forwards.append((plan.num_tokens, len(samplers), list(calls)))
        assert attended == [(layer, plan.num_tokens) for layer in range(last)] + [(last, len(samplers))]
        attends = plan.num_tokens if arch == "deepseek_v3" else len(samplers)
        assert queries == [plan.num_tokens] * last + ([attends] if attends else [])
        return samplers, logits

    engine.executor.execute = forward  # type: ignore[method-assign]
    outs = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.token_ids == tiny_models.reference_generate(model_dir, p, 4, ignore_eos=True)
    assert forwards[0] == (16, 0, [(layer, 16) for layer in range(last)])  # 16 of the first prompt's 21 rows
    for rows, sampling, ffn in forwards:
        expected = [(layer, rows) for layer in range(last)] + ([(last, sampling)] if sampling else [])
        assert ffn == expected
    assert any(sampling and sampling < rows for rows, sampling, _ in forwards)
