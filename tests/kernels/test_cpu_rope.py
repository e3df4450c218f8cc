"""The compiled rope + KV-write kernel (batchgen_kernels.cpu_rope) is bit-identical to its torch
reference and to batchgen's own RotaryEmbedding path (half-split, interleaved, partial rotary,
bfloat16), writes exactly the slots it is given, and names a bad slot."""
from __future__ import annotations

import pytest
import torch

import batchgen_kernels as K
from batchgen.models.rope import RotaryEmbedding
from batchgen.models.spec import RopeSpec

pytestmark = pytest.mark.skipif(not K.cpu_rope_kv_available(), reason="CPU rope kernel unavailable")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,hq,hk,d,rope_dim,interleaved", [
    (1, 1, 1, 2, 2, False), (3, 4, 2, 32, 32, False), (257, 8, 2, 64, 64, True), (5, 6, 3, 24, 8, False),
    (17, 12, 1, 16, 16, True),
])
def test_matches_reference_and_rotary_bit_for_bit(dtype: torch.dtype, T: int, hq: int, hk: int, d: int,
                                                  rope_dim: int, interleaved: bool) -> None:
    g = torch.Generator().manual_seed(T + d)
    rope = RopeSpec(dim=rope_dim, theta=10000.0, interleaved=interleaved)
    rotary = RotaryEmbedding(rope, 4096, torch.device("cpu"))
    positions = torch.randint(0, 4096, (T,), generator=g)
    cos, sin = rotary.tables(positions)
    qkv = (torch.randn(T, (hq + 2 * hk) * d, generator=g) * 4).to(dtype)
    slots = torch.randperm(2 * T + 3, generator=g)[:T]
    caches = [torch.zeros(2 * T + 3, 2 * hk * d, dtype=dtype) for _ in range(2)]
    q, kv = K.rope_kv_write_cpu(qkv, cos.squeeze(1), sin.squeeze(1), slots, caches[0], hq, hk, d, interleaved)
    q_ref, kv_ref = K.rope_kv_write_reference(qkv, cos.squeeze(1), sin.squeeze(1), slots, caches[1], hq, hk, d,
                                              interleaved)
    assert torch.equal(q, q_ref) and torch.equal(kv, kv_ref) and torch.equal(caches[0], caches[1])
    untouched = torch.ones(caches[0].shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not caches[0][untouched].any()
    rotated = rotary.apply(qkv[:, :(hq + hk) * d].view(T, hq + hk, d), positions, (cos, sin))
    assert torch.equal(q, rotated[:, :hq]) and torch.equal(kv[:, :hk * d], rotated[:, hq:].reshape(T, -1))
    assert torch.equal(kv[:, hk * d:], qkv[:, (hq + hk) * d:])


def test_bad_slot_and_shapes_are_named() -> None:
    qkv, cache = torch.randn(3, 4 * 8), torch.zeros(5, 2 * 8)
    cos = sin = torch.ones(3, 4)
    with pytest.raises(K.KernelInputError, match="token 2: slot 5"):
        K.rope_kv_write_cpu(qkv, cos, sin, torch.tensor([0, 1, 5]), cache, 2, 1, 8)
    assert not cache.any()  # nothing written
    with pytest.raises(K.KernelInputError, match="qkv must be"):
        K.rope_kv_write_cpu(qkv[:, :24], cos, sin, torch.tensor([0, 1, 2]), cache, 2, 1, 8)
    with pytest.raises(K.KernelInputError, match="one dtype"):
        K.rope_kv_write_cpu(qkv, cos, sin, torch.tensor([0, 1, 2]), cache.double(), 2, 1, 8)
