"""Triton kernel of paged decode attention. Imported only by `paged_attention.py`'s launchers,
which check their inputs; `paged_attention_reference.py` holds the semantics.

Under TRITON_INTERPRET=1 (set before this module is imported) it runs on CPU tensors in
Triton's interpreter, which is how the tests exercise it without a GPU.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    stride_qs,
    stride_qh,
    stride_cache,
    stride_table,
    stride_os,
    stride_oh,
    block_size,
    window,
    scale,
    group,
    key_head_stride,
    value_offset,
    value_head_stride,
    D1,
    D2,
    DV,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_D2: tl.constexpr,
    VALUE_IS_KEY: tl.constexpr,
    FP32_IEEE: tl.constexpr,
):
    """One new token per sequence attends its whole context, read from the paged cache in place.

    # S sequences, Hq query heads, Hk kv heads, G = Hq / Hk, MB blocks per table, W cache width
    q: [S, Hq, D1 + D2]; cache: [slots, W], slot = block * block_size + offset; block_tables:
    [S, MB] int32; context_lens: [S] int32 (>= 1); out: [S, Hq, DV].
    Key of kv head k at a slot: cache[slot, k * key_head_stride + (0 .. D1 + D2)]; value:
    cache[slot, value_offset + k * value_head_stride + (0 .. DV)], or (VALUE_IS_KEY, MLA's
    latent) the key's first D1 = DV floats, loaded once. Query head h reads kv head h // G.
    window > 0: only the last `window` positions are attended (sliding window).

    Program (s, k, b): query heads k*G + b*BLOCK_H + (0 .. BLOCK_H) of sequence s, online
    softmax over the context in tiles of BLOCK_N tokens; fp32 accumulation.
    """
    s = tl.program_id(0)
    kv_head = tl.program_id(1)
    hb = tl.program_id(2)
    offs_g = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_g < group
    heads = kv_head * group + offs_g
    offs_d1 = tl.arange(0, BLOCK_D1)
    d1_mask = offs_d1 < D1

    q_row = q_ptr + s.to(tl.int64) * stride_qs + heads[:, None] * stride_qh
    q1 = tl.load(q_row + offs_d1[None, :], mask=h_mask[:, None] & d1_mask[None, :], other=0.0)
    if HAS_D2:
        offs_d2 = tl.arange(0, BLOCK_D2)
        d2_mask = offs_d2 < D2
        q2 = tl.load(q_row + D1 + offs_d2[None, :], mask=h_mask[:, None] & d2_mask[None, :], other=0.0)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV

    ctx = tl.load(context_lens_ptr + s)
    lo = 0
    if window > 0:
        lo = tl.maximum(ctx - window, 0)
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), dtype=tl.float32)
    key_base = cache_ptr + kv_head * key_head_stride
    value_base = cache_ptr + value_offset + kv_head * value_head_stride
    table = block_tables_ptr + s.to(tl.int64) * stride_table
    for n0 in range(lo, ctx, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < ctx
        block = tl.load(table + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
        slot = block * block_size + offs_n % block_size
        rows = slot[:, None] * stride_cache  # [BLOCK_N, 1]
        k1 = tl.load(key_base + rows + offs_d1[None, :], mask=n_mask[:, None] & d1_mask[None, :], other=0.0)
        if FP32_IEEE:
            scores = tl.dot(q1, tl.trans(k1), input_precision="ieee")
        else:
            scores = tl.dot(q1, tl.trans(k1))
        if HAS_D2:
            k2 = tl.load(key_base + rows + D1 + offs_d2[None, :], mask=n_mask[:, None] & d2_mask[None, :],
                         other=0.0)
            if FP32_IEEE:
                scores = tl.dot(q2, tl.trans(k2), scores, input_precision="ieee")
            else:
                scores = tl.dot(q2, tl.trans(k2), scores)
        scores = tl.where(n_mask[None, :], scores * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        # every tile holds at least one real token (n0 < ctx), so m_new is finite
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        if VALUE_IS_KEY:
            v = k1
        else:
            v = tl.load(value_base + rows + offs_dv[None, :], mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
        if FP32_IEEE:
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_ptrs = out_ptr + s.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & dv_mask[None, :])
