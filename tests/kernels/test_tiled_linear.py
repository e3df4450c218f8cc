"""Dense weights in tiles (kernels/tiled_linear.py, `batchgen_linear_tiled` in
csrc/small_rows_cpu.cpp) against F.linear; a row's result never depends on its batch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen_kernels import KernelInputError, cpu_small_rows, expert_tiles, tiled_linear
from batchgen_kernels.tiled_linear import (
    TiledWeight,
    linear,
    linear_tiled_cpu,
    tile_weight,
    weight_rows_from,
    weight_tiles_supported,
)

pytestmark = pytest.mark.skipif(not cpu_small_rows.cpu_small_rows_available(),
                                reason="the CPU small-row kernels do not build here")
TOL = 1e-5  # relative to the output's largest entry: fp32 sums in another order
LANES = [8, pytest.param(16, marks=pytest.mark.skipif(
    cpu_small_rows.cpu_small_rows_available() and expert_tiles.widest_lanes() < 16,
    reason="the kernel built on this CPU has no sixteen-lane tiles (no AVX-512)"))]


def weight(n_out: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_out, k, generator=g) / k ** 0.5, torch.randn(n_out, generator=g)


def test_tiles_interleave_lanes_along_k_and_untile() -> None:
    w, _ = weight(48, 32, seed=0)
    t = tile_weight(w, lanes=8)
    assert t.tiles.shape == (6, 32, 8) and (t.out_features, t.in_features, t.lanes) == (48, 32, 8)
    assert torch.equal(t.tiles[2, 5], w[16:24, 5]) and torch.equal(t.untiled(), w)
    assert tile_weight(w).lanes == expert_tiles.widest_lanes()  # 48 and 32: multiples of 16
    assert tile_weight(weight(40, 32, seed=0)[0]).lanes == 8


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize(("n_out", "k", "m"), [
    (8, 16, 1), (48, 64, 3), (96, 48, 17), (144, 32, 300), (56, 24, 9), (64, 128, 0)])
def test_tiled_linear_matches_f_linear(lanes: int, n_out: int, k: int, m: int) -> None:
    if n_out % lanes or k % lanes:
        pytest.skip("shape not a multiple of the lanes")
    w, b = weight(n_out, k, seed=n_out + k + m)
    x = torch.randn(m, k)
    for bias in (None, b):
        got = linear_tiled_cpu(x, tile_weight(w, lanes), bias)
        want = F.linear(x, w, bias)
        assert got.shape == want.shape
        if m:
            assert (got - want).abs().max() <= TOL * want.abs().max()


@pytest.mark.parametrize("lanes", LANES)
def test_a_weights_last_output_rows_give_the_same_floats_as_the_whole(lanes: int) -> None:
    """weight_rows_from cuts tiles where their lanes allow (the attention's keys and values
    without its queries) and gives those columns' floats; elsewhere, and for a plain weight, None."""
    w, b = weight(96, 64, seed=5)
    t = tile_weight(w, lanes)
    x = torch.randn(37, 64)
    whole = linear(x, t, b)
    for start in range(lanes, 96, lanes):
        cut = weight_rows_from(t, start)
        assert isinstance(cut, TiledWeight) and cut.out_features == 96 - start
        assert torch.equal(linear(x, cut, b[start:]), whole[:, start:])
    assert weight_rows_from(t, lanes // 2) is None
    assert weight_rows_from(w, 48) is None  # plain weights are not cut
    if expert_tiles.bf16_tiles_preferred():
        paired = tile_weight(w.bfloat16())
        xb = x.bfloat16()
        assert torch.equal(linear(xb, weight_rows_from(paired, 32)), linear(xb, paired)[:, 32:])
        assert weight_rows_from(paired, 8) is None


@pytest.mark.parametrize("lanes", LANES)
def test_a_row_gives_the_same_floats_alone_in_any_batch_and_on_any_threads(lanes: int) -> None:
    w, b = weight(96, 64, seed=3)
    t = tile_weight(w, lanes)
    x = torch.randn(300, 64)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            outs.append(linear_tiled_cpu(x, t, b))
        for rows in (slice(0, 1), slice(40, 49), slice(100, 117)):
            assert torch.equal(linear_tiled_cpu(x[rows].contiguous(), t, b), outs[0][rows])
    finally:
        torch.set_num_threads(before)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    if lanes == 16:
        assert torch.equal(linear_tiled_cpu(x, tile_weight(w, 8), b), outs[0])


def test_strided_rows_and_columns_are_taken() -> None:
    w, b = weight(32, 64, seed=4)
    big = torch.randn(10, 80)
    x = big[:, 8:72]  # row stride 80
    t = tile_weight(w, 8)
    assert torch.equal(linear_tiled_cpu(x, t, b), linear_tiled_cpu(x.contiguous(), t, b))
    xt = torch.randn(64, 10).t()  # unit stride along rows, not columns
    assert torch.equal(linear_tiled_cpu(xt, t), linear_tiled_cpu(xt.contiguous(), t))
    assert (linear_tiled_cpu(x, t, b) - F.linear(x, w, b)).abs().max() <= TOL * F.linear(x, w, b).abs().max()


def test_linear_takes_either_weight_and_names_bad_operands() -> None:
    w, b = weight(32, 64, seed=5)
    x = torch.randn(4, 64)
    t = tile_weight(w, 8)
    assert torch.equal(linear(x, t, b), linear_tiled_cpu(x, t, b))
    assert torch.equal(linear(x, w, b), cpu_small_rows.linear_rows(x, w, b))
    with pytest.raises(KernelInputError, match=r"bias must be a contiguous CPU float32"):
        linear(x, t, torch.randn(64)[::2])
    with pytest.raises(KernelInputError, match=r"x must be a CPU float32 \[M, 64\]"):
        linear(x.double(), t)
    with pytest.raises(KernelInputError, match=r"must be a contiguous CPU float32"):
        linear(x, TiledWeight(t.tiles.transpose(0, 1).contiguous().transpose(0, 1)))


def test_bad_inputs_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    w, b = weight(32, 16, seed=6)
    with pytest.raises(KernelInputError, match="Nout = 12 and K = 16 multiples of 8"):
        tile_weight(w[:12], lanes=8)
    with pytest.raises(KernelInputError, match="8 or 16 lanes, not 4"):
        tile_weight(w, lanes=4)
    with pytest.raises(KernelInputError, match="2-D float32"):
        tile_weight(w.double())
    t = tile_weight(w, lanes=8)
    with pytest.raises(KernelInputError, match=r"x must be a CPU float32 \[M, 16\]"):
        linear_tiled_cpu(torch.zeros(3, 15), t)
    with pytest.raises(KernelInputError, match=r"x must be a CPU float32 \[M, 16\]"):
        linear_tiled_cpu(torch.zeros(3, 16, dtype=torch.float64), t)
    with pytest.raises(KernelInputError, match=r"bias must be \[32\]"):
        linear_tiled_cpu(torch.zeros(3, 16), t, b[:31])
    monkeypatch.setattr(tiled_linear, "widest_lanes", lambda: 8)
    with pytest.raises(KernelInputError, match=r"with L 8 on this CPU, got \(2, 16, 16\)"):
        linear_tiled_cpu(torch.zeros(3, 16), TiledWeight(tile_weight(w, 8).tiles.reshape(2, 16, 16)))


def test_only_weights_of_tile_bytes_are_tiled(monkeypatch: pytest.MonkeyPatch) -> None:
    assert weight_tiles_supported(torch.zeros(tiled_linear.TILE_BYTES // 4 // 64, 64))
    assert not weight_tiles_supported(torch.zeros(tiled_linear.TILE_BYTES // 4 // 64 - 8, 64))
    w, _ = weight(32, 16, seed=7)
    assert not weight_tiles_supported(w)
    monkeypatch.setattr(tiled_linear, "TILE_BYTES", 0)
    assert weight_tiles_supported(w)
    assert not weight_tiles_supported(w.double()) and not weight_tiles_supported(w[:12])
    assert not weight_tiles_supported(w[:, :12].contiguous())
    monkeypatch.setenv("BATCHGEN_SMALL_ROWS_KERNEL", "0")
    assert not weight_tiles_supported(w)


def test_a_cpu_model_keeps_its_dense_weights_in_tiles(monkeypatch: pytest.MonkeyPatch, checkpoint_factory) -> None:
    """Past TILE_BYTES (forced here) GQA projections, MLPs and an untied lm_head are tiles; a tied
    lm_head is the embedding table and stays plain."""
    from batchgen.models.model import Model

    monkeypatch.setattr(tiled_linear, "TILE_BYTES", 0)
    m = Model.load(checkpoint_factory("llama"), "float32", "cpu")
    a = m.weights.layers[0].attention
    assert isinstance(a.qkv, TiledWeight) and isinstance(a.o, TiledWeight)
    assert isinstance(m.weights.layers[0].ffn.gate_up, TiledWeight) and isinstance(m.weights.lm_head, TiledWeight)
    tied = Model.load(checkpoint_factory("llama_tied"), "float32", "cpu")
    assert tied.weights.lm_head is tied.weights.embed
