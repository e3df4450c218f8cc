"""Decode attention in length groups: the same numbers as one padded batch and as plain softmax
attention over each sequence's own context, with and without a sliding window."""
from __future__ import annotations

import math

import pytest
import torch

from batchgen.models import attention
from batchgen.models.attention import AttentionBatch, paged_attention
from batchgen.models.cuda_decode import DecodeTables, gqa_decode, use_paged_kernel

BLOCK, HQ, HK, D = 4, 4, 2, 8


def setup(lengths: list[int]) -> tuple[list[tuple[int, int, list[int]]], torch.Tensor, torch.Tensor]:
    """One decoding token per sequence; blocks handed out in reverse so slots are not in order."""
    items, next_block = [], 0
    for n in lengths:
        blocks = list(range(next_block, next_block + -(-n // BLOCK)))[::-1]
        next_block += len(blocks)
        items.append((n - 1, 1, blocks))
    torch.manual_seed(0)
    return items, torch.randn(next_block * BLOCK, 2 * HK * D), torch.randn(len(lengths), HQ, D)


def expand(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = rows.split(HK * D, dim=-1)
    return k.reshape(*k.shape[:-1], HK, D), v.reshape(*v.shape[:-1], HK, D)


def naive(q: torch.Tensor, cache: torch.Tensor, items: list[tuple[int, int, list[int]]],
          window: int | None) -> torch.Tensor:
    out = []
    for (computed, _, blocks), qi in zip(items, q):
        slots = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(computed + 1)]
        if window is not None:
            slots = slots[-window:]
        k, v = expand(cache[slots])  # [L, HK, D]
        k, v = k.repeat_interleave(HQ // HK, dim=1), v.repeat_interleave(HQ // HK, dim=1)
        weights = torch.einsum("hd,lhd->hl", qi, k).div(math.sqrt(D)).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", weights, v))
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 6])
def test_length_groups_match_one_padded_batch_and_plain_attention(monkeypatch, window: int | None) -> None:
    lengths = [3, 100, 5, 9, 17, 64, 30, 31, 65, 2] * 4
    items, cache, q = setup(lengths)
    grouped = AttentionBatch.build(items, BLOCK, torch.device("cpu"))
    assert len(grouped.decode_groups) > 1
    assert sorted(r for g in grouped.decode_groups for r in g.rows.tolist()) == list(range(len(lengths)))
    out = paged_attention(q, grouped, cache, expand, 1 / math.sqrt(D), window, D)
    monkeypatch.setattr(attention, "MIN_DECODE_GROUP", 10**6)
    single = AttentionBatch.build(items, BLOCK, torch.device("cpu"))
    assert len(single.decode_groups) == 1
    torch.testing.assert_close(out, paged_attention(q, single, cache, expand, 1 / math.sqrt(D), window, D))
    torch.testing.assert_close(out, naive(q, cache, items, window))


def test_groups_bound_the_padding() -> None:
    lengths = list(range(10, 400, 3))
    items, _, _ = setup(lengths)
    batch = AttentionBatch.build(items, BLOCK, torch.device("cpu"))
    padded = sum(g.block_table.numel() * BLOCK for g in batch.decode_groups)
    assert padded < 1.3 * sum(lengths)  # one padded batch would be ~2x
    assert all(g.rows.shape[0] >= attention.MIN_DECODE_GROUP for g in batch.decode_groups[:-1])


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_mla_absorbed_decode_equals_expanding_the_latent(checkpoint_factory, prompt_ids, monkeypatch,
                                                         arch: str) -> None:
    from batchgen import Engine, SamplingParams
    from batchgen.models import mla

    model_dir = checkpoint_factory(arch)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = prompt_ids * 3  # enough decoding rows for several length groups
    absorbed = Engine(model_dir, block_size=8).generate(prompts, params)
    monkeypatch.setattr(mla, "paged_attention", lambda *args: attention.paged_attention(*args[:7]))  # no decode fn
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "0")  # nor the paged kernel: decode groups expand the latent
    expanded = Engine(model_dir, block_size=8).generate(prompts, params)
    for a, b in zip(absorbed, expanded):
        assert a.token_ids == b.token_ids
        for la, lb, t in zip(a.logprobs, b.logprobs, a.token_ids):
            assert la[t] == pytest.approx(lb[t], abs=1e-4)


def test_reading_whole_blocks_gives_the_rows_of_every_slot() -> None:
    cache = torch.randn(7 * BLOCK, 5)
    table = torch.tensor([[3, 0, 6], [1, 1, 2]])  # a block shared by two tables, as prefix caching does
    rows = attention.read_blocks(cache, table, BLOCK)
    slots = (table.unsqueeze(-1) * BLOCK + torch.arange(BLOCK)).flatten(1)  # [2, 3 * BLOCK]
    assert torch.equal(rows, cache[slots])


def test_read_blocks_with_the_cuda_graph_padding_slot_after_the_blocks() -> None:
    """With CUDA graphs the cache has one slot past its last block; block reads skip it."""
    from batchgen.models.attention import read_blocks

    cache = torch.cat([torch.arange(18 * 3, dtype=torch.float32).view(18, 3), torch.zeros(1, 3)])
    rows = read_blocks(cache, torch.tensor([[2, 0]]), 2)
    assert torch.equal(rows[0], torch.cat([cache[4:6], cache[0:2]]))


@pytest.mark.parametrize(("Q", "hq", "hk", "d"), [(1, 4, 2, 8), (37, 8, 4, 32), (96, 16, 4, 64), (20, 6, 6, 16)])
def test_a_prompts_first_chunk_is_plain_causal_attention(Q: int, hq: int, hk: int, d: int) -> None:
    """_attend_causal (SDPA's own causal mask and GQA, batched 4-D) against softmax attention
    written out, query head h reading KV head h // (hq / hk)."""
    g = torch.Generator().manual_seed(Q)
    q, k, v = (torch.randn(Q, h, d, generator=g) for h in (hq, hk, hk))
    scale = 1 / math.sqrt(d)
    kk, vv = k.repeat_interleave(hq // hk, dim=1), v.repeat_interleave(hq // hk, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q, kk) * scale
    scores = scores.masked_fill(torch.ones(Q, Q, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hql,lhd->qhd", scores.softmax(-1), vv)
    got = attention._attend_causal(q, k, v, scale)
    assert got.shape == (Q, hq, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not use_paged_kernel(torch.device("cpu"), torch.float32), reason="no CPU paged kernel here")
@pytest.mark.parametrize("window", [None, 6])
def test_short_prefill_chunks_in_the_cpu_kernel_equal_the_prefill_path(window: int | None) -> None:
    """Decodes, a prompt's first chunk, a later chunk and a prompt longer than the limit in one
    batch: with short chunks sent to the paged kernel a row per token, every row equals the batch
    attended with no chunk sent there (SDPA and the masked path for prefills)."""
    items, next_block = [], 0
    for computed, new in ((7, 1), (0, 20), (10, 7), (0, 40), (30, 1), (0, 3)):
        end = computed + new
        blocks = list(range(next_block, next_block + -(-end // BLOCK)))[::-1]
        next_block += len(blocks)
        items.append((computed, new, blocks))
    torch.manual_seed(1)
    cache = torch.randn(next_block * BLOCK, 2 * HK * D)
    batch = AttentionBatch.build(items, BLOCK, torch.device("cpu"), torch.float32)
    q = torch.randn(batch.num_tokens, HQ, D)
    fresh = cache[batch.slot_mapping]

    def paged(q_rows: torch.Tensor, kv: torch.Tensor, t: DecodeTables) -> torch.Tensor:
        return gqa_decode(q_rows, kv, t, HK, 1 / math.sqrt(D), window)

    def attend(limit: int) -> torch.Tensor:
        return paged_attention(q, batch, cache, expand, 1 / math.sqrt(D), window, D, paged=paged, fresh=fresh,
                               paged_prefill_context=limit)

    tables, left = batch.token_tables(32)
    assert [c.num_tokens for c in left] == [40]  # the only chunk with more than 32 tokens of context
    kernel_rows = [r for r in range(batch.num_tokens) if not 28 <= r < 68]  # (rows 28-67: the long prompt)
    assert tables is not None and tables.rows.tolist() == kernel_rows
    assert tables.context_lens.tolist() == [batch.positions[r] + 1 for r in kernel_rows]
    torch.testing.assert_close(attend(32), attend(0), rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(attend(64), attend(0), rtol=1e-5, atol=2e-6)  # every row in the kernel
