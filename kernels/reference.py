"""Plain-torch fused MoE: the semantics every kernel is tested against, and batchgen's CPU path.

Routing convention shared by every implementation here: a token slot whose expert id lies
outside [0, E) is not routed (vLLM's -1 for "expert lives on another rank"): it is left out of
the aligned blocks and contributes nothing to the output.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._checks import check_moe_inputs, check_topk_ids
from .errors import KernelInputError


def moe_align_sizes(num_slots: int, num_experts: int, block_size: int) -> tuple[int, int]:
    """Buffer lengths of `moe_align`'s outputs: (max_num_tokens_padded, max_num_blocks).

    An upper bound known without reading the ids (so the GPU path needs no host sync): each
    expert that has slots adds at most block_size - 1 padding, and at most min(E, slots)
    experts have slots. Rounded up to a whole number of blocks.
    """
    padded = num_slots + min(num_experts, num_slots) * (block_size - 1)
    num_blocks = -(-padded // block_size)
    return num_blocks * block_size, num_blocks


def _check_align_args(topk_ids: torch.Tensor, num_experts: int, block_size: int) -> None:
    check_topk_ids(topk_ids)
    if num_experts < 1:
        raise KernelInputError(f"num_experts must be >= 1, got {num_experts}")
    if block_size < 1:
        raise KernelInputError(f"block_size must be >= 1, got {block_size}")
    if topk_ids.numel() >= 2**31 - 1:
        raise KernelInputError(f"topk_ids has {topk_ids.numel()} slots; int32 indices need < 2**31 - 1")


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group token slots by expert, padding each expert's group to a multiple of block_size.

    # T tokens, A active per token, S = T*A slots, E experts, B block_size
    topk_ids: [T, A] int. Slot s is (token s // A, choice s % A).

    Returns, all int32 on topk_ids' device (vLLM's moe_align_block_size semantics):
    - sorted_token_ids: [max_num_tokens_padded] slot indices; expert 0's slots first, then
      expert 1's, ...; ascending within an expert; each expert's group padded with the sentinel
      S to a multiple of B; the tail past num_tokens_post_padded is all sentinel.
    - expert_ids: [max_num_blocks] the expert of each block of B entries; -1 past the end.
    - num_tokens_post_padded: [1] total length of the padded groups (a multiple of B).
    Sizes come from `moe_align_sizes`. No host sync, so this is also a usable GPU path.
    """
    _check_align_args(topk_ids, num_experts, block_size)
    device = topk_ids.device
    E, B = num_experts, block_size
    flat = topk_ids.reshape(-1).long()
    S = flat.numel()
    max_padded, max_blocks = moe_align_sizes(S, E, B)

    # Unrouted slots get key E and sort after every expert.
    key = torch.where((flat >= 0) & (flat < E), flat, E)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + B - 1) // B * B
    padded[E] = 0
    ends = padded.cumsum(0)  # [E+1]; ends[E] == ends[E-1] == total
    starts = ends - padded
    first = counts.cumsum(0) - counts  # where each expert's run begins in `order`

    key_sorted = key[order]
    rank = torch.arange(S, device=device) - first[key_sorted]
    # Unrouted slots are written to one spare entry past the end, then dropped.
    dest = torch.where(key_sorted < E, starts[key_sorted] + rank, max_padded)
    sorted_ids = torch.full((max_padded + 1,), S, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))

    block_ends = ends[:E] // B
    blocks = torch.arange(max_blocks, device=device)
    expert_ids = torch.searchsorted(block_ends, blocks, right=True)
    expert_ids = torch.where(expert_ids < E, expert_ids, -1).to(torch.int32)
    return sorted_ids[:max_padded], expert_ids, ends[E:].to(torch.int32)


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Mixture-of-experts SwiGLU MLP: for each token, the routing-weighted sum of its experts.

    # T tokens, E experts, A active per token, K hidden, N expert intermediate, S = T*A slots
    x: [T, K]; w13: [E, 2N, K] (gate rows [:N], up rows [N:]); w2: [E, K, N];
    topk_weights: [T, A] float; topk_ids: [T, A] int.
    Returns out: [T, K] in x's dtype, with
        out[t] = sum_a topk_weights[t, a] * w2[e] @ (silu(w13[e, :N] @ x[t]) * (w13[e, N:] @ x[t]))
    for e = topk_ids[t, a]; slots with e outside [0, E) contribute nothing.

    Slots are sorted by expert and each expert with slots runs one GEMM pair on its rows, so the
    cost is E small GEMMs, not T*A matrix-vector products. Arithmetic stays in x's dtype.
    Reads the per-expert counts on the host (a sync on GPU): meant for CPU.
    """
    return sum_over_choices(fused_moe_reference_into, x, w13, w2, topk_weights, topk_ids)


SlotsInto = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def sum_over_choices(into: SlotsInto, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """[T, K]: `into` (a `*_into` expert computation) writes every slot, then one sum over A.
    Each expert writes its rows into their slots (a plain copy); index_add_ into [T, K] instead
    serialises on CPU and was half of a decode step."""
    T, K, E, N, A = check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    if T * A == 0:
        return x.new_zeros(T, K)
    slot_out = x.new_zeros(T * A, K)
    into(slot_out, x, w13, w2, topk_weights, topk_ids)
    return slot_out.view(T, A, K).sum(dim=1)


def check_slot_out(slot_out: torch.Tensor, x: torch.Tensor, slots: int, K: int) -> None:
    if slot_out.shape != (slots, K) or slot_out.dtype != x.dtype:
        raise KernelInputError(f"slot_out must be [{slots}, {K}] {x.dtype}, got {list(slot_out.shape)} {slot_out.dtype}")


def sort_slots_by_expert(topk_ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (order [S]: slots grouped by expert, ascending within one, unrouted last; counts [E + 1]:
    slots per expert, the unrouted (ids outside [0, E)) in the last)."""
    flat = topk_ids.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < E), flat, E)
    return torch.argsort(key, stable=True), torch.bincount(key, minlength=E + 1)


def fused_moe_reference_into(
    slot_out: torch.Tensor,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """Write each routed slot's weighted expert output into slot_out [T*A, K] (slot s is token
    s // A, choice s % A); unrouted slots are left as they are. Calling it on disjoint sets of
    routed experts (the rest marked -1) and then summing slot_out over A gives exactly
    `fused_moe_reference`'s result: an expert's GEMMs see the same rows either way. This lets a
    caller compute the experts it has while others are still being read."""
    T, K, E, N, A = check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    check_slot_out(slot_out, x, T * A, K)
    if T * A == 0:
        return
    order, per_expert = sort_slots_by_expert(topk_ids, E)  # [S] slots grouped by expert
    counts = per_expert[:E].tolist()
    tokens = order // A  # [S] token of each sorted slot
    weights = topk_weights.reshape(-1).index_select(0, order).to(x.dtype)  # [S]

    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        tok = tokens[start:end]
        gate_up = F.linear(x.index_select(0, tok), w13[e])  # [count, 2N]
        h = F.silu(gate_up[:, :N]).mul_(gate_up[:, N:])  # [count, N]
        y = F.linear(h, w2[e]).mul_(weights[start:end, None])  # [count, K]
        slot_out.index_copy_(0, order[start:end], y)
        start = end
