"""Products with few rows on CPU (csrc/small_rows_cpu.cpp): the decode tail's expert layers
and dense projections.

# R routed rows sorted by expert, E experts, K hidden, N expert width; M rows, Nout outputs
With 1-32 rows a GEMM is bound by reading its weights once, and sgemm reads them well below the
memory's rate (on 2 AVX2 cores: 3-10 GB/s on one thread, nothing more from the second, against
13.5 / 26.7 GB/s of plain reads). The kernels give every thread its own weight rows and read
each once. Their references are `reference.fused_moe_reference`'s per-expert GEMMs and
`F.linear`; they agree within fp32 rounding (the sums run in another order), and a row's
result does not depend on the rows batched with it while their number stays on one side of
PANEL_ROWS (fewer: dot products along the weight rows; more: x packed into panels of eight rows
and each weight broadcast against them, which needs half the cache traffic a multiply-add).
`moe_routed_small_rows_cpu` runs a whole routed layer (sort by expert, gather, experts,
weighted sum over the choices) in one call, the floats of the grouped path's operators around
`moe_small_rows_cpu`.

These take experts in the plain layout (the offload store's, and any passed in). A CPU model's
own resident fp32 experts are kept in tiles instead and run through expert_tiles.py.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from ._cpu_build import cpu_kernels, cpu_kernels_error
from .errors import CpuKernelUnavailableError, KernelInputError

# Rows (per expert, or of a dense product) up to which the kernels beat sgemm (torch._grouped_mm,
# F.linear). They win twice: by reading weights at the memory's rate (few rows), and by a tile
# that feeds the multiply-adds with less cache traffic than sgemm's on these shapes (more rows).
# Weights that fit in cache keep sgemm. Measured on 2 AVX2 cores (bench_small_experts.py, and
# each median of three ~0.4 s runs alternated against sgemm):
# - experts, 8 of 1024 x 1024 (12 MiB each) and of 256 x 512 (1.5 MiB): two threads 1.3-4.4x at
#   16-64 rows, 1.0-1.9x at 128-256 (median 1.4x), 0.88-1.32x at 512 (median 1.26x), and 0.89-1.22x
#   at 1024-2048, where the machine's drift hid any difference; one thread 1.2-2.4x at 16-64 rows,
#   1.04-1.14x at 128, level at 512 (0.96-1.03x);
# - dense 1024 x 1024, 1536 x 1024 and 1024 x 256: two threads 1.4-2x at 32-64 rows, 1.2-1.5x at
#   128, 1.1-1.35x at 256, 1.04-1.09x at 384; one thread 1.1-1.5x at 16-64, level from 128;
# - 512 x 256 (512 KiB, in cache): 0.85-0.94x from 256 rows; at 128 x 128 (192 KiB) one thread
#   was 0.6-0.7x at 16-32 rows.
EXPERT_ROWS_ONE_THREAD = 128
EXPERT_ROWS_THREADS = 512
DENSE_ROWS_ONE_THREAD = 128
DENSE_ROWS_THREADS = 256
IN_CACHE_BYTES = 1 << 20  # weights of one product below this are taken as read from cache
# the kernel's kPanelRows: products with more rows than this run as panels (x packed, each weight
# broadcast against eight rows), which sum in another order than the tile for fewer rows
PANEL_ROWS = 8


def small_rows_limit(threads: int, weight_bytes: int, experts: bool = False) -> int:
    """Most rows (per expert when `experts`) the kernels should take with this many threads, for
    a product whose weights (one expert's, or the dense matrix) take weight_bytes."""
    if weight_bytes < IN_CACHE_BYTES:
        return 0
    if experts:
        return EXPERT_ROWS_ONE_THREAD if threads <= 1 else EXPERT_ROWS_THREADS
    return DENSE_ROWS_ONE_THREAD if threads <= 1 else DENSE_ROWS_THREADS


def expert_rows_limit(w13: torch.Tensor, w2: torch.Tensor) -> int:
    """small_rows_limit for one expert of stacked fp32 weights w13 [E, 2N, K] and w2 [E, K, N]."""
    # (from the shapes: indexing an expert would make two tensor views on every layer's call)
    return small_rows_limit(torch.get_num_threads(), 4 * (w13.numel() + w2.numel()) // max(w13.shape[0], 1),
                            experts=True)


def cpu_small_rows_available() -> bool:
    """Whether the compiled small-row kernels are usable here (built on first call)."""
    return cpu_kernels("small_rows_cpu") is not None


def small_rows_enabled() -> bool:
    """Whether fp32 products with few rows take the compiled kernels: they build here and
    BATCHGEN_SMALL_ROWS_KERNEL is not 0 (sgemm, bit for bit the references, runs instead)."""
    return os.environ.get("BATCHGEN_SMALL_ROWS_KERNEL", "1") != "0" and cpu_small_rows_available()


def small_rows_library() -> Any:
    """The compiled library; CpuKernelUnavailableError naming why where it cannot be built."""
    lib = cpu_kernels("small_rows_cpu")
    if lib is None:
        raise CpuKernelUnavailableError(f"the CPU small-row kernels are unavailable: "
                                        f"{cpu_kernels_error('small_rows_cpu')}")
    return lib


def check_fp32(**tensors: torch.Tensor) -> None:
    """KernelInputError naming the first tensor that is not contiguous CPU float32."""
    for name, t in tensors.items():
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise KernelInputError(f"{name} must be a contiguous CPU float32 tensor, got {t.dtype} on {t.device}")


def linear_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias), through the compiled kernel where x has few rows (fp32 on CPU, 2-D,
    small_rows_enabled()); F.linear otherwise. Called for every projection of every forward, so
    it checks only what decides the path and what keeps the kernel in bounds."""
    f32 = torch.float32
    if (x.dtype is not f32 or w.dtype is not f32 or x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]
            or not 0 < x.shape[0] <= small_rows_limit(torch.get_num_threads(), 4 * w.numel())
            or x.stride(1) != 1
            or x.device.type != "cpu" or not w.is_contiguous() or not small_rows_enabled()
            or (bias is not None and (bias.dtype is not f32 or bias.shape != (w.shape[0],) or not bias.is_contiguous()))):
        return F.linear(x, w, bias)
    return linear_small_rows_unchecked(cpu_kernels("small_rows_cpu"), x, w, bias)


def linear_small_rows_cpu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] fp32 (unit last stride), M >= 1; w: [Nout, K]; bias: [Nout] or None -> x w^T + bias."""
    lib = small_rows_library()
    check_fp32(w=w, **({"bias": bias} if bias is not None else {}))
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1:
        raise KernelInputError(f"x must be a CPU float32 [M, K] tensor with unit last stride, got {tuple(x.shape)} "
                               f"{x.dtype} on {x.device}")
    M, K = x.shape
    if w.dim() != 2 or w.shape[1] != K or (bias is not None and bias.shape != (w.shape[0],)):
        raise KernelInputError(f"w must be [Nout, {K}] and bias [Nout], got {tuple(w.shape)} and "
                               f"{None if bias is None else tuple(bias.shape)}")
    if M < 1:
        raise KernelInputError("x has no rows: the kernel takes at least one")
    return linear_small_rows_unchecked(lib, x, w, bias)


def linear_small_rows_unchecked(lib: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel call on checked operands (x [M, K], M >= 1, unit last stride; w [Nout, K]
    contiguous; bias [Nout] contiguous or None; all CPU fp32)."""
    M, K = x.shape
    y = torch.empty(M, w.shape[0], dtype=torch.float32)
    lib.batchgen_linear_small_rows(torch.get_num_threads(), x.data_ptr(), x.stride(0), w.data_ptr(),
                                   None if bias is None else bias.data_ptr(), y.data_ptr(), M, K, w.shape[0])
    return y


def moe_small_rows_cpu(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
                       take: torch.Tensor, out: torch.Tensor) -> None:
    """rows: [R, K] fp32, grouped by expert (counts [E] rows each, in expert order); w13:
    [E, 2N, K]; w2: [E, K, N]; take: [E] bool. Writes silu(x gate^T) * (x up^T) @ w2^T into
    out [R, K] for the rows of the experts taken; other rows are left."""
    lib = small_rows_library()
    E, K, N = w2.shape
    check_fp32(rows=rows, w13=w13, w2=w2, out=out)
    R = rows.shape[0]
    if rows.shape != (R, K) or out.shape != (R, K) or w13.shape != (E, 2 * N, K):
        raise KernelInputError(f"rows and out must be [R, {K}] and w13 [{E}, {2 * N}, {K}], got "
                               f"{tuple(rows.shape)}, {tuple(out.shape)}, {tuple(w13.shape)}")
    if counts.shape != (E,) or take.shape != (E,) or int(counts.sum()) != R:
        raise KernelInputError(f"counts and take must be [{E}] and counts must sum to {R} rows")
    starts = torch.zeros(E + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=starts[1:])
    take8 = take.to(torch.uint8).contiguous()
    lib.batchgen_moe_small_rows(torch.get_num_threads(), rows.data_ptr(), w13.data_ptr(), w2.data_ptr(),
                                starts.data_ptr(), take8.data_ptr(), out.data_ptr(), E, K, N)


def moe_routed_small_rows_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                              topk_ids: torch.Tensor, max_rows: int) -> torch.Tensor | None:
    """The whole routed expert layer in one kernel call: x [T, K] fp32; w13 [E, 2N, K]; w2
    [E, K, N]; topk_weights [T, A] fp32; topk_ids [T, A] int64 (outside [0, E): unrouted) ->
    [T, K], the floats the grouped path gives with every expert through the kernel (slots sorted
    stably by expert, each weighted, summed over A in order). None, with nothing computed, when
    an expert has more than max_rows rows."""
    lib = small_rows_library()
    E, K, N = w2.shape
    check_fp32(x=x, w13=w13, w2=w2, topk_weights=topk_weights)
    T, A = topk_ids.shape
    if x.shape != (T, K) or w13.shape != (E, 2 * N, K) or topk_weights.shape != (T, A):
        raise KernelInputError(f"x must be [{T}, {K}], w13 [{E}, {2 * N}, {K}] and topk_weights [{T}, {A}], got "
                               f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(topk_weights.shape)}")
    if topk_ids.dtype != torch.int64 or topk_ids.device.type != "cpu" or not topk_ids.is_contiguous():
        raise KernelInputError(f"topk_ids must be a contiguous CPU int64 tensor, got {topk_ids.dtype} on "
                               f"{topk_ids.device}")
    out = torch.empty(T, K, dtype=torch.float32)
    if lib.batchgen_moe_routed_small_rows(torch.get_num_threads(), x.data_ptr(), T, A, topk_ids.data_ptr(),
                                          topk_weights.data_ptr(), w13.data_ptr(), w2.data_ptr(), E, K, N,
                                          max_rows, out.data_ptr()):
        return None
    return out
