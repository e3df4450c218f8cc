"""Triton kernels of the fused MoE. Imported only by `fused_moe.py`'s launchers, which check
their inputs; `reference.py` holds the semantics.

Under TRITON_INTERPRET=1 (set before this module is imported) these run on CPU tensors in
Triton's interpreter, which is how the tests exercise them without a GPU.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    EM,
    num_valid_tokens,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    FP32_IEEE: tl.constexpr,
):
    """Grouped GEMM over the expert-aligned token blocks: c[s] = a[s // TOP_K] @ b[e].T.

    # S slots, EM = len(sorted_token_ids), E experts, N out features, K in features
    a: [*, K] rows indexed by slot // TOP_K; b: [E, N, K] (GATED: [E, 2N, K]); c: [S, N];
    topk_weights: [S]. One program computes a BLOCK_SIZE_M x BLOCK_SIZE_N tile of c for the
    block's expert. GATED: c = silu(a @ b[:N].T) * (a @ b[N:].T). MUL_ROUTED_WEIGHT: c is
    scaled by the slot's routing weight.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    # Grouped ordering: GROUP_SIZE_M row-blocks share the same column-blocks of b in L2.
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # The grid covers the worst-case padding; blocks past the real padded length do nothing.
    num_tokens_post_padded = tl.load(num_tokens_post_padded_ptr)
    if pid_m * BLOCK_SIZE_M >= num_tokens_post_padded:
        return

    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    offs_token = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)
    token_mask = offs_token < num_valid_tokens
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    a_ptrs = a_ptr + (offs_token[:, None] // TOP_K) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_mask = offs_k < K - k * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=token_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if FP32_IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=b_mask, other=0.0)
            if FP32_IEEE:
                acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + offs_token[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=token_mask[:, None] & n_mask[None, :])


@triton.jit
def align_count_kernel(
    topk_ids_ptr,
    chunk_counts_ptr,
    num_slots,
    num_experts,
    CHUNK: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """chunk_counts[c, e] = number of slots in chunk c routed to expert e.

    # S slots, C = cdiv(S, CHUNK) chunks, E experts
    topk_ids: [S]; chunk_counts: [C, E] int32.
    """
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(topk_ids_ptr + offs, mask=offs < num_slots, other=-1)
    offs_e = tl.arange(0, E_PAD)
    onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
    counts = tl.sum(onehot, axis=0)
    tl.store(chunk_counts_ptr + c * num_experts + offs_e, counts, mask=offs_e < num_experts)


@triton.jit
def align_offsets_kernel(
    chunk_counts_ptr,
    chunk_base_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    num_chunks,
    num_experts,
    num_blocks,
    block_size,
    E_PAD: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """One program: padded expert offsets, where each chunk's slots of each expert start, the
    expert of every block, and the padded total.

    # C chunks, E experts, NB = max_num_blocks
    chunk_counts: [C, E]; chunk_base: [C, E] (out); expert_ids: [NB] (out, -1 past the end);
    num_tokens_post_padded: [1] (out).
    """
    offs_e = tl.arange(0, E_PAD)
    e_mask = offs_e < num_experts
    total = tl.zeros((E_PAD,), dtype=tl.int32)
    for c in range(num_chunks):
        total += tl.load(chunk_counts_ptr + c * num_experts + offs_e, mask=e_mask, other=0)
    padded = (total + block_size - 1) // block_size * block_size
    ends = tl.cumsum(padded, axis=0)
    base = ends - padded
    for c in range(num_chunks):
        tl.store(chunk_base_ptr + c * num_experts + offs_e, base, mask=e_mask)
        base += tl.load(chunk_counts_ptr + c * num_experts + offs_e, mask=e_mask, other=0)
    tl.store(num_tokens_post_padded_ptr, tl.sum(padded, axis=0))

    # Block b belongs to the first expert whose padded group ends after it.
    block_ends = ends // block_size
    for b0 in range(0, num_blocks, BLOCKS):
        offs_b = b0 + tl.arange(0, BLOCKS)
        ended = (block_ends[None, :] <= offs_b[:, None]) & e_mask[None, :]
        expert = tl.sum(ended.to(tl.int32), axis=1)
        expert = tl.where(expert < num_experts, expert, -1)
        tl.store(expert_ids_ptr + offs_b, expert, mask=offs_b < num_blocks)


@triton.jit
def align_scatter_kernel(
    topk_ids_ptr,
    chunk_base_ptr,
    sorted_token_ids_ptr,
    num_slots,
    num_experts,
    CHUNK: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """Write each routed slot's index at its expert's base + its rank among earlier same-expert
    slots of the chunk, so slots stay ascending within an expert.

    # S slots, C chunks, E experts
    topk_ids: [S]; chunk_base: [C, E]; sorted_token_ids: [max_num_tokens_padded] (prefilled).
    """
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(topk_ids_ptr + offs, mask=offs < num_slots, other=-1)
    routed = (ids >= 0) & (ids < num_experts)
    onehot = (ids[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    safe_ids = tl.where(routed, ids, 0)
    base = tl.load(chunk_base_ptr + c * num_experts + safe_ids, mask=routed, other=0)
    tl.store(sorted_token_ids_ptr + base + rank, offs.to(tl.int32), mask=routed)
