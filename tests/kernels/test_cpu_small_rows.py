"""The compiled small-row kernels (csrc/small_rows_cpu.cpp) against their torch references (the
per-expert GEMMs, F.linear), the grouped path that sends the experts with few rows to one, and
`linear_rows`, which sends dense products with few rows to the other."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_kernels import make_inputs

from batchgen_kernels import KernelInputError, fused_moe_grouped, fused_moe_grouped_into, fused_moe_reference
from batchgen_kernels.cpu_small_rows import (
    PANEL_ROWS,
    cpu_small_rows_available,
    expert_rows_limit,
    linear_rows,
    linear_small_rows_cpu,
    moe_routed_small_rows_cpu,
    moe_small_rows_cpu,
    small_rows_enabled,
    small_rows_limit,
)
from batchgen_kernels.reference import sum_over_choices

pytestmark = pytest.mark.skipif(not cpu_small_rows_available(), reason="the CPU small-row kernels do not build here")
TOL = 1e-5  # relative to the output's largest entry: fp32 sums in another order


def expert_layer(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The reference: one expert at a time, as fused_moe_reference computes it."""
    out, start, N = [], 0, w2.shape[2]
    for e, m in enumerate(counts):
        gate_up = rows[start:start + m] @ w13[e].T
        out.append((F.silu(gate_up[:, :N]) * gate_up[:, N:]) @ w2[e].T)
        start += m
    return torch.cat(out)


def weights(E: int, K: int, N: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * N, K, generator=g) / K ** 0.5, torch.randn(E, K, N, generator=g) / N ** 0.5


@pytest.mark.parametrize(("K", "N", "counts"), [
    (64, 32, [1, 0, 3, 16]),       # widths the vector loop covers exactly; an expert with no rows
    (37, 21, [5, 2, 7]),           # tails past the last 8 lanes, an odd number of output columns
    (128, 96, [128, 4, 9, 1, 13]),  # the most rows the kernel takes
    (520, 531, [3, 9, 0, 6]),  # rows longer than 512: prefetched one group of rows ahead
    (37, 50, [17, 40, 24, 9, 16]),  # panels: 3 (the 4 x 3 tile), 5 (6 x 2 and 4 x 3), 2, 2 and 2
    (48, 40, [5, 6, 7, 8, 4]),  # rows in one pass over the weights (5-7), and in two (8, 4)
])
def test_kernel_matches_the_per_expert_reference(K: int, N: int, counts: list[int]) -> None:
    w13, w2 = weights(len(counts), K, N, seed=K)
    rows = torch.randn(sum(counts), K, generator=torch.Generator().manual_seed(N))
    out = torch.full_like(rows, float("nan"))
    moe_small_rows_cpu(rows, w13, w2, torch.tensor(counts), torch.ones(len(counts), dtype=torch.bool), out)
    want = expert_layer(rows, w13, w2, counts)
    assert (out - want).abs().max() <= TOL * want.abs().max()


def test_uneven_experts_split_over_threads_by_cost_give_the_same_floats() -> None:
    """The threads take ranges of (expert, block) items of about equal cost, cut inside an expert
    where the costs fall so; how they are cut never changes a sum."""
    counts = [40, 1, 0, 17, 6, 9, 64, 3, 5, 7]
    w13, w2 = weights(len(counts), 64, 72, seed=5)
    rows = torch.randn(sum(counts), 64, generator=torch.Generator().manual_seed(6))
    want = expert_layer(rows, w13, w2, counts)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            out = torch.full_like(rows, float("nan"))
            moe_small_rows_cpu(rows, w13, w2, torch.tensor(counts), torch.ones(len(counts), dtype=torch.bool), out)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert (outs[0] - want).abs().max() <= TOL * want.abs().max()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_a_row_gets_the_same_result_whatever_it_is_batched_with() -> None:
    """... among the rows its expert gets, as long as their number stays on one side of PANEL_ROWS
    (the two tiles sum in different orders)."""
    w13, w2 = weights(3, 96, 64, seed=1)
    rows = torch.randn(11, 96, generator=torch.Generator().manual_seed(2))
    counts = torch.tensor([4, 6, 1])
    assert int(counts.max()) <= PANEL_ROWS
    together = torch.empty_like(rows)
    moe_small_rows_cpu(rows, w13, w2, counts, torch.ones(3, dtype=torch.bool), together)
    alone = torch.empty(1, 96)
    for e, row in ((0, 2), (1, 7), (2, 10)):  # one row of each expert, alone
        moe_small_rows_cpu(rows[row:row + 1].contiguous(), w13, w2, torch.eye(3, dtype=torch.int64)[e],
                           torch.ones(3, dtype=torch.bool), alone)
        assert torch.equal(alone[0], together[row])
    many = torch.randn(60, 96, generator=torch.Generator().manual_seed(3))
    among_many = torch.empty_like(many)
    moe_small_rows_cpu(many, w13, w2, torch.tensor([30, 17, 13]), torch.ones(3, dtype=torch.bool), among_many)
    for e, row in ((0, 29), (1, 31), (2, 59)):  # the same rows, among PANEL_ROWS + 1 rows of others
        others = torch.randn(PANEL_ROWS, 96, generator=torch.Generator().manual_seed(row))
        fewer = torch.cat([others[:5], many[row:row + 1], others[5:]])
        out = torch.empty_like(fewer)
        moe_small_rows_cpu(fewer, w13, w2, torch.eye(3, dtype=torch.int64)[e] * (PANEL_ROWS + 1),
                           torch.ones(3, dtype=torch.bool), out)
        assert torch.equal(out[5], among_many[row])


def test_experts_not_taken_are_left_as_they_are() -> None:
    w13, w2 = weights(2, 32, 16, seed=3)
    rows = torch.randn(5, 32)
    out = torch.full_like(rows, 7.0)
    moe_small_rows_cpu(rows, w13, w2, torch.tensor([2, 3]), torch.tensor([False, True]), out)
    assert torch.equal(out[:2], torch.full((2, 32), 7.0))
    assert (out[2:] - expert_layer(rows[2:], w13[1:], w2[1:], [3])).abs().max() <= TOL * out[2:].abs().max()


def test_bad_inputs_are_refused_with_the_argument_named() -> None:
    w13, w2 = weights(2, 32, 16, seed=4)
    take = torch.ones(2, dtype=torch.bool)
    with pytest.raises(KernelInputError, match="rows must be a contiguous CPU float32"):
        moe_small_rows_cpu(torch.randn(3, 32).double(), w13, w2, torch.tensor([1, 2]), take, torch.empty(3, 32))
    with pytest.raises(KernelInputError, match="counts must sum to 3"):
        moe_small_rows_cpu(torch.randn(3, 32), w13, w2, torch.tensor([1, 1]), take, torch.empty(3, 32))


@pytest.mark.parametrize(("T", "E", "A"), [(1, 8, 1), (1, 8, 2), (17, 8, 2), (24, 6, 3), (40, 16, 8)])
def test_one_call_layer_gives_the_grouped_paths_floats(monkeypatch: pytest.MonkeyPatch, T: int, E: int, A: int) -> None:
    """Every expert with few rows: fused_moe_grouped is one kernel call (gather, experts, weights,
    sum over the choices), bit for bit the grouped path's operators around the same kernel, with
    unrouted slots (ids -1 and past E) contributing nothing."""
    from batchgen_kernels import grouped_moe

    x, w13, w2, tw, ids = make_inputs(T, E, A, K=256, N=512, seed=T + A)  # 1.5 MiB an expert: read from memory
    if T > 2:
        ids[0, 0], ids[2, A - 1] = -1, E + 3
    routed = ids[(ids >= 0) & (ids < E)]
    assert int(torch.bincount(routed, minlength=E).max()) <= expert_rows_limit(w13, w2)  # on any thread count
    ran: list[int] = []
    real = grouped_moe.moe_routed_small_rows_cpu
    monkeypatch.setattr(grouped_moe, "moe_routed_small_rows_cpu", lambda *a: ran.append(1) or real(*a))
    got = fused_moe_grouped(x, w13, w2, tw, ids)
    assert ran == [1]
    assert torch.equal(got, sum_over_choices(fused_moe_grouped_into, x, w13, w2, tw, ids))
    want = fused_moe_reference(x, w13, w2, tw, ids)
    assert (got - want).abs().max() <= TOL * want.abs().max()


def test_one_call_layer_declines_an_expert_over_the_limit() -> None:
    x, w13, w2, tw, _ = make_inputs(6, 4, 1, K=256, N=512, seed=12)
    ids = torch.tensor([[1], [1], [1], [1], [2], [3]])
    assert moe_routed_small_rows_cpu(x, w13, w2, tw, ids, max_rows=3) is None  # expert 1 has 4 rows
    got = moe_routed_small_rows_cpu(x, w13, w2, tw, ids, max_rows=4)
    assert got is not None and torch.equal(got, sum_over_choices(fused_moe_grouped_into, x, w13, w2, tw, ids))
    with pytest.raises(KernelInputError, match="topk_ids must be a contiguous CPU int64"):
        moe_routed_small_rows_cpu(x, w13, w2, tw, ids.int(), max_rows=4)
    with pytest.raises(KernelInputError, match="topk_weights must be a contiguous CPU float32"):
        moe_routed_small_rows_cpu(x, w13, w2, tw.double(), ids, max_rows=4)


@pytest.mark.parametrize(("T", "E", "A"), [(1, 8, 2), (20, 8, 2), (700, 5, 2), (0, 2, 1)])
def test_grouped_path_with_small_and_large_experts_matches_the_reference(T: int, E: int, A: int) -> None:
    """T=1: every expert small; T=20: mostly small; T=700: the kernel's panels with two or more
    threads; T=0 here: every expert past the kernel's limit, through sgemm, bit for bit."""
    K, N = 256, 512  # 1.5 MiB an expert: read from memory
    if T == 0:
        T = E * (expert_rows_limit(*weights(E, K, N, seed=0)) + 40)
    inputs = make_inputs(T, E, A, K=K, N=N, seed=T)
    assert small_rows_enabled()
    got, want = fused_moe_grouped(*inputs), fused_moe_reference(*inputs)
    assert (got - want).abs().max() <= TOL * want.abs().max()
    counts = torch.bincount(inputs[4].reshape(-1), minlength=E)
    if bool((counts > expert_rows_limit(inputs[1], inputs[2])).all()):
        assert torch.equal(got, want)


def test_turned_off_the_grouped_path_is_the_reference_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = make_inputs(3, 8, 2, K=256, N=512, seed=9)
    assert not torch.equal(fused_moe_grouped(*inputs), fused_moe_reference(*inputs))  # the kernel ran
    monkeypatch.setenv("BATCHGEN_SMALL_ROWS_KERNEL", "0")
    assert not small_rows_enabled()
    assert torch.equal(fused_moe_grouped(*inputs), fused_moe_reference(*inputs))


@pytest.mark.parametrize(("M", "K", "N", "bias"), [(1, 64, 48, False), (3, 37, 21, True), (64, 128, 97, True),
                                                (13, 200, 30, False)])
def test_linear_kernel_matches_f_linear(M: int, K: int, N: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(M + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g) if bias else None
    got, want = linear_small_rows_cpu(x, w, b), F.linear(x, w, b)
    assert (got - want).abs().max() <= TOL * want.abs().max()
    # the same row batched with no other, or (past PANEL_ROWS) with as few as the panels take
    fewest = 1 if M <= PANEL_ROWS else PANEL_ROWS + 1
    alone = linear_small_rows_cpu(x[-fewest:], w, b)
    assert torch.equal(alone[-1], got[-1])


def test_linear_kernel_reads_rows_with_a_stride() -> None:
    x = torch.randn(4, 80)[:, 8:72]  # rows 80 floats apart
    w = torch.randn(10, 64)
    assert (linear_small_rows_cpu(x, w) - F.linear(x, w)).abs().max() <= TOL * F.linear(x, w).abs().max()


def test_linear_rows_takes_the_kernel_only_where_it_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(1024, 256, generator=torch.Generator().manual_seed(0))  # 1 MiB: read from memory
    few, many = torch.randn(2, 256), torch.randn(small_rows_limit(torch.get_num_threads(), 4 * w.numel()) + 1, 256)
    assert not torch.equal(linear_small_rows_cpu(few, w), F.linear(few, w))  # the two paths tell apart
    assert torch.equal(linear_rows(few, w), linear_small_rows_cpu(few, w))
    assert torch.equal(linear_rows(many, w), F.linear(many, w))
    assert torch.equal(linear_rows(few.double(), w.double()), F.linear(few.double(), w.double()))
    assert linear_rows(torch.empty(0, 256), w).shape == (0, 1024)
    small_w = w[:24].contiguous()  # 24 KiB, in cache: sgemm, bit for bit F.linear
    assert torch.equal(linear_rows(few, small_w), F.linear(few, small_w))
    monkeypatch.setenv("BATCHGEN_SMALL_ROWS_KERNEL", "0")
    assert torch.equal(linear_rows(few, w), F.linear(few, w))


def test_linear_kernel_refuses_bad_inputs() -> None:
    with pytest.raises(KernelInputError, match="x has no rows"):
        linear_small_rows_cpu(torch.randn(0, 8), torch.randn(4, 8))
    with pytest.raises(KernelInputError, match=r"w must be \[Nout, 8\]"):
        linear_small_rows_cpu(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(KernelInputError, match="x must be a CPU float32"):
        linear_small_rows_cpu(torch.randn(2, 8).double(), torch.randn(4, 8))


def test_one_call_mixes_the_paths_by_each_experts_rows() -> None:
    """Expert 0 gets more rows than the kernel takes (sgemm: bit for bit the reference), the
    others a few each (the kernel); computed in parts, the one-call result exactly."""
    K, N = 256, 512
    over = expert_rows_limit(*weights(4, K, N, seed=0)) + 1
    x, w13, w2, tw, _ = make_inputs(over + 20, 4, 1, K=K, N=N, seed=11)
    ids = torch.tensor([0] * over + [1, 2, 3] * 6 + [1, 2]).unsqueeze(1)
    assert over > expert_rows_limit(w13, w2) >= 7
    got, want = fused_moe_grouped(x, w13, w2, tw, ids), fused_moe_reference(x, w13, w2, tw, ids)
    assert torch.equal(got[:over], want[:over])
    assert (got - want).abs().max() <= TOL * want.abs().max()
    parts = torch.zeros(over + 20, x.shape[1])
    for part in ({0}, {1, 3}, {2}):
        mask = torch.isin(ids, torch.tensor(sorted(part)))
        parts += fused_moe_grouped(x, w13, w2, tw, torch.where(mask, ids, -1))
    assert torch.equal(parts, got)


def test_experts_without_rows_start_no_grouped_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode tail: a few rows on a few experts, the other experts empty. Every expert with
    rows takes the kernel, so no grouped GEMM runs (one over zero rows would still run a product
    per expert); with one expert over the limit, the grouped GEMM gets exactly its rows."""
    from batchgen_kernels import grouped_moe

    calls: list[list[int]] = []
    real = grouped_moe._grouped_gemms

    def counted(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor, N: int) -> torch.Tensor:
        calls.append(counts.tolist())
        return real(rows, w13, w2, counts, N)

    monkeypatch.setattr(grouped_moe, "_grouped_gemms", counted)
    x, w13, w2, tw, _ = make_inputs(3, 8, 1, K=256, N=512, seed=5)
    ids = torch.tensor([[2], [5], [2]])  # experts 2 and 5 have rows, six have none
    got, want = fused_moe_grouped(x, w13, w2, tw, ids), fused_moe_reference(x, w13, w2, tw, ids)
    assert calls == []
    assert (got - want).abs().max() <= TOL * want.abs().max()
    limit = expert_rows_limit(w13, w2)
    x, w13, w2, tw, _ = make_inputs(limit + 2, 8, 1, K=256, N=512, seed=6)
    ids = torch.tensor([0] * (limit + 1) + [3]).unsqueeze(1)
    got, want = fused_moe_grouped(x, w13, w2, tw, ids), fused_moe_reference(x, w13, w2, tw, ids)
    assert calls == [[limit + 1] + [0] * 7]
    assert torch.equal(got[:limit + 1], want[:limit + 1])


def test_experts_whose_weights_fit_in_cache_keep_sgemm() -> None:
    """72 x 40 experts (35 KiB): sgemm wins there at every row count, so the result is the
    reference's bit for bit."""
    inputs = make_inputs(3, 8, 2, seed=9)
    assert expert_rows_limit(inputs[1], inputs[2]) == 0
    assert torch.equal(fused_moe_grouped(*inputs), fused_moe_reference(*inputs))


@pytest.mark.parametrize(("family", "tiles"), [
    *((f, tiles) for f in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3")
      for tiles in (True, False)),
    ("llama", True), ("llama", False), ("llama_tied", True),
])
def test_engine_with_the_kernel_on_every_product_keeps_transformers_tokens(
        monkeypatch: pytest.MonkeyPatch, checkpoint_factory, prompt_ids, family: str, tiles: bool) -> None:
    """The tiny test checkpoints fit in cache, where the kernels stay off: force them on for
    every fp32 product with few rows, and greedy tokens still equal transformers'. With tiles
    (what a CPU model does with weights past the cache) every expert layer is one call of the
    tiled kernel and every dense projection one of the tiled linear kernel; without, the plain
    layout's one-call kernel (every expert here has few rows) and the small-row linear kernel."""
    import tiny_models

    import batchgen.models.model as model_module
    import batchgen.models.moe as moe_stage
    from batchgen import Engine, SamplingParams
    from batchgen_kernels import cpu_small_rows, tiled_linear

    monkeypatch.setattr(cpu_small_rows, "IN_CACHE_BYTES", 0)
    monkeypatch.setattr(tiled_linear, "TILE_BYTES", 0)
    if not tiles:
        monkeypatch.setattr(model_module, "tiles_supported", lambda w13, w2: False)
        monkeypatch.setattr(model_module, "weight_tiles_supported", lambda w: False)
    calls: list[str] = []
    for module, name in ((cpu_small_rows, "linear_small_rows_unchecked"), (cpu_small_rows, "moe_small_rows_cpu"),
                         (cpu_small_rows, "moe_routed_small_rows_cpu"), (tiled_linear, "linear_tiled_unchecked")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    tiled = moe_stage.moe_tiled_cpu
    monkeypatch.setattr(moe_stage, "moe_tiled_cpu", lambda *a: calls.append("moe_tiled_cpu") or tiled(*a))
    import batchgen_kernels.grouped_moe as grouped_moe

    monkeypatch.setattr(grouped_moe, "moe_small_rows_cpu", cpu_small_rows.moe_small_rows_cpu)
    monkeypatch.setattr(grouped_moe, "moe_routed_small_rows_cpu", cpu_small_rows.moe_routed_small_rows_cpu)
    model_dir = checkpoint_factory(family)
    prompts = prompt_ids[:4]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = Engine(model_dir, dtype="float32", device="cpu").generate(prompts, params)
    dense = {"linear_tiled_unchecked" if tiles else "linear_small_rows_unchecked"}
    if family == "llama_tied":  # its lm_head is the embedding table: kept plain
        dense.add("linear_small_rows_unchecked")
    experts = set() if family.startswith("llama") else {"moe_tiled_cpu" if tiles else "moe_routed_small_rows_cpu"}
    assert set(calls) == dense | experts
    assert [o.token_ids for o in outs] == [tiny_models.reference_generate(model_dir, p, 8, ignore_eos=True)
                                           for p in prompts]
