"""Prefix caching in the engine: greedy tokens identical with it on and off (and to transformers)
for every architecture, with chunked prefill, preemption, host swap, suspend/resume, ordering."""
from __future__ import annotations

import pickle

import dask
import pytest
import tiny_models

from batchgen import Engine, SamplingParams

BLOCK = 8
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def shared_prefix_prompts(prompt_ids: list[list[int]]) -> list[list[int]]:
    """An 80-token shared head (past mixtral's 64-token sliding window; 10 blocks of 8), then
    tails of 5, 0 (the head alone: a full hit must still compute its last token), 13 and 1."""
    head = prompt_ids[-1][:80]
    tails = [prompt_ids[2], [], prompt_ids[3], prompt_ids[0]]
    return [head + t for t in tails]


@pytest.mark.parametrize("arch", sorted(tiny_models.ARCHS))
def test_greedy_identical_with_caching_on_and_off_and_to_transformers(arch: str, checkpoint_factory,
                                                                      prompt_ids) -> None:
    model_dir = checkpoint_factory(arch)
    prompts = shared_prefix_prompts(prompt_ids)
    # the first row alone, so every later one finds the head cached
    on = Engine(model_dir, block_size=BLOCK)
    first = on.generate(prompts[:1], GREEDY)
    outs_on = first + on.generate(prompts[1:], GREEDY)
    outs_off = Engine(model_dir, block_size=BLOCK, enable_prefix_caching=False).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off]
    assert [o.num_cached_tokens for o in outs_on] == [0, 72, 80, 80]  # 72: the last token is computed
    assert [o.num_cached_tokens for o in outs_off] == [0, 0, 0, 0]
    s = on.stats_summary()
    assert s["prefix_cache_hits"] == 232 and s["prefix_cache_queries"] == sum(map(len, prompts))
    for prompt, out in zip(prompts, outs_on):
        assert out.token_ids == tiny_models.reference_generate(model_dir, prompt, 6, ignore_eos=True), arch


@pytest.fixture(scope="module")
def mixtral(checkpoint_factory):
    return checkpoint_factory("mixtral")


@pytest.fixture(scope="module")
def deepseek(checkpoint_factory):
    return checkpoint_factory("deepseek_v3")


def many(prompt_ids: list[list[int]], n: int = 10) -> list[list[int]]:
    """n rows over 3 distinct 40-token instructions, interleaved, each with its own tail."""
    heads = [prompt_ids[-1][:40], prompt_ids[-2][:40], prompt_ids[-1][100:140]]
    return [heads[i % 3] + prompt_ids[1 + i % 5][: 3 + i] for i in range(n)]


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_chunked_prefill_micro_batches_and_batch_company(arch: str, checkpoint_factory, prompt_ids) -> None:
    model_dir = checkpoint_factory(arch)
    prompts = many(prompt_ids)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    off = Engine(model_dir, block_size=BLOCK, enable_prefix_caching=False).generate(prompts, params)
    # 20-token chunks: prefixes are computed over several forwards while others join them
    on = Engine(model_dir, block_size=BLOCK, max_num_batched_tokens=20, attention_kv_tokens=64)
    outs = on.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in off]
    assert on.stats_summary()["prefix_cache_hit_rate"] > 0.5


def test_preemption_recomputes_from_the_cache_and_host_swap_stays_exact(mixtral, prompt_ids) -> None:
    prompts = many(prompt_ids)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in Engine(mixtral, block_size=BLOCK, enable_prefix_caching=False)
                .generate(prompts, params)]
    for swap in (0, 4 << 30):  # recompute only; host swap
        tight = Engine(mixtral, block_size=BLOCK, num_kv_blocks=24, swap_space_bytes=swap)
        outs = tight.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected, swap
        s = tight.stats_summary()
        assert s["preemptions"] > 0 and s["prefix_cache_hits"] > 0
        assert tight.allocator.num_free == tight.allocator.num_blocks  # every hold given back
        if not swap:  # recompute queries include preempted rows' second admissions
            assert s["prefix_cache_queries"] > sum(map(len, prompts))


def test_rows_never_see_each_others_later_writes(mixtral, prompt_ids) -> None:
    """Rows sharing a prefix decode on side by side; each gets the tokens it gets alone."""
    prompts = [prompt_ids[-1][:48]] * 3 + [prompt_ids[-1][:48] + [5]]
    seeded = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3, 4)]
    alone = [Engine(mixtral, block_size=BLOCK, enable_prefix_caching=False).generate([p], [s])[0].token_ids
             for p, s in zip(prompts, seeded)]
    engine = Engine(mixtral, block_size=BLOCK)
    outs = engine.generate(prompts, seeded)
    assert [o.token_ids for o in outs] == alone
    assert len({tuple(t) for t in alone}) > 1  # the rows did diverge after the shared prefix


@pytest.mark.parametrize("with_kv", [False, True], ids=["recompute", "kv-travels"])
def test_suspend_resume_refinds_the_prefix_on_the_new_engine(deepseek, prompt_ids, with_kv: bool) -> None:
    prompts = many(prompt_ids, 4)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = Engine(deepseek, block_size=BLOCK, enable_prefix_caching=False).generate(prompts, params)
    src, dst = Engine(deepseek, block_size=BLOCK), Engine(deepseek, block_size=BLOCK)
    dst.generate([prompts[0][:40] + [7]], SamplingParams(max_tokens=1))  # dst holds instruction 0
    hits_before = dst.prefix_cache.stats.hits
    sid = src.add_request(prompts[3], params)  # instruction 0 again
    while len(src.get(sid).output_ids) < 4:
        src.step()
    state = pickle.loads(pickle.dumps(src.suspend(sid, with_kv=with_kv)))
    moved = dst.resume(state)
    while not dst.get(moved).is_finished:
        dst.step()
    assert dst.pop_output(moved).token_ids == expected[3].token_ids
    if not with_kv:  # recomputing, it found instruction 0's 5 blocks cached here
        assert dst.prefix_cache.stats.hits - hits_before == 40
    # blocks the resumed row filled are shareable on dst from then on
    again = dst.generate([prompts[3]], params)[0]
    assert again.token_ids == expected[3].token_ids and again.num_cached_tokens >= 40


def test_prefix_order_beats_fifo_under_a_tight_pool_with_identical_tokens(mixtral, prompt_ids) -> None:
    """Interleaved instructions, a pool that cannot keep all of them beside the running rows."""
    heads = [prompt_ids[-1][i:i + 48] for i in range(0, 144, 12)]  # 12 instructions of 6 blocks
    prompts = [heads[i % 12] + [10 + i % 50, 11 + i % 40] for i in range(72)]  # 6 rows each
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    results = {}
    for order in ("prefix", "fifo", "length"):
        engine = Engine(mixtral, block_size=BLOCK, num_kv_blocks=40, max_num_seqs=4, admission_order=order)
        outs = list(engine.run_requests(((p, params) for p in prompts), max_in_flight=72))
        results[order] = (sorted((i, o.token_ids) for i, o in outs), engine.stats_summary())
    assert results["prefix"][0] == results["fifo"][0] == results["length"][0]
    hit_prefix, hit_fifo, hit_length = (results[o][1]["prefix_cache_hit_rate"] for o in ("prefix", "fifo", "length"))
    # prefix order: the first row of each instruction computes it, 5 find it (5/6 of 48/50 tokens)
    assert hit_prefix > 0.7 and hit_fifo < 0.3, (hit_prefix, hit_fifo)
    # length-aware admission keeps prefix order while lengths are not predictable (all rows 3 tokens)
    assert hit_length == hit_prefix


def test_option_from_dask_config_and_bad_values(mixtral) -> None:
    with dask.config.set({"batchgen.enable-prefix-caching": False}):
        assert Engine(mixtral, block_size=BLOCK).prefix_cache is None
    assert Engine(mixtral, block_size=BLOCK, enable_prefix_caching=False).stats_summary().get(
        "prefix_cache_hits") is None
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        Engine(mixtral, enable_prefix_caching="yes")
    with pytest.raises(ValueError, match="admission_order"):
        Engine(mixtral, admission_order="random")


def test_progress_status_shows_the_hit_rate(mixtral, prompt_ids) -> None:
    engine = Engine(mixtral, block_size=BLOCK)
    assert engine.progress_status() == ""
    engine.generate(many(prompt_ids, 6), GREEDY)
    rate = engine.stats_summary()["prefix_cache_hit_rate"]
    assert engine.progress_status() == f"prefix cache: {100 * rate:.0f}% of prompt tokens hit"
