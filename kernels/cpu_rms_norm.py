"""RMSNorm on CPU in one compiled pass per row (csrc/rms_norm_cpu.cpp), and its torch reference.

torch's RMSNorm on CPU (F.rms_norm, then the weight's mul) runs as a composite of operators (pow,
mean, add, rsqrt, mul under the profiler), each a pass over the activations, and a model runs two
a layer: at a prompt step's 2,048 x 1,024 floats they took 0.48 ms against the kernel's 0.28
warm, 1.01 against 0.73 ms with the caches emptied between calls (two threads, Zen 4). The kernel
repeats torch's operations in torch's order (its cascade sum of eight-lane vectors, as torch 2.13
sums), so its floats are torch's, and transformers'; `rms_norm_kernel_for` checks that once per
dtype and width against the reference before a caller relies on it, since torch may sum in
another order on another build.
"""
from __future__ import annotations

from typing import Any

import torch

from ._cpu_build import cpu_kernels, cpu_kernels_error
from .errors import CpuKernelUnavailableError, KernelInputError

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_CHECK_ROWS = 16
_matches: dict[tuple[torch.dtype, int], bool] = {}  # (dtype, width) -> kernel == reference there


def cpu_rms_norm_available() -> bool:
    """Whether the compiled RMSNorm kernel is usable here (built on first call)."""
    return cpu_kernels("rms_norm_cpu") is not None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalize in fp32, round to x's dtype, then scale by the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


# From this many values a row, torch splits a lone row's sum over its threads (its reduction's
# grain size), an order the kernel does not repeat: wider rows stay with torch.
_TORCH_SPLIT_WIDTH = 32768


def rms_norm_kernel_for(dtype: torch.dtype, width: int) -> Any | None:
    """The kernel's library where it runs here and gives the reference's floats on rows of
    `width` values of `dtype` (float32 or bfloat16), else None. Checked on first call per (dtype,
    width) on rows of random values of several scales: a sum in another order than torch's gives
    other floats in most such rows, so a match is no accident."""
    lib = cpu_kernels("rms_norm_cpu")  # (asked each time: BATCHGEN_CPU_KERNELS may change)
    if lib is None:
        return None
    key = (dtype, width)
    if key not in _matches:
        ok = dtype in _DTYPES and 0 < width < _TORCH_SPLIT_WIDTH
        if ok:
            g = torch.Generator().manual_seed(width)
            scales = torch.logspace(-3, 3, _CHECK_ROWS, dtype=torch.float64).to(torch.float32).unsqueeze(1)
            x = (torch.randn(_CHECK_ROWS, width, generator=g) * scales).to(dtype)
            weight = torch.randn(width, generator=g).to(dtype)
            ok = torch.equal(rms_norm_unchecked(lib, x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))
        _matches[key] = ok
    return lib if _matches[key] else None


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference` over x's last dim, compiled: x [..., n] and weight [n], both CPU
    float32 or both bfloat16 -> a new contiguous tensor shaped like x."""
    lib = cpu_kernels("rms_norm_cpu")
    if lib is None:
        raise CpuKernelUnavailableError(f"the CPU RMSNorm kernel is unavailable: {cpu_kernels_error('rms_norm_cpu')}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or x.device.type != "cpu" or weight.device.type != "cpu":
        raise KernelInputError(f"x and weight must be CPU float32 or bfloat16 of one dtype, got {x.dtype} on "
                               f"{x.device} and {weight.dtype} on {weight.device}")
    n = x.shape[-1] if x.dim() else 0
    if n == 0 or tuple(weight.shape) != (n,):
        raise KernelInputError(f"x must be [..., n] with n > 0 and weight [n], got {tuple(x.shape)} and "
                               f"{tuple(weight.shape)}")
    return rms_norm_unchecked(lib, x, weight, eps)


def rms_norm_unchecked(lib: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel call on operands as rms_norm_cpu checks them."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < n):
        rows = rows.contiguous()
    weight = weight.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype)
    lib.batchgen_rms_norm(_DTYPES[x.dtype], rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(),
                          rows.shape[0], n, float(eps), torch.get_num_threads())
    return out.view(x.shape)
