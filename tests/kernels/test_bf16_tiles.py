"""bf16 weights in paired tiles: experts (kernels/expert_tiles.py, `batchgen_moe_routed_bf16`)
against `fused_moe_reference` and dense weights (kernels/tiled_linear.py, `batchgen_linear_bf16`)
against F.linear, both in fp32 on the same bf16 values; a row's result never depends on its batch."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchgen import Engine, SamplingParams
from batchgen.models.model import Model
from batchgen_kernels import KernelInputError, cpu_small_rows, expert_tiles, fused_moe_reference
from batchgen_kernels._cpu_build import cpu_features
from batchgen_kernels.expert_tiles import (
    bf16_tiles_preferred,
    bf16_tiles_supported,
    moe_tiled_cpu,
    tile_experts,
    tiles_supported,
)
from batchgen_kernels.tiled_linear import TILE_BYTES, linear, tile_weight, weight_tiles_supported

BUILDS = cpu_small_rows.cpu_small_rows_available()
pytestmark = pytest.mark.skipif(not BUILDS, reason="the CPU small-row kernels do not build here")
RUNS = pytest.mark.skipif(not (BUILDS and bf16_tiles_supported()), reason="this CPU has no AVX512-BF16")
TILED = pytest.mark.skipif(not (BUILDS and bf16_tiles_preferred()), reason="this CPU has no AVX512-BF16, or has AMX")
# relative to the output's largest entry: the activation between the two products is rounded to
# bf16 (8 bits), and so is the result
TOL = 1.5e-2


def layer(E: int, K: int, N: int, T: int, A: int, seed: int, skew: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * N, K, generator=g) / K ** 0.5).bfloat16()
    w2 = (torch.randn(E, K, N, generator=g) / N ** 0.5).bfloat16()
    x = torch.randn(T, K, generator=g).bfloat16()
    prefs = torch.rand(E, generator=g) ** skew  # uneven experts, some with few rows or none
    ids = torch.stack([torch.multinomial(prefs, A, generator=g) for _ in range(T)])
    return x, w13, w2, torch.rand(T, A, generator=g), ids


def reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    return fused_moe_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def test_bf16_tiles_pair_k_for_sixteen_weight_rows() -> None:
    _, w13, w2, _, _ = layer(3, 32, 48, 1, 1, seed=0)
    tiles = tile_experts(w13, w2)
    assert tiles.paired and tiles.lanes == 16
    assert tiles.w13.shape == (3, 6, 16, 16, 2) and tiles.w2.shape == (3, 2, 24, 16, 2)
    assert (tiles.hidden, tiles.width, tiles.num_experts) == (32, 48, 3)
    assert tiles.w13[1, 2, 5, 7, 1] == w13[1, 2 * 16 + 7, 2 * 5 + 1]
    u13, u2 = tiles.untiled()
    assert torch.equal(u13, w13) and torch.equal(u2, w2)


def test_bf16_tiles_need_sixteen_lanes_and_dividing_sizes() -> None:
    _, w13, w2, _, _ = layer(2, 24, 32, 1, 1, seed=1)  # K = 24: not a multiple of 16
    with pytest.raises(KernelInputError, match="multiples of 16"):
        tile_experts(w13, w2)
    _, w13, w2, _, _ = layer(2, 32, 32, 1, 1, seed=1)
    with pytest.raises(KernelInputError, match="16 lanes"):
        tile_experts(w13, w2, lanes=8)
    with pytest.raises(KernelInputError, match="both bfloat16"):
        tile_experts(w13.float(), w2)


@RUNS
@pytest.mark.parametrize("E, K, N, T, A, skew", [
    (8, 64, 96, 1, 2, 1.0),       # one row: most experts idle
    (8, 256, 512, 37, 2, 3.0),     # uneven experts, remainders of eight-row passes
    (4, 128, 64, 300, 2, 1.0),     # many passes an expert, one-tile blocks (N = 64)
    (6, 96, 160, 70, 3, 0.5),      # three choices; N and K not multiples of a 48-row block
])
def test_bf16_layer_matches_the_reference(E: int, K: int, N: int, T: int, A: int, skew: float) -> None:
    x, w13, w2, weights, ids = layer(E, K, N, T, A, seed=E + K + T, skew=skew)
    out = moe_tiled_cpu(x, tile_experts(w13, w2), weights, ids)
    assert out.dtype == torch.bfloat16 and out.shape == (T, K)
    assert relative_error(out, reference(x, w13, w2, weights, ids)) < TOL


@RUNS
def test_bf16_weights_in_either_dtype_and_unrouted_choices_add_nothing() -> None:
    x, w13, w2, weights, ids = layer(8, 64, 96, 20, 2, seed=5)
    tiles = tile_experts(w13, w2)
    torch.testing.assert_close(moe_tiled_cpu(x, tiles, weights.bfloat16(), ids),
                               moe_tiled_cpu(x, tiles, weights.bfloat16().float(), ids), rtol=0, atol=0)
    ids[::2, 1] = -1
    ids[1::4, 0] = 8  # outside [0, E): unrouted too
    out = moe_tiled_cpu(x, tiles, weights, ids)
    assert relative_error(out, reference(x, w13, w2, weights, ids)) < TOL
    none = moe_tiled_cpu(x, tiles, weights, torch.full_like(ids, -1))
    assert torch.equal(none, torch.zeros_like(none))


@RUNS
def test_a_bf16_row_gives_the_same_bits_alone_in_any_batch_and_on_any_threads() -> None:
    x, w13, w2, weights, ids = layer(8, 256, 512, 90, 2, seed=7)
    tiles = tile_experts(w13, w2)
    batch = moe_tiled_cpu(x, tiles, weights, ids)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for t in (0, 41, 89):
            alone = moe_tiled_cpu(x[t:t + 1], tiles, weights[t:t + 1], ids[t:t + 1])
            assert torch.equal(alone[0], batch[t])
    finally:
        torch.set_num_threads(threads)


@RUNS
def test_bad_inputs_to_bf16_tiles_are_named() -> None:
    x, w13, w2, weights, ids = layer(4, 32, 32, 3, 2, seed=9)
    tiles = tile_experts(w13, w2)
    with pytest.raises(KernelInputError, match="x must be a contiguous CPU bfloat16"):
        moe_tiled_cpu(x.float(), tiles, weights, ids)
    with pytest.raises(KernelInputError, match="topk_ids must be a contiguous CPU int64"):
        moe_tiled_cpu(x, tiles, weights, ids.int())
    with pytest.raises(KernelInputError, match=r"x must be \[3, 32\]"):
        moe_tiled_cpu(x[:, :16].contiguous(), tiles, weights, ids)


def test_bf16_experts_are_tiled_only_where_the_cpu_runs_them(monkeypatch: pytest.MonkeyPatch) -> None:
    _, w13, w2, _, _ = layer(2, 32, 48, 1, 1, seed=2)
    assert tiles_supported(w13, w2) == bf16_tiles_preferred()
    assert not tiles_supported(w13[:, :, :24], w2[:, :24])  # K = 24
    monkeypatch.setenv("BATCHGEN_SMALL_ROWS_KERNEL", "0")
    assert not bf16_tiles_supported() and not tiles_supported(w13, w2)


@TILED
def test_a_bf16_model_on_cpu_runs_its_experts_in_tiles(checkpoint_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    path: Path = checkpoint_factory("mixtral")
    tiled = Model.load(path, dtype="bfloat16", device="cpu")
    monkeypatch.setenv("BATCHGEN_SMALL_ROWS_KERNEL", "0")
    plain = Model.load(path, dtype="bfloat16", device="cpu")
    monkeypatch.delenv("BATCHGEN_SMALL_ROWS_KERNEL")
    ffn = tiled.weights.layers[0].ffn
    assert ffn.tiles is not None and ffn.tiles.paired and ffn.w13 is None  # type: ignore[union-attr]
    assert plain.weights.layers[0].ffn.tiles is None  # type: ignore[union-attr]
    hidden = torch.randn(33, tiled.spec.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    for layer_index in range(tiled.num_layers):
        want = plain.ffn_stage(layer_index, hidden).float()
        got = tiled.ffn_stage(layer_index, hidden)
        assert got.dtype == torch.bfloat16
        assert relative_error(got, want) < TOL
    engine = Engine(path, dtype="bfloat16", device="cpu", kv_cache_bytes=1 << 20)
    assert engine.model.weights.layers[0].ffn.tiles.paired  # type: ignore[union-attr]
    outs = engine.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [(len(o.token_ids), o.finish_reason) for o in outs] == [(6, "length"), (6, "length")]


def test_cpu_features_are_the_flags_linux_names() -> None:
    features = cpu_features()
    if not Path("/proc/cpuinfo").exists():
        assert features == frozenset()
        return
    assert features and not {"flags", ":", "Features"} & features
    assert bf16_tiles_supported() <= ("avx512_bf16" in features)  # the kernel runs only where Linux lists it


@RUNS
def test_a_cpu_with_amx_keeps_bf16_weights_plain(checkpoint_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU has AMX, torch's bf16 GEMM runs on it: the tiles are not used, though they would run."""
    monkeypatch.setattr(expert_tiles, "cpu_has_amx_bf16", lambda: True)
    assert bf16_tiles_supported() and not bf16_tiles_preferred()
    _, w13, w2, _, _ = layer(2, 32, 48, 1, 1, seed=2)
    w, _, _ = dense(512, 512, 1, seed=1)
    assert not tiles_supported(w13, w2) and not weight_tiles_supported(w)
    assert weight_tiles_supported(w.float()) == cpu_small_rows.small_rows_enabled()  # fp32 tiles do not ask
    model = Model.load(checkpoint_factory("mixtral"), dtype="bfloat16", device="cpu")
    ffn = model.weights.layers[0].ffn
    assert ffn.tiles is None and ffn.w13 is not None  # type: ignore[union-attr]


def dense(n_out: int, k: int, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(n_out, k, generator=g) / k ** 0.5).bfloat16(), torch.randn(m, k, generator=g).bfloat16(),
            torch.randn(n_out, generator=g).bfloat16())


def test_bf16_dense_tiles_pair_k_for_sixteen_weight_rows() -> None:
    w, _, _ = dense(48, 32, 1, seed=0)
    t = tile_weight(w)
    assert t.paired and t.tiles.shape == (3, 16, 16, 2) and (t.out_features, t.in_features) == (48, 32)
    assert t.tiles[2, 5, 7, 1] == w[2 * 16 + 7, 2 * 5 + 1]
    assert torch.equal(t.untiled(), w)
    with pytest.raises(KernelInputError, match="multiples of 16"):
        tile_weight(w[:, :24])


def test_bf16_dense_weights_are_tiled_only_where_the_cpu_runs_them(monkeypatch: pytest.MonkeyPatch) -> None:
    w, _, _ = dense(512, 512, 1, seed=1)
    assert 4 * w.numel() >= TILE_BYTES and weight_tiles_supported(w) == bf16_tiles_preferred()
    assert not weight_tiles_supported(w[:, :504])  # K not a multiple of 16
    monkeypatch.setenv("BATCHGEN_SMALL_ROWS_KERNEL", "0")
    assert not weight_tiles_supported(w)


@RUNS
@pytest.mark.parametrize("n_out, k, m", [(48, 64, 1), (96, 256, 7), (1536, 1024, 8), (64, 512, 33), (160, 96, 300)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_matches_f_linear(n_out: int, k: int, m: int, with_bias: bool) -> None:
    w, x, bias = dense(n_out, k, m, seed=n_out + k + m)
    b = bias if with_bias else None
    got = linear(x, tile_weight(w), b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (m, n_out)
    assert relative_error(got, want) < TOL


@RUNS
def test_a_bf16_dense_row_gives_the_same_bits_alone_in_any_batch() -> None:
    w, x, bias = dense(96, 256, 40, seed=3)
    t = tile_weight(w)
    batch = linear(x, t, bias)
    for r in (0, 17, 39):
        assert torch.equal(linear(x[r:r + 1], t, bias)[0], batch[r])
    assert linear(x[:0], t, bias).shape == (0, 96)


@RUNS
def test_bad_inputs_to_bf16_dense_tiles_are_named() -> None:
    w, x, bias = dense(48, 32, 2, seed=4)
    t = tile_weight(w)
    with pytest.raises(KernelInputError, match="x must be a CPU bfloat16"):
        linear(x.float(), t)
    with pytest.raises(KernelInputError, match=r"bias must be \[48\]"):
        linear(x, t, bias[:16])
