"""Routed experts that see few rows each, on CPU (csrc/moe_small_cpu.cpp): the decode tail.

# R routed rows sorted by expert, E experts, K hidden, N expert width
With 1-16 rows an expert's two GEMMs are bound by reading its weights once, and sgemm reads
them well below the memory's rate (on 2 AVX2 cores: 3-10 GB/s on one thread, nothing more from
the second, against 13.5 / 26.7 GB/s of plain reads). The kernel gives every thread its own
weight rows of every expert and reads each once. Its reference is the per-expert GEMM of
`reference.fused_moe_reference`; it agrees within fp32 rounding (different summation order),
and a row's result does not depend on the rows batched with it.
"""
from __future__ import annotations

import torch

from ._cpu_build import cpu_kernels, cpu_kernels_error
from .errors import CpuKernelUnavailableError, KernelInputError

# Rows per expert up to which the kernel beats sgemm (torch._grouped_mm), on one thread and on
# more. Measured on 2 AVX2 cores, hidden 1024, width 1024, 8 experts (bench_small_experts.py):
# two threads 1.5-2.9x at 1-24 rows, 1.25x at 32, level at 48; one thread 1.0-1.7x at 1-16
# rows, 0.87x at 24 (sgemm's second thread adds little here; the kernel's doubles its rate).
SMALL_ROWS_ONE_THREAD = 16
SMALL_ROWS_THREADS = 32
_MAX_ROWS = 64  # the kernel's kMaxRows


def small_rows_limit(threads: int) -> int:
    """Most rows per expert the kernel should take with this many threads."""
    return SMALL_ROWS_ONE_THREAD if threads <= 1 else SMALL_ROWS_THREADS


def cpu_moe_small_available() -> bool:
    """Whether the compiled small-row expert kernel is usable here (built on first call)."""
    return cpu_kernels("moe_small_cpu") is not None


def moe_small_rows_cpu(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
                       take: torch.Tensor, out: torch.Tensor) -> None:
    """rows: [R, K] fp32, grouped by expert (counts [E] rows each, in expert order); w13:
    [E, 2N, K]; w2: [E, K, N]; take: [E] bool. Writes silu(x gate^T) * (x up^T) @ w2^T into
    out [R, K] for the rows of the experts taken (at most 64 rows each); other rows are left."""
    lib = cpu_kernels("moe_small_cpu")
    if lib is None:
        raise CpuKernelUnavailableError(f"the CPU expert kernel is unavailable: {cpu_kernels_error('moe_small_cpu')}")
    E, K, N = w2.shape
    tensors = {"rows": rows, "w13": w13, "w2": w2, "out": out}
    for name, t in tensors.items():
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise KernelInputError(f"{name} must be a contiguous CPU float32 tensor, got {t.dtype} on {t.device}")
    R = rows.shape[0]
    if rows.shape != (R, K) or out.shape != (R, K) or w13.shape != (E, 2 * N, K):
        raise KernelInputError(f"rows and out must be [R, {K}] and w13 [{E}, {2 * N}, {K}], got "
                               f"{tuple(rows.shape)}, {tuple(out.shape)}, {tuple(w13.shape)}")
    if counts.shape != (E,) or take.shape != (E,) or int(counts.sum()) != R:
        raise KernelInputError(f"counts and take must be [{E}] and counts must sum to {R} rows")
    starts = torch.zeros(E + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=starts[1:])
    take8 = take.to(torch.uint8).contiguous()
    h = torch.empty(R, N, dtype=torch.float32)
    if lib.batchgen_moe_small_rows(torch.get_num_threads(), rows.data_ptr(), w13.data_ptr(), w2.data_ptr(),
                                   starts.data_ptr(), take8.data_ptr(), h.data_ptr(), out.data_ptr(), E, K, N):
        raise KernelInputError(f"an expert taken has more than {_MAX_ROWS} rows")
