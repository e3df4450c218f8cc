"""The expert kernels' silu (csrc/small_rows_cpu/silu.h: eight exponentials at once, by a
polynomial) against float64, and the same floats for an element wherever it sits."""
from __future__ import annotations

import pytest
import torch

from batchgen_kernels import cpu_small_rows

pytestmark = pytest.mark.skipif(not cpu_small_rows.cpu_small_rows_available(),
                                reason="the CPU small-row kernels do not build here")


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(gate)
    cpu_small_rows.small_rows_library().batchgen_silu_times(gate.numel(), gate.data_ptr(), up.data_ptr(),
                                                            out.data_ptr())
    return out


def test_silu_within_two_ulp_of_float64() -> None:
    """(torch's own silu is 1.3 ulp off here; below -88.4 silu is under 4e-37 and taken as zero)"""
    g = torch.cat([torch.linspace(-120, 120, 200_001), torch.randn(100_000) * 4,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.3, -87.4, 88.4, -88.4, 1e4, -1e4, 1e30, -1e30])])
    up = torch.rand(g.numel()) + 0.5
    got = silu_times(g, up).double()
    exact = torch.nn.functional.silu(g.double()) * up.double()
    ulp = torch.finfo(torch.float32).eps * exact.abs()
    assert ((got - exact).abs() <= 2 * ulp + 1e-36).all(), (got - exact).abs().div(ulp + 1e-36).max()


def test_an_element_gets_the_same_floats_wherever_it_sits() -> None:
    """Eight at a time, the last few padded: position 3 of a 13-long call, or alone."""
    g, up = torch.randn(13) * 6, torch.rand(13)
    whole = silu_times(g, up)
    for j in range(13):
        assert torch.equal(silu_times(g[j:j + 1].clone(), up[j:j + 1].clone()), whole[j:j + 1])
