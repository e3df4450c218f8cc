"""The compiled MoE router against its torch reference: the same experts and weights within fp32
rounding for softmax and sigmoid scoring, renormalized, biased and scaled; a token's routing never
depends on its batch or the thread count; bad operands refused."""
from __future__ import annotations

import pytest
import torch

from batchgen.models.moe import route as model_route
from batchgen.models.spec import RouterSpec
from batchgen_kernels.cpu_router import cpu_router_available, route, route_cpu, route_reference
from batchgen_kernels.errors import KernelInputError

pytestmark = pytest.mark.skipif(not cpu_router_available(), reason="no C++ compiler for the CPU kernels")

VARIANTS = [{}, {"normalize": True}, {"sigmoid": True},
            {"sigmoid": True, "normalize": True, "correction_bias": "bias", "scale": 2.5, "renorm_eps": 1e-20},
            {"normalize": True, "scale": 0.5}]


def separated(T: int, E: int, K: int, A: int, seed: int, sigmoid: bool = False,
              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens whose first A + 1 choice values (scores plus bias, in fp64) are at least 1e-5 apart:
    no near-ties, where another order of summing could pick or order the experts otherwise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T * 8, K, generator=g)
    w = torch.randn(E, K, generator=g) / K ** 0.5
    logits = x.double() @ w.double().T
    choice = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    if bias is not None:
        choice = choice + bias.double()
    top = choice.sort(dim=-1, descending=True).values[:, :min(A + 1, E)]
    keep = (-top.diff(dim=-1)).min(dim=-1).values > 1e-5 if top.shape[1] > 1 else torch.ones(len(x), dtype=torch.bool)
    rows = keep.nonzero().flatten()[:T]
    assert rows.numel() == T
    return x[rows].contiguous(), w


@pytest.mark.parametrize(("T", "E", "K", "A"), [(1, 8, 1024, 2), (37, 8, 1000, 2), (300, 8, 256, 2), (17, 60, 64, 4),
                                                (9, 3, 17, 3), (5, 128, 512, 8), (4, 6, 40, 6)])
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_same_experts_and_weights_as_the_reference(T: int, E: int, K: int, A: int, variant: int) -> None:
    kw = dict(VARIANTS[variant])
    if kw.get("correction_bias") == "bias":
        kw["correction_bias"] = torch.linspace(-0.01, 0.02, E)
    x, w = separated(T, E, K, A, T * 31 + E, bool(kw.get("sigmoid")), kw.get("correction_bias"))  # type: ignore[arg-type]
    weights, ids = route_cpu(x, w, A, **kw)  # type: ignore[arg-type]
    want_w, want_ids = route_reference(x, w, A, **kw)  # type: ignore[arg-type]
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (T, A)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=2e-5, atol=1e-7)


def test_a_tokens_routing_is_its_own() -> None:
    x, w = separated(400, 8, 512, 2, seed=5)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(route_cpu(x, w, 2, normalize=True))
    finally:
        torch.set_num_threads(before)
    for weights, ids in outs[1:]:
        assert torch.equal(weights, outs[0][0]) and torch.equal(ids, outs[0][1])
    alone_w, alone_ids = route_cpu(x[123:124], w, 2, normalize=True)
    assert torch.equal(alone_w, outs[0][0][123:124]) and torch.equal(alone_ids, outs[0][1][123:124])
    strided = torch.cat([x, x], dim=1)[:, :512]  # rows 1024 floats apart
    assert torch.equal(route_cpu(strided, w, 2, normalize=True)[1], outs[0][1])


def test_no_tokens_and_non_finite_rows() -> None:
    w = torch.randn(8, 16)
    weights, ids = route_cpu(torch.empty(0, 16), w, 2)
    assert weights.shape == (0, 2) and ids.shape == (0, 2)
    x = torch.randn(3, 16)
    x[1] = float("nan")
    weights, ids = route_cpu(x, w, 2)
    assert ((ids >= 0) & (ids < 8)).all() and ids[1].unique().numel() == 2  # still two distinct experts
    assert torch.equal(ids[[0, 2]], route_reference(x[[0, 2]], w, 2)[1])


@pytest.mark.parametrize("nan_expert", [0, 3, 7])
def test_a_nan_choice_ranks_first_as_in_torch(nan_expert: int) -> None:
    """torch.topk ranks NaN above every number, wherever the NaN expert sits."""
    x, w = separated(6, 8, 32, 2, seed=11, sigmoid=True)
    bias = torch.zeros(8)
    bias[nan_expert] = float("nan")
    got = route_cpu(x, w, 2, sigmoid=True, correction_bias=bias)[1]
    want = route_reference(x, w, 2, sigmoid=True, correction_bias=bias)[1]
    assert (got[:, 0] == nan_expert).all()
    assert torch.equal(got, want)


def test_the_dispatcher_and_the_models_router(monkeypatch: pytest.MonkeyPatch) -> None:
    """`route` runs the kernel here and the reference with the CPU kernels off; the model's router
    maps its spec onto it (sigmoid, renormalizing with DeepSeek-V3's 1e-20, scaling, bias)."""
    x, w = separated(50, 16, 64, 4, seed=2, sigmoid=True, bias=torch.linspace(0, 0.01, 16))
    bias = torch.linspace(0, 0.01, 16)
    spec = RouterSpec(num_experts=16, top_k=4, scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                      has_correction_bias=True)
    kernel = route(x, w, 4, True, True, bias, 2.5, 1e-20)
    assert all(torch.equal(a, b) for a, b in zip(kernel, route_cpu(x, w, 4, True, True, bias, 2.5, 1e-20)))
    assert all(torch.equal(a, b) for a, b in zip(kernel, model_route(x, w, spec, bias)))
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "0")
    reference = route_reference(x, w, 4, True, True, bias, 2.5, 1e-20)
    for got in (route(x, w, 4, True, True, bias, 2.5, 1e-20), model_route(x, w, spec, bias)):
        assert all(torch.equal(a, b) for a, b in zip(got, reference))
    assert torch.equal(kernel[1], reference[1])
    torch.testing.assert_close(kernel[0], reference[0], rtol=2e-5, atol=1e-7)


def test_bad_operands_are_refused() -> None:
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with pytest.raises(KernelInputError, match="top_k"):
        route_cpu(x, w, 9)
    with pytest.raises(KernelInputError, match="top_k"):
        route_cpu(x, w, 0)
    with pytest.raises(KernelInputError, match=r"router_w \[E, K\]"):
        route_cpu(x, torch.randn(8, 15), 2)
    with pytest.raises(KernelInputError, match="float32"):
        route_cpu(x.double(), w, 2)
    with pytest.raises(KernelInputError, match="correction_bias"):
        route_cpu(x, w, 2, correction_bias=torch.zeros(7))
