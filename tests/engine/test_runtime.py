"""The sequence coroutine runtime: suspend/resume across engines, expert-level batching, swap."""
from __future__ import annotations

import pickle

import pytest
import tiny_models

from batchgen import Engine, SamplingParams, StateError
from batchgen.models import attention, mla
from batchgen.runtime.sequence import SeqStatus
from batchgen_kernels import tiled_linear
from batchgen_kernels.tiled_linear import TiledWeight

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
    model = engine.executor.model
    first: list[int] = []  # the first layer's MoE batch in each forward (the last layer's may be
    ffn_stage = model.ffn_stage  # the sampling rows alone)

    def spy(layer, hidden, *args):
        if layer == 0:
            first.append(hidden.shape[0])
        return ffn_stage(layer, hidden, *args)

    model.ffn_stage = spy  # type: ignore[method-assign]
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    summary = engine.stats_summary()
    assert model.is_moe_layer(0) and len(first) == summary["forwards"]
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


LAST_LAYER_CASES = [("mixtral", False, None), ("llama", True, None), ("mixtral", True, 24), ("deepseek_v3", False, None)]


@pytest.mark.parametrize(("arch", "tiles", "kv_tokens"), LAST_LAYER_CASES,
                         ids=[f"{a}{'-tiles' if t else ''}{f'-micro{k}' if k else ''}" for a, t, k in LAST_LAYER_CASES])
def test_last_layer_runs_on_the_sampling_rows_only(checkpoint_factory, monkeypatch: pytest.MonkeyPatch, arch: str,
                                                    tiles: bool, kv_tokens: int | None) -> None:
    """Past the last layer's KV write only the rows that sample are read: that layer projects
    keys and values alone for the others (dense weights in tiles: the projection is cut), attends
    for the sampling rows alone and gives back only them, its FFN/MoE stage gets them (and does
    not run for a prompt chunk that samples nothing), every other stage gets all rows; the
    sampled logits are transformers' and so are the tokens. Latent attention attends every row.
    A prompt of 150 tokens has chunks past the paged kernel's context; attention micro-batches of
    24 KV tokens split the forwards."""
    if tiles:  # the tiny models' projections are below TILE_BYTES: tile them anyway
        monkeypatch.setattr(tiled_linear, "TILE_BYTES", 0)
    model_dir = checkpoint_factory(arch)
    prompts = list(tiny_models.mixed_prompts(model_dir, (21, 5, 9, 150)))
    engine = Engine(model_dir, block_size=8, max_num_batched_tokens=16, enable_prefix_caching=False,
                    attention_kv_tokens=kv_tokens)
    model = engine.executor.model
    last = model.num_layers - 1
    a = model.spec.layers[last].attention
    kv_width = 2 * getattr(a, "num_kv_heads", 0) * getattr(a, "head_dim", 0)
    if tiles:
        assert isinstance(model.weights.layers[last].attention.qkv, TiledWeight)
    calls: list[tuple[int, int]] = []  # (layer, rows) of each FFN stage
    attended: list[tuple[int, int]] = []  # (layer, rows out) of each attention stage (micro-batch)
    queries: list[int] = []  # rows of each attention computed (the paged attention's queries)
    projected: list[tuple[int, int]] = []  # (rows, outputs) of each key-and-value-only projection
    ffn_stage, attention_stage, paged, linear = (model.ffn_stage, model.attention_stage, attention.paged_attention,
                                                 attention.linear)

    def spy_ffn(layer, hidden, on_route=None, next_rows=None):
        calls.append((layer, hidden.shape[0]))
        return ffn_stage(layer, hidden, on_route, next_rows)

    def spy_attention(layer, hidden, batch, cache, rows=None):
        out = attention_stage(layer, hidden, batch, cache, rows)
        attended.append((layer, out.shape[0]))
        return out

    def spy_paged(q, *args, **kwargs):
        queries.append(q.shape[0])
        return paged(q, *args, **kwargs)

    qkv = getattr(model.weights.layers[last].attention, "qkv", None)

    def spy_linear(x, w, bias=None):  # a cut of the last layer's q/k/v tiles: keys and values alone
        if (isinstance(w, TiledWeight) and isinstance(qkv, TiledWeight) and w.tiles is not qkv.tiles
                and w.tiles.untyped_storage().data_ptr() == qkv.tiles.untyped_storage().data_ptr()):
            projected.append((x.shape[0], w.out_features))
        return linear(x, w, bias)

    model.ffn_stage = spy_ffn  # type: ignore[method-assign]
    model.attention_stage = spy_attention  # type: ignore[method-assign]
    monkeypatch.setattr(attention, "paged_attention", spy_paged)
    monkeypatch.setattr(mla, "paged_attention", spy_paged)
    monkeypatch.setattr(attention, "linear", spy_linear)
    reference = {tuple(p): tiny_models.reference_logits(model_dir, p)[-1] for p in prompts}
    forwards: list[tuple[int, int]] = []  # (rows fed, rows sampling)
    execute = engine.executor.execute

    def forward(plan):
        for log in (calls, attended, queries, projected):
            log.clear()
        samplers, logits = execute(plan)
        rows, sampling = plan.num_tokens, len(samplers)
        forwards.append((rows, sampling))
        assert calls == [(layer, rows) for layer in range(last)] + ([(last, sampling)] if sampling else [])
        assert [n for layer, n in attended if layer < last] and sum(n for layer, n in attended if layer == last) == sampling
        assert sum(n for layer, n in attended if layer < last) == rows * last
        attends = rows if arch == "deepseek_v3" else sampling
        assert sum(queries) == rows * last + attends
        assert sum(n for n, _ in projected) == (rows - sampling if tiles else 0)  # (one call per micro-batch)
        assert all(width == kv_width for _, width in projected) and bool(projected) == (tiles and sampling < rows)
        for item, row in zip(samplers, logits):  # a prompt's first token: transformers' logits
            if not item.seq.output_ids:
                want = reference[tuple(item.seq.prompt_ids)]
                assert (row - want).abs().max() <= 1e-4 * want.abs().max()
        return samplers, logits

    engine.executor.execute = forward  # type: ignore[method-assign]
    outs = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.token_ids == tiny_models.reference_generate(model_dir, p, 4, ignore_eos=True)
    assert forwards[0] == (16, 0)  # 16 of the first prompt's 21 rows
    assert any(0 < sampling < rows for rows, sampling in forwards)
