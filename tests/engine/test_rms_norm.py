"""rms_norm against transformers' own RMSNorm module (the oracle): bit for bit in fp32, at decode
and prompt-sized batches and on per-head 3-D inputs (qk-norm)."""
from __future__ import annotations

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm

from batchgen.models.layers import rms_norm


@pytest.mark.parametrize(("shape", "eps"), [((1, 256), 1e-5), ((300, 1024), 1e-6), ((2048, 64), 1e-5), ((7, 4, 32), 1e-6)])
def test_rms_norm_is_transformers_bit_for_bit_in_fp32(shape: tuple[int, ...], eps: float) -> None:
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[0])
    x = torch.randn(*shape, generator=g) * 3
    before = x.clone()
    oracle = MixtralRMSNorm(shape[-1], eps=eps)
    with torch.no_grad():
        oracle.weight.copy_(torch.randn(shape[-1], generator=g))
        want = oracle(x)
    got = rms_norm(x, oracle.weight.detach(), eps)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got, want)
    assert torch.equal(x, before)  # the weight is applied to a new tensor, never to the input


def test_a_lone_row_wider_than_torchs_grain_is_still_transformers_bit_for_bit() -> None:
    """From 32,768 values torch splits a lone row's sum over its threads, an order the compiled
    kernel does not repeat: such rows keep torch's path."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(7)
        oracle = MixtralRMSNorm(65536, eps=1e-6)
        with torch.no_grad():
            oracle.weight.copy_(torch.randn(65536, generator=g))
            for _ in range(20):
                x = torch.randn(1, 65536, generator=g) * 3
                assert torch.equal(rms_norm(x, oracle.weight.detach(), 1e-6), oracle(x))
    finally:
        torch.set_num_threads(before)
