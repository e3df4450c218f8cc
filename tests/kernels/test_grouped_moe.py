"""The grouped-GEMM CPU MoE path against the torch reference (its oracle), at awkward sizes.

The bit-for-bit tests turn the small-row expert kernel off (it agrees within rounding, and runs
only for experts whose weights come from memory: test_cpu_small_rows.py)."""
from __future__ import annotations

import pytest
import torch
from test_kernels import make_inputs, with_unrouted

from batchgen_kernels import (
    fused_moe_grouped,
    fused_moe_grouped_into,
    fused_moe_reference,
    grouped_mm_supported,
)


@pytest.fixture
def grouped_gemms_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHGEN_SMALL_ROWS_KERNEL", "0")


@pytest.mark.usefixtures("grouped_gemms_only")
@pytest.mark.parametrize(("T", "E", "A"), [(1, 3, 1), (3, 5, 2), (257, 5, 2), (257, 8, 2), (64, 7, 3)])
def test_grouped_matches_the_reference_bit_for_bit(T: int, E: int, A: int) -> None:
    inputs = make_inputs(T, E, A, seed=T + E + A)
    assert grouped_mm_supported(*inputs[:3])
    assert torch.equal(fused_moe_grouped(*inputs), fused_moe_reference(*inputs))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])  # the kernel is fp32 only
def test_grouped_low_precision(dtype: torch.dtype) -> None:
    inputs = make_inputs(257, 5, 2, dtype=dtype, seed=7)
    assert torch.equal(fused_moe_grouped(*inputs), fused_moe_reference(*inputs))


@pytest.mark.usefixtures("grouped_gemms_only")
def test_grouped_unrouted_slots_and_experts_with_no_tokens() -> None:
    x, w13, w2, tw, ti = make_inputs(257, 5, 2, seed=3, ids_dtype=torch.int32)
    ti = with_unrouted(ti, 5)
    ti[ti == 2] = 4  # expert 2 gets no rows: an empty group in the middle
    assert torch.equal(fused_moe_grouped(x, w13, w2, tw, ti), fused_moe_reference(x, w13, w2, tw, ti))
    assert torch.equal(fused_moe_grouped(x, w13, w2, tw, torch.full_like(ti, -1)), torch.zeros_like(x))
    assert fused_moe_grouped(*make_inputs(0, 3, 2)).shape == (0, x.shape[1])


def test_strides_the_grouped_gemm_refuses_fall_back_to_the_loop() -> None:
    inputs = make_inputs(33, 4, 2, K=6, N=5, seed=1)  # rows of 24 / 20 bytes
    assert not grouped_mm_supported(*inputs[:3])
    assert torch.equal(fused_moe_grouped(*inputs), fused_moe_reference(*inputs))
    assert not grouped_mm_supported(*make_inputs(3, 4, 2, dtype=torch.float64)[:3])


def test_grouped_parts_sum_to_the_one_call_result() -> None:
    x, w13, w2, tw, ti = make_inputs(37, 6, 3, seed=5)
    whole = fused_moe_grouped(x, w13, w2, tw, ti)
    slot_out = x.new_zeros(37 * 3, x.shape[1])
    for part in ({0, 3}, {1}, {2, 4, 5}):
        mask = torch.isin(ti, torch.tensor(sorted(part)))
        fused_moe_grouped_into(slot_out, x, w13, w2, tw, torch.where(mask, ti, -1))
    assert torch.equal(slot_out.view(37, 3, -1).sum(dim=1), whole)
