"""Experts in tiles (kernels/expert_tiles.py, the tiled path of csrc/small_rows_cpu.cpp) against
`fused_moe_reference` on the plain weights; a row's result never depends on its batch."""
from __future__ import annotations

import pytest
import torch

from batchgen_kernels import KernelInputError, cpu_small_rows, expert_tiles, fused_moe_reference
from batchgen_kernels.expert_tiles import ExpertTiles, moe_tiled_cpu, tile_experts, tiles_supported, widest_lanes

pytestmark = pytest.mark.skipif(not cpu_small_rows.cpu_small_rows_available(),
                                reason="the CPU small-row kernels do not build here")
TOL = 1e-5  # relative to the output's largest entry: fp32 sums in another order
SIXTEEN = pytest.mark.skipif(cpu_small_rows.cpu_small_rows_available() and widest_lanes() < 16,
                             reason="the kernel built on this CPU has no sixteen-lane tiles (no AVX-512)")


def layer(E: int, K: int, N: int, T: int, A: int, seed: int, skew: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * N, K, generator=g) / K ** 0.5, torch.randn(E, K, N, generator=g) / N ** 0.5
    x = torch.randn(T, K, generator=g)
    prefs = torch.rand(E, generator=g) ** skew  # uneven experts, some with few rows or none
    ids = torch.stack([torch.multinomial(prefs, A, generator=g) for _ in range(T)])
    return x, w13, w2, torch.rand(T, A, generator=g), ids


def test_tiles_interleave_eight_weight_rows_along_k() -> None:
    _, w13, w2, _, _ = layer(3, 16, 24, 1, 1, seed=0)
    tiles = tile_experts(w13, w2)
    assert tiles.w13.shape == (3, 6, 16, 8) and tiles.w2.shape == (3, 2, 24, 8)
    assert torch.equal(tiles.w13[2, 1, 5], w13[2, 8:16, 5]) and torch.equal(tiles.w2[1, 1, 7], w2[1, 8:16, 7])
    back13, back2 = tiles.untiled()
    assert torch.equal(back13, w13) and torch.equal(back2, w2)


def test_tiles_take_the_widest_lanes_that_divide_the_experts() -> None:
    _, w13, w2, _, _ = layer(2, 32, 48, 1, 1, seed=1)
    tiles = tile_experts(w13, w2)
    assert tiles.lanes == widest_lanes() and tiles.w13.shape == (2, 96 // tiles.lanes, 32, tiles.lanes)
    assert torch.equal(tiles.w2[1, 1, 7], w2[1, tiles.lanes:2 * tiles.lanes, 7])
    assert all(torch.equal(a, b) for a, b in zip(tiles.untiled(), (w13, w2)))
    assert tile_experts(*layer(2, 24, 48, 1, 1, seed=1)[1:3]).lanes == 8  # hidden 24: not a multiple of 16


@SIXTEEN
@pytest.mark.parametrize(("E", "K", "N", "T", "A", "skew"), [
    (8, 64, 32, 1, 2, 1.0), (4, 48, 48, 37, 2, 3.0), (6, 128, 80, 301, 3, 1.0), (5, 32, 16, 20, 1, 8.0)])
def test_sixteen_lane_tiles_give_the_eight_lane_floats(E: int, K: int, N: int, T: int, A: int, skew: float) -> None:
    """Either width sums every output in one chain over k: the same floats, bit for bit (widths
    of one to three sixteen-lane tiles and a last block of one or two; 1-300 rows an expert)."""
    x, w13, w2, tw, ids = layer(E, K, N, T, A, seed=K + N + T, skew=skew)
    wide = moe_tiled_cpu(x, tile_experts(w13, w2, lanes=16), tw, ids)
    assert torch.equal(wide, moe_tiled_cpu(x, tile_experts(w13, w2, lanes=8), tw, ids))
    want = fused_moe_reference(x, w13, w2, tw, ids)
    assert (wide - want).abs().max() <= TOL * want.abs().max()


def test_tiles_wider_than_the_kernel_built_here_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w13, w2, tw, ids = layer(2, 32, 16, 3, 1, seed=2)
    tiles = tile_experts(w13, w2, lanes=16)
    monkeypatch.setattr(expert_tiles, "widest_lanes", lambda: 8)
    with pytest.raises(KernelInputError, match="tiles of 16 lanes: the kernel built on this CPU takes 8 "):
        moe_tiled_cpu(x, tiles, tw, ids)
    assert tile_experts(w13, w2).lanes == 8


@pytest.mark.parametrize(("E", "K", "N", "T", "A", "skew"), [
    (8, 64, 32, 1, 2, 1.0),       # one token
    (4, 40, 24, 37, 2, 3.0),      # hidden 40 (five vectors), width 24 (three tiles), skewed
    (6, 128, 96, 77, 3, 1.0),     # three choices
    (8, 256, 16, 600, 2, 0.5),    # hundreds of rows an expert, width of two tiles
    (5, 72, 8, 9, 1, 8.0),        # one tile of width; nearly every row on one expert
])
def test_tiled_layer_matches_the_reference(E: int, K: int, N: int, T: int, A: int, skew: float) -> None:
    x, w13, w2, tw, ids = layer(E, K, N, T, A, seed=K + N + T, skew=skew)
    got = moe_tiled_cpu(x, tile_experts(w13, w2), tw, ids)
    want = fused_moe_reference(x, w13, w2, tw, ids)
    assert (got - want).abs().max() <= TOL * want.abs().max()


def test_unrouted_choices_add_nothing() -> None:
    x, w13, w2, tw, ids = layer(4, 32, 16, 6, 2, seed=3)
    ids[1, 0], ids[4, 1], ids[5] = -1, 4, -1  # below 0 or past the last expert: unrouted
    got = moe_tiled_cpu(x, tile_experts(w13, w2), tw, ids)
    keep = (ids >= 0) & (ids < 4)
    want = fused_moe_reference(x, w13, w2, tw * keep, ids.clamp(0, 3))
    assert (got - want).abs().max() <= TOL * want.abs().max()
    assert torch.equal(got[5], torch.zeros(32))


def test_a_row_gives_the_same_floats_alone_in_any_batch_and_on_any_threads() -> None:
    """The tile sums every output in one order whatever surrounds it: 1, 9, 17 or 300 rows of
    an expert, 1-5 threads."""
    x, w13, w2, tw, ids = layer(8, 64, 48, 300, 2, seed=4, skew=2.0)
    tiles = tile_experts(w13, w2)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            outs.append(moe_tiled_cpu(x, tiles, tw, ids))
        for rows in (slice(0, 1), slice(40, 49), slice(100, 117)):
            alone = moe_tiled_cpu(x[rows].contiguous(), tiles, tw[rows].contiguous(), ids[rows].contiguous())
            assert torch.equal(alone, outs[0][rows])
    finally:
        torch.set_num_threads(before)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_scratch_kept_between_calls_of_any_size() -> None:
    """The kernel keeps its scratch between calls (up to 64 MiB a buffer; a larger call gets its
    own): calls that grow it, fit in it and pass that limit each give the reference's result."""
    E, K, N = 4, 2048, 8
    _, w13, w2, _, _ = layer(E, K, N, 1, 2, seed=9)
    tiles = tile_experts(w13, w2)
    for T in (5, 600, 7, 4100, 9):  # 4100 tokens x 2 choices x 2048 floats: past the kept size
        x, _, _, tw, ids = layer(E, K, N, T, 2, seed=T)
        got = moe_tiled_cpu(x, tiles, tw, ids)
        want = fused_moe_reference(x, w13, w2, tw, ids)
        assert (got - want).abs().max() <= TOL * want.abs().max(), T


def test_bad_shapes_and_dtypes_are_named() -> None:
    _, w13, w2, _, _ = layer(2, 16, 12, 1, 1, seed=5)
    with pytest.raises(KernelInputError, match="multiples of 8"):
        tile_experts(w13, w2)  # width 12
    _, w13, w2, tw, ids = layer(2, 16, 8, 3, 1, seed=6)
    with pytest.raises(KernelInputError, match="float32"):
        tile_experts(w13.double(), w2)
    with pytest.raises(KernelInputError, match="tiles of 16 lanes need N = 8 and K = 16 multiples of 16"):
        tile_experts(w13, w2, lanes=16)
    with pytest.raises(KernelInputError, match="8 or 16 lanes, not 4"):
        tile_experts(w13, w2, lanes=4)
    tiles = tile_experts(w13, w2)
    with pytest.raises(KernelInputError, match=r"x must be \[3, 16\]"):
        moe_tiled_cpu(torch.zeros(3, 15), tiles, tw, ids)
    with pytest.raises(KernelInputError, match="topk_ids"):
        moe_tiled_cpu(torch.zeros(3, 16), tiles, tw, ids.int())
    with pytest.raises(KernelInputError, match="tiles.w2 must be a contiguous CPU float32"):
        moe_tiled_cpu(torch.zeros(3, 16), ExpertTiles(tiles.w13, tiles.w2.transpose(2, 3).contiguous().transpose(2, 3)),
                      tw, ids)
    with pytest.raises(KernelInputError, match="tiles must be"):
        moe_tiled_cpu(torch.zeros(3, 16), ExpertTiles(tiles.w13, tiles.w2[:1]), tw, ids)


def test_only_experts_past_the_cache_are_tiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """In cache sgemm wins at every row count (cpu_small_rows.IN_CACHE_BYTES); widths that are
    not multiples of eight, other dtypes, and the kernel turned off keep the plain layout."""
    _, w13, w2, _, _ = layer(2, 16, 8, 1, 1, seed=7)
    assert not tiles_supported(w13, w2)
    monkeypatch.setattr(cpu_small_rows, "IN_CACHE_BYTES", 0)
    assert tiles_supported(w13, w2)
    assert not tiles_supported(w13.double(), w2.double())
    assert not tiles_supported(*layer(2, 16, 12, 1, 1, seed=8)[1:3])
    monkeypatch.setenv("BATCHGEN_SMALL_ROWS_KERNEL", "0")
    assert not tiles_supported(w13, w2)
