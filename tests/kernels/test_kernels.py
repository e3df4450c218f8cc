"""batchgen_kernels: the torch reference against a naive loop (always), the Triton kernels against
the reference (Triton's CPU interpreter without a GPU; compiled on CUDA)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must precede the first import of triton (and of the kernels, which picks interpreter or
    # compiler when it is imported). Only ever set on machines with no GPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from batchgen_kernels import (  # noqa: E402
    KernelInputError,
    TritonUnavailableError,
    fused_moe,
    fused_moe_reference,
    get_config,
    moe_align,
    moe_align_sizes,
    moe_align_triton,
    triton_available,
)
from batchgen_kernels.config import (  # noqa: E402
    CONFIG_DIR,
    config_file_name,
    default_config,
    validate_config,
)

# Awkward on purpose: K, N are not multiples of any tile size.
K_HIDDEN, N_INTER = 72, 40
TOKENS = (1, 3, 257)
EXPERTS = (3, 5, 8)
ACTIVE = (1, 2)
# Tolerances of a result against the fp32 reference computed from the same (rounded) inputs;
# inputs are scaled so that outputs are O(1).
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 4e-2, "rtol": 4e-2},
}
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def make_inputs(
    T: int, E: int, A: int, *, K: int = K_HIDDEN, N: int = N_INTER, dtype: torch.dtype = torch.float32,
    device: str = "cpu", seed: int = 0, ids_dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [T, K], w13: [E, 2N, K], w2: [E, K, N], topk_weights: [T, A], topk_ids: [T, A]
    (A distinct experts per token, as a top-k router gives)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g)
    w13 = torch.randn(E, 2 * N, K, generator=g) / K**0.5
    w2 = torch.randn(E, K, N, generator=g) / N**0.5
    topk_ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :A].to(ids_dtype)
    topk_weights = torch.rand(T, A, generator=g) + 0.1
    cast = (lambda t: t.to(device=device, dtype=dtype))
    return cast(x), cast(w13), cast(w2), topk_weights.to(device), topk_ids.to(device)


def naive_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The definition, one token slot at a time."""
    T, A = topk_ids.shape
    N = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(T):
        for a in range(A):
            e = int(topk_ids[t, a])
            if not 0 <= e < w13.shape[0]:
                continue
            h = F.silu(w13[e, :N] @ x[t]) * (w13[e, N:] @ x[t])
            out[t] += topk_weights[t, a] * (w2[e] @ h)
    return out


def naive_moe_align(
    topk_ids: torch.Tensor, E: int, B: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = topk_ids.flatten().tolist()
    S = len(flat)
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    for e in range(E):
        group = [s for s, i in enumerate(flat) if i == e]
        if group:
            group += [S] * (-len(group) % B)
            sorted_ids += group
            expert_ids += [e] * (len(group) // B)
    num_post = len(sorted_ids)
    max_padded, max_blocks = moe_align_sizes(S, E, B)
    assert num_post <= max_padded and max_padded % B == 0
    sorted_ids += [S] * (max_padded - num_post)
    expert_ids += [-1] * (max_blocks - len(expert_ids))
    as_i32 = (lambda v: torch.tensor(v, dtype=torch.int32))
    return as_i32(sorted_ids), as_i32(expert_ids), as_i32([num_post])


def assert_align_equal(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for name, g, w in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), got, want):
        assert g.dtype == torch.int32, name
        assert torch.equal(g.cpu(), w.cpu()), f"{name}: got {g.tolist()}, want {w.tolist()}"


def with_unrouted(topk_ids: torch.Tensor, E: int) -> torch.Tensor:
    """Mark some slots unrouted: -1 (vLLM's "other rank") and E (out of range)."""
    ids = topk_ids.clone()
    ids.view(-1)[::3] = -1
    ids.view(-1)[1::5] = E
    return ids


# --- reference (no triton) ---------------------------------------------------------------------

@pytest.mark.parametrize("A", ACTIVE)
@pytest.mark.parametrize("E", EXPERTS)
@pytest.mark.parametrize("T", TOKENS)
def test_reference_matches_naive_loop(T: int, E: int, A: int) -> None:
    inputs = make_inputs(T, E, A, seed=T * 100 + E * 10 + A)
    torch.testing.assert_close(fused_moe_reference(*inputs), naive_moe(*inputs), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_low_precision(dtype: torch.dtype) -> None:
    x, w13, w2, tw, ti = make_inputs(257, 5, 2, dtype=dtype, seed=7)
    out = fused_moe_reference(x, w13, w2, tw, ti)
    assert out.dtype == dtype
    want = fused_moe_reference(x.float(), w13.float(), w2.float(), tw, ti)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


def test_reference_int32_ids_and_unrouted_slots() -> None:
    x, w13, w2, tw, ti = make_inputs(257, 5, 2, seed=3, ids_dtype=torch.int32)
    ti = with_unrouted(ti, 5)
    want = naive_moe(x, w13, w2, tw, ti)
    torch.testing.assert_close(fused_moe_reference(x, w13, w2, tw, ti), want, **TOL[torch.float32])
    all_unrouted = torch.full_like(ti, -1)
    assert torch.equal(fused_moe_reference(x, w13, w2, tw, all_unrouted), torch.zeros_like(x))


def test_reference_no_tokens() -> None:
    x, w13, w2, tw, ti = make_inputs(0, 3, 2)
    assert fused_moe_reference(x, w13, w2, tw, ti).shape == (0, K_HIDDEN)


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
@pytest.mark.parametrize(("T", "E", "A"), [(1, 3, 1), (1, 8, 2), (3, 5, 2), (257, 3, 1), (257, 8, 2)])
def test_moe_align_matches_naive(T: int, E: int, A: int, block_size: int) -> None:
    ti = make_inputs(T, E, A, seed=T + E + A)[4]
    assert_align_equal(moe_align(ti, E, block_size), naive_moe_align(ti, E, block_size))
    ti = with_unrouted(ti, E)
    assert_align_equal(moe_align(ti, E, block_size), naive_moe_align(ti, E, block_size))


def test_moe_align_no_tokens() -> None:
    got = moe_align(torch.zeros(0, 2, dtype=torch.int64), 5, 16)
    assert [t.tolist() for t in got] == [[], [], [0]]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda x, w13, w2, tw, ti: (x[0], w13, w2, tw, ti), r"x must be \[T, K\]"),
        (lambda x, w13, w2, tw, ti: (x, w13[:, :-1], w2, tw, ti), r"w13 must be \[E, 2N, K\]"),
        (lambda x, w13, w2, tw, ti: (x, w13, w2[:, :-1], tw, ti), r"w2 must be \[E, K, N\]"),
        (lambda x, w13, w2, tw, ti: (x, w13, w2, tw, ti.float()), "topk_ids must be int32 or int64"),
        (lambda x, w13, w2, tw, ti: (x, w13, w2, tw[:, :1], ti), r"topk_weights must be \[T, A\]"),
        (lambda x, w13, w2, tw, ti: (x, w13.double(), w2, tw, ti), "w13 must have x's dtype"),
        (lambda x, w13, w2, tw, ti: (x, w13, w2, tw, ti[:2]), "topk_ids must be .* T=3"),
    ],
)
def test_reference_rejects_bad_inputs(make: Callable, match: str) -> None:
    with pytest.raises(KernelInputError, match=match):
        fused_moe_reference(*make(*make_inputs(3, 5, 2)))


# --- launch configs ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("E", "N", "K", "T"), [(8, 40, 72, 1), (8, 14336, 4096, 4096), (3, 8, 8, 257)])
def test_default_config_is_valid(E: int, N: int, K: int, T: int, dtype: torch.dtype) -> None:
    config = get_config(E, N, K, T, dtype, device_name="no such device")
    assert config == validate_config(config) == default_config(E, N, K, T, dtype)


H100 = "NVIDIA H100 80GB HBM3"
TILES = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}


def test_tuned_config_file_nearest_token_count(tmp_path: Path) -> None:
    large = {**TILES, "BLOCK_SIZE_M": 128, "GROUP_SIZE_M": 16, "num_warps": 8}
    name = config_file_name(8, 512, torch.bfloat16, H100)
    assert name == "E=8,N=512,device_name=NVIDIA_H100_80GB_HBM3,dtype=bf16.json"
    (tmp_path / name).write_text(json.dumps({"1": TILES, "1024": large}))

    def get(T: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
        return get_config(8, 512, 256, T, dtype, device_name=H100, config_dir=tmp_path)

    assert get(3) == {**TILES, "num_warps": 4, "num_stages": 3}
    assert get(900) == {**large, "num_stages": 3}
    # No file for this dtype: the heuristic.
    assert get(3, torch.float16) == default_config(8, 512, 256, 3, torch.float16)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({k: v for k, v in TILES.items() if k != "GROUP_SIZE_M"}, "missing GROUP_SIZE_M"),
        ({**TILES, "BLOCK_SIZE_M": 24}, "BLOCK_SIZE_M.*24"),
        ({**TILES, "BLOCK_SIZE_N": 8}, "BLOCK_SIZE_N.*8"),
        ({**TILES, "GROUP_SIZE_M": 0}, "GROUP_SIZE_M.*0"),
        ({**TILES, "num_warps": 4.0}, "num_warps.*4.0"),
        ({**TILES, "warps": 4}, "warps"),
    ],
)
def test_bad_config_rejected(config: dict[str, int], match: str) -> None:
    with pytest.raises(KernelInputError, match=match):
        validate_config(config)


def test_shipped_config_files_are_valid() -> None:
    pattern = re.compile(r"E=\d+,N=\d+,device_name=[^,/ ]+,dtype=(fp16|bf16|fp32)\.json")
    for path in CONFIG_DIR.glob("*.json"):
        assert pattern.fullmatch(path.name), path.name
        for T, config in json.loads(path.read_text()).items():
            assert int(T) >= 1
            validate_config(config, f"{path.name}[{T}]")


# --- triton availability -----------------------------------------------------------------------

def test_package_import_does_not_import_triton() -> None:
    code = "import sys, batchgen_kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_triton_raises_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    monkeypatch.delitem(sys.modules, "batchgen_kernels._triton_moe", raising=False)
    assert not triton_available()
    with pytest.raises(TritonUnavailableError, match="fused_moe_reference") as info:
        fused_moe(*make_inputs(3, 5, 2))
    assert isinstance(info.value, ImportError)


# --- Triton kernels: interpreter on CPU, compiled on CUDA --------------------------------------

DEVICE = "cuda" if HAS_CUDA else "cpu"
# The interpreter has no bf16 tl.dot (triton-lang/triton#11584); bf16 runs in the CUDA test.
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


@needs_triton
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(("T", "E", "A"), [(1, 3, 1), (1, 8, 2), (3, 5, 2), (257, 3, 1), (257, 8, 2)])
def test_moe_align_triton_exact(T: int, E: int, A: int, block_size: int) -> None:
    ti = make_inputs(T, E, A, seed=T + E + A, device=DEVICE, ids_dtype=torch.int32)[4]
    assert_align_equal(moe_align_triton(ti, E, block_size), moe_align(ti, E, block_size))
    ti = with_unrouted(ti.long(), E)
    assert_align_equal(moe_align_triton(ti, E, block_size), moe_align(ti, E, block_size))


@needs_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("A", ACTIVE)
@pytest.mark.parametrize("E", EXPERTS)
@pytest.mark.parametrize("T", TOKENS)
def test_fused_moe_matches_reference(T: int, E: int, A: int, dtype: torch.dtype) -> None:
    x, w13, w2, tw, ti = make_inputs(T, E, A, dtype=dtype, device=DEVICE, seed=T * 100 + E * 10 + A)
    out = fused_moe(x, w13, w2, tw, ti)
    assert out.shape == x.shape and out.dtype == dtype
    want = fused_moe_reference(x.float(), w13.float(), w2.float(), tw, ti)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


@needs_triton
@pytest.mark.parametrize(
    "config",
    [
        {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 1},
        {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 4},
        {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 8},
    ],
)
def test_fused_moe_launch_configs(config: dict[str, int]) -> None:
    x, w13, w2, tw, ti = make_inputs(257, 5, 2, device=DEVICE, seed=11)
    want = fused_moe_reference(x, w13, w2, tw, ti)
    torch.testing.assert_close(fused_moe(x, w13, w2, tw, ti, config=config), want, **TOL[torch.float32])


@needs_triton
def test_fused_moe_unrouted_slots_and_no_tokens() -> None:
    x, w13, w2, tw, ti = make_inputs(257, 5, 2, device=DEVICE, seed=5)
    ti = with_unrouted(ti, 5)
    torch.testing.assert_close(fused_moe(x, w13, w2, tw, ti), fused_moe_reference(x, w13, w2, tw, ti),
                               **TOL[torch.float32])
    x, w13, w2, tw, ti = make_inputs(0, 5, 2, device=DEVICE)
    assert fused_moe(x, w13, w2, tw, ti).shape == (0, K_HIDDEN)


@needs_triton
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda x, w13, w2, tw, ti: (x.t().contiguous().t(), w13, w2, tw, ti), "x must be contiguous"),
        (lambda x, w13, w2, tw, ti: (x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, tw, ti),
         "w13 must have unit stride"),
        (lambda x, w13, w2, tw, ti: (x.double(), w13.double(), w2.double(), tw, ti),
         "float16, bfloat16 or float32"),
        (lambda x, w13, w2, tw, ti: (x, w13[:, :-1], w2, tw, ti), r"w13 must be \[E, 2N, K\]"),
    ],
)
def test_fused_moe_rejects_bad_inputs(make: Callable, match: str) -> None:
    # Shapes with T, K > 1 so that a transposed copy really is non-contiguous.
    with pytest.raises(KernelInputError, match=match):
        fused_moe(*make(*make_inputs(3, 5, 2, device=DEVICE)))


@needs_triton
@pytest.mark.skipif(HAS_CUDA, reason="checks the interpreter's refusal of bf16")
def test_fused_moe_interpreter_refuses_bf16() -> None:
    with pytest.raises(KernelInputError, match="bfloat16"):
        fused_moe(*make_inputs(3, 5, 2, dtype=torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", TOKENS + (4096,))
def test_fused_moe_compiled_cuda(T: int, dtype: torch.dtype) -> None:
    # Model-like sizes (still awkward: N is not a multiple of 64) through the compiled kernels.
    x, w13, w2, tw, ti = make_inputs(T, 8, 2, K=512, N=352, dtype=dtype, device="cuda", seed=T)
    out = fused_moe(x, w13, w2, tw, ti)
    torch.cuda.synchronize()
    want = fused_moe_reference(x.float(), w13.float(), w2.float(), tw, ti)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    assert_align_equal(moe_align_triton(ti, 8, 64), moe_align(ti, 8, 64))
