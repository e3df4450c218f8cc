"""Paged decode attention: the torch reference against dense attention (always), the Triton
kernel against the reference (Triton's CPU interpreter without a GPU; compiled on CUDA)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must precede the first import of triton and of the kernel module (which picks interpreter
    # or compiler when imported). Only ever set on machines without a GPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from batchgen_kernels import KernelInputError, triton_available  # noqa: E402
from batchgen_kernels.paged_attention import paged_attention_gqa, paged_attention_mla  # noqa: E402
from batchgen_kernels.paged_attention_reference import (  # noqa: E402
    paged_attention_gqa_reference,
    paged_attention_mla_reference,
)

DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
# against the fp32 reference computed from the same (rounded) inputs; outputs are O(1)
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
# context lengths: 1, shorter than a block, not a multiple of any block or tile size, > 2 tiles
LENGTHS = (1, 7, 33, 70)


def paged(lengths: tuple[int, ...], width: int, block_size: int, dtype: torch.dtype, seed: int,
          device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A cache [slots, width] whose blocks are handed out in shuffled order (plus unused ones,
    filled with garbage), -> (cache, block_tables [S, MB] int32 padded with 0, context_lens [S],
    per sequence its rows [L, width] in position order)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + 3
    cache = torch.randn(num_blocks * block_size, width, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist()
    width_mb = max(need) + 1  # a spare column: tables are wider than any context needs
    tables = torch.zeros(len(lengths), width_mb, dtype=torch.int32)
    rows = []
    for s, n in enumerate(lengths):
        blocks, order = order[:need[s]], order[need[s]:]
        tables[s, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(n)
        rows.append(cache[torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size])
    cache = cache.to(device=device, dtype=dtype)
    rows = [r.to(device=device, dtype=dtype) for r in rows]
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return cache, tables.to(device), lens, rows


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [Hq, Dk], k: [L, Hk, Dk], v: [L, Hk, Dv] -> [Hq, Dv] by SDPA (enable_gqa), fp32."""
    out = F.scaled_dot_product_attention(q.float().unsqueeze(1), k.float().transpose(0, 1), v.float().transpose(0, 1),
                                         scale=scale, enable_gqa=True)
    return out.squeeze(1)


GQA_SHAPES = [(3, 1, 8), (5, 5, 12), (6, 3, 40), (40, 2, 16), (8, 2, 64)]  # (Hq, Hk, D): odd, G > BLOCK_H
BLOCK_SIZES = (1, 5, 16)


@pytest.mark.parametrize("hq, hk, d", GQA_SHAPES)
@pytest.mark.parametrize("window", [None, 6])
def test_gqa_reference_is_dense_attention(hq: int, hk: int, d: int, window: int | None) -> None:
    cache, tables, lens, rows = paged(LENGTHS, 2 * hk * d, 5, torch.float32, seed=hq, device="cpu")
    q = torch.randn(len(LENGTHS), hq, d)
    got = paged_attention_gqa_reference(q, cache, tables, lens, 5, hk, d ** -0.5, window)
    for s, r in enumerate(rows):
        r = r[-window:] if window else r
        k, v = r[:, :hk * d].unflatten(1, (hk, d)), r[:, hk * d:].unflatten(1, (hk, d))
        torch.testing.assert_close(got[s], dense(q[s], k, v, d ** -0.5), atol=1e-5, rtol=1e-5)


# (Hq, kv_lora_rank, rope): the tiny test checkpoints, odd sizes, DeepSeek-V2-Lite (16 heads) and
# V3 (128 heads) at their real latent and rope widths
MLA_SHAPES = [(4, 32, 8), (3, 40, 12), (16, 512, 64), (128, 512, 64)]


@pytest.mark.parametrize("hq, r, rope", MLA_SHAPES[:2])
def test_mla_reference_is_dense_attention_over_the_latent(hq: int, r: int, rope: int) -> None:
    cache, tables, lens, rows = paged(LENGTHS, r + rope, 16, torch.float32, seed=r, device="cpu")
    q = torch.randn(len(LENGTHS), hq, r + rope)
    got = paged_attention_mla_reference(q, cache, tables, lens, 16, r, 0.1)
    for s, rr in enumerate(rows):
        torch.testing.assert_close(got[s], dense(q[s], rr.unsqueeze(1), rr[:, None, :r], 0.1), atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("hq, hk, d", GQA_SHAPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_gqa_kernel_matches_reference(hq: int, hk: int, d: int, block_size: int, dtype: torch.dtype) -> None:
    cache, tables, lens, _ = paged(LENGTHS, 2 * hk * d, block_size, dtype, seed=block_size)
    q = torch.randn(len(LENGTHS), hq, d, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    got = paged_attention_gqa(q, cache, tables, lens, block_size, hk, d ** -0.5)
    want = paged_attention_gqa_reference(q.float(), cache.float(), tables, lens, block_size, hk, d ** -0.5)
    assert got.dtype == dtype and got.shape == (len(LENGTHS), hq, d)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@needs_triton
@pytest.mark.parametrize("window", [1, 6, 40, 1000])
def test_gqa_kernel_sliding_window(window: int) -> None:
    cache, tables, lens, _ = paged(LENGTHS, 2 * 2 * 16, 5, torch.float32, seed=window)
    q = torch.randn(len(LENGTHS), 6, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = paged_attention_gqa(q, cache, tables, lens, 5, 2, 0.25, window)
    torch.testing.assert_close(got, paged_attention_gqa_reference(q, cache, tables, lens, 5, 2, 0.25, window),
                               atol=TOL[torch.float32], rtol=TOL[torch.float32])


@needs_triton
def test_gqa_kernel_reads_strided_query() -> None:
    """q sliced out of a fused qkv projection: rows strided, last dim unit stride."""
    hq, hk, d = 6, 3, 8
    cache, tables, lens, _ = paged(LENGTHS, 2 * hk * d, 16, torch.float32, seed=3)
    qkv = torch.randn(len(LENGTHS), (hq + 2 * hk) * d, device=DEVICE)
    q = qkv[:, :hq * d].unflatten(1, (hq, d))
    got = paged_attention_gqa(q, cache, tables, lens, 16, hk, 0.3)
    torch.testing.assert_close(got, paged_attention_gqa_reference(q.contiguous(), cache, tables, lens, 16, hk, 0.3),
                               atol=TOL[torch.float32], rtol=TOL[torch.float32])


@needs_triton
@pytest.mark.parametrize("hq, r, rope", MLA_SHAPES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_mla_kernel_matches_reference(hq: int, r: int, rope: int, block_size: int, dtype: torch.dtype) -> None:
    lengths = LENGTHS if hq < 128 else (1, 33)  # V3's 128 heads: fewer sequences, same awkward lengths
    cache, tables, lens, _ = paged(lengths, r + rope, block_size, dtype, seed=hq)
    q = (torch.randn(len(lengths), hq, r + rope, generator=torch.Generator().manual_seed(4)) / 4).to(DEVICE, dtype)
    scale = (r + rope) ** -0.5
    got = paged_attention_mla(q, cache, tables, lens, block_size, r, scale)
    want = paged_attention_mla_reference(q.float(), cache.float(), tables, lens, block_size, r, scale)
    assert got.shape == (len(lengths), hq, r)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@needs_triton
def test_kernel_with_no_sequences() -> None:
    cache = torch.zeros(16, 32, device=DEVICE)
    out = paged_attention_gqa(torch.zeros(0, 4, 8, device=DEVICE), cache, torch.zeros(0, 1, dtype=torch.int32,
                              device=DEVICE), torch.zeros(0, dtype=torch.int32, device=DEVICE), 16, 2, 1.0)
    assert out.shape == (0, 4, 8)


@pytest.mark.parametrize("fn", [paged_attention_gqa, paged_attention_gqa_reference])
def test_bad_inputs_name_the_problem(fn) -> None:
    cache, tables, lens, _ = paged((3, 5), 2 * 2 * 8, 4, torch.float32, seed=0)
    q = torch.randn(2, 4, 8, device=DEVICE)
    with pytest.raises(KernelInputError, match="GQA cache rows must be"):
        fn(q, cache, tables, lens, 4, 3, 1.0)  # 4 query heads over 3 kv heads
    with pytest.raises(KernelInputError, match="block_tables must be"):
        fn(q, cache, tables[:1], lens, 4, 2, 1.0)
    with pytest.raises(KernelInputError, match="share one floating dtype"):
        fn(q.half(), cache, tables, lens, 4, 2, 1.0)
    with pytest.raises(KernelInputError, match="context_lens must be int32 or int64"):
        fn(q, cache, tables, lens.float(), 4, 2, 1.0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernels_compiled_at_serving_sizes(dtype: torch.dtype) -> None:
    """Compiled kernel, 64 sequences of up to 2k tokens: Mixtral's 32/8 x 128 and V3's MLA."""
    lengths = tuple(int(x) for x in torch.randint(1, 2048, (64,), generator=torch.Generator().manual_seed(0)))
    cache, tables, lens, _ = paged(lengths, 2 * 8 * 128, 16, dtype, seed=5)
    q = torch.randn(64, 32, 128, device="cuda", dtype=dtype)
    got = paged_attention_gqa(q, cache, tables, lens, 16, 8, 128 ** -0.5)
    want = paged_attention_gqa_reference(q.float(), cache.float(), tables, lens, 16, 8, 128 ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
    cache, tables, lens, _ = paged(lengths[:8], 576, 64, dtype, seed=6)
    q = (torch.randn(8, 128, 576, device="cuda") / 4).to(dtype)
    got = paged_attention_mla(q, cache, tables, lens, 64, 512, 576 ** -0.5)
    want = paged_attention_mla_reference(q.float(), cache.float(), tables, lens, 64, 512, 576 ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
