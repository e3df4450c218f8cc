"""The compiled RMSNorm against its torch reference (transformers' RMSNorm): the same floats in
fp32 and bf16, at every width and row count, whatever the thread count; bad operands refused."""
from __future__ import annotations

import pytest
import torch

from batchgen_kernels.cpu_rms_norm import (
    cpu_rms_norm_available,
    rms_norm_cpu,
    rms_norm_kernel_for,
    rms_norm_reference,
)
from batchgen_kernels.errors import KernelInputError

# the kernel repeats torch 2.13's order of summing (the version the project pins); another torch
# may sum otherwise, and the model then keeps torch's path (rms_norm_kernel_for says no)
pytestmark = [pytest.mark.skipif(not cpu_rms_norm_available(), reason="no C++ compiler for the CPU kernels"),
              pytest.mark.skipif(not torch.__version__.startswith("2.13."), reason="torch 2.13's order of summing")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(1, 3), (5, 8), (2, 31), (64, 256), (9, 1000), (300, 1024), (3, 4099),
                                             (2, 16384)])
def test_same_floats_as_the_reference(dtype: torch.dtype, rows: int, width: int) -> None:
    g = torch.Generator().manual_seed(rows * 7 + width)
    x = (torch.randn(rows, width, generator=g) * torch.logspace(-2, 2, rows).unsqueeze(1)).to(dtype)
    weight = torch.randn(width, generator=g).to(dtype)
    got = rms_norm_cpu(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, rms_norm_reference(x, weight, 1e-6))
    assert rms_norm_kernel_for(dtype, width) is not None


def test_rows_of_any_stride_and_shape_and_thread_count() -> None:
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(600, 2 * 512, generator=g)
    x = wide[:, :512]  # rows 1024 floats apart
    weight = torch.randn(512, generator=g)
    want = rms_norm_reference(x, weight, 1e-5)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(rms_norm_cpu(x, weight, 1e-5), want)
    finally:
        torch.set_num_threads(before)
    heads = torch.randn(7, 4, 32, generator=g)  # per-head norms (qk-norm): [T, H, D]
    w32 = torch.randn(32, generator=g)
    assert torch.equal(rms_norm_cpu(heads, w32, 1e-6), rms_norm_reference(heads, w32, 1e-6))
    # a row's floats never depend on the rows around it
    assert torch.equal(rms_norm_cpu(x[17:18], weight, 1e-5), want[17:18])


def test_bad_operands_are_refused() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(KernelInputError, match="weight"):
        rms_norm_cpu(x, torch.randn(7), 1e-6)
    with pytest.raises(KernelInputError, match="float32 or bfloat16"):
        rms_norm_cpu(x.double(), torch.randn(8).double(), 1e-6)
    with pytest.raises(KernelInputError, match="one dtype"):
        rms_norm_cpu(x, torch.randn(8).to(torch.bfloat16), 1e-6)
    assert rms_norm_kernel_for(torch.float64, 8) is None
