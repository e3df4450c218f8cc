"""Fused MoE as two grouped GEMMs over expert-sorted tokens: batchgen's CPU path.

Same semantics and routing convention as `reference.fused_moe_reference` (the oracle): slots
are sorted by expert once, every routed token row is gathered once, and each of the two expert
GEMMs is one `torch._grouped_mm` call over all experts' row groups (offsets = cumulative
counts), so a layer costs ~10 tensor ops instead of ~7 per active expert from Python. Each
expert's group sees exactly the rows the reference's per-expert GEMM sees, so results match it
(bit for bit on CPU, where the grouped GEMM runs one GEMM per group).

In fp32, an expert with few rows (the decode tail; `small_rows_limit`) goes through a compiled kernel
instead (cpu_small_rows.py), which reads the weights at the memory's rate where sgemm does not;
it agrees with the reference within fp32 rounding, not bit for bit.

Where `torch._grouped_mm` is missing or refuses the operands (dtype, or a row stride that is not
a multiple of 16 bytes), the per-expert loop of the reference runs instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import check_moe_inputs
from .cpu_small_rows import expert_rows_limit, moe_routed_small_rows_cpu, moe_small_rows_cpu, small_rows_enabled
from .reference import check_slot_out, fused_moe_reference_into, sort_slots_by_expert, sum_over_choices

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these operands (x: [T, K], w13: [E, 2N, K], w2: [E, K, N])."""
    if not hasattr(torch, "_grouped_mm") or x.device.type != "cpu" or x.dtype not in _GROUPED_DTYPES:
        return False
    item = x.element_size()
    K, N = x.shape[1], w2.shape[2]
    # operand strides must be multiples of 16 bytes; the weights are read transposed in place
    return (K * item) % 16 == 0 and (N * item) % 16 == 0 and w13.is_contiguous() and w2.is_contiguous()


def fused_moe_grouped(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x: [T, K]; w13: [E, 2N, K]; w2: [E, K, N]; topk_weights: [T, A]; topk_ids: [T, A] -> [T, K].

    `fused_moe_reference`'s result, computed with two grouped GEMMs. When every expert with rows
    takes the small-row kernel (the decode tail), the whole layer is one kernel call instead:
    the same floats, without the ~25 operators around the kernel."""
    limit = _routed_kernel_limit(x, w13, w2, topk_weights, topk_ids)
    # more slots than experts x limit: some expert is over the limit for sure (a prompt's chunk)
    if limit > 0 and x.shape[0] * topk_ids.shape[1] <= w13.shape[0] * limit:
        out = moe_routed_small_rows_cpu(x, w13, w2, topk_weights.contiguous(), topk_ids.contiguous(), limit)
        if out is not None:
            return out
    return sum_over_choices(fused_moe_grouped_into, x, w13, w2, topk_weights, topk_ids)


def _routed_kernel_limit(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor) -> int:
    """Rows per expert up to which the one-call kernel takes these operands (fp32 on CPU, where
    the grouped path would send such experts to the kernel too); 0 where it takes none. Checked
    on attributes only, no tensor operator."""
    f32 = torch.float32
    if not (x.dtype is f32 and w13.dtype is f32 and w2.dtype is f32 and topk_weights.dtype is f32
            and topk_ids.dtype is torch.int64 and x.device.type == "cpu" and x.dim() == 2 and topk_ids.dim() == 2
            and x.is_contiguous() and grouped_mm_supported(x, w13, w2) and small_rows_enabled()):
        return 0
    return expert_rows_limit(w13, w2)


def fused_moe_grouped_into(
    slot_out: torch.Tensor,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """`fused_moe_reference_into` with grouped GEMMs: writes each routed slot's weighted expert
    output into slot_out [T*A, K]; unrouted slots (ids outside [0, E)) are left as they are."""
    if not grouped_mm_supported(x, w13, w2):
        fused_moe_reference_into(slot_out, x, w13, w2, topk_weights, topk_ids)
        return
    T, K, E, N, A = check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    check_slot_out(slot_out, x, T * A, K)
    if T * A == 0:
        return
    # S = T*A slots, R routed slots
    order, counts = sort_slots_by_expert(topk_ids, E)  # [S] grouped by expert, unrouted last; [E + 1]
    routed = int(order.numel() - counts[E])
    if routed == 0:
        return
    order = order[:routed]  # [R]
    rows = x.index_select(0, order // A)  # [R, K]
    y = _experts_small_and_large(rows, w13, w2, counts[:E], N)
    y.mul_(topk_weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(1))
    slot_out.index_copy_(0, order, y)


def _grouped_gemms(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
                   N: int) -> torch.Tensor:
    """rows [R, K] grouped by expert (counts [E]) -> [R, K]: two torch._grouped_mm calls."""
    offs = counts.cumsum(0).to(torch.int32)  # [E] end row of each expert's group
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)  # [R, 2N]
    h = F.silu(gate_up[:, :N]).mul_(gate_up[:, N:])  # [R, N]
    return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)  # [R, K]


def _experts_small_and_large(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
                             N: int) -> torch.Tensor:
    """The experts with few rows (small_rows_limit) through the streaming kernel (fp32, where it
    builds), the others through grouped GEMMs. The choice is per expert, by its own row count,
    so computing experts in parts (fused_moe_grouped_into) gives the one-call result."""
    if rows.dtype != torch.float32 or not small_rows_enabled():
        return _grouped_gemms(rows, w13, w2, counts, N)
    used = counts > 0
    small = used & (counts <= expert_rows_limit(w13, w2))
    if not bool(small.any()):
        return _grouped_gemms(rows, w13, w2, counts, N)
    y = torch.empty_like(rows)
    moe_small_rows_cpu(rows, w13, w2, counts, small, y)
    # experts with no rows are neither: a grouped GEMM over zero rows would still run a
    # (per-expert, on CPU) product for every expert, each step of the decode tail
    if bool((used & ~small).any()):
        large = (~small).repeat_interleave(counts)  # [R] rows of the large experts
        y[large] = _grouped_gemms(rows[large], w13, w2, counts.masked_fill(small, 0), N)
    return y
