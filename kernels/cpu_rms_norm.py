"""RMSNorm on CPU in one compiled pass per row (csrc/rms_norm_cpu.cpp), and its torch reference.

torch's RMSNorm on CPU is a composite of five operators (pow, mean, add, rsqrt, mul), each a pass
over the activations, and a model runs two a layer: at a prompt step's 2,048 x 1,024 floats they
took 0.48 ms against the kernel's 0.28 warm, 1.01 against 0.73 ms with the caches emptied between
calls (two threads, Zen 4); in a benchmark job the norms took 0.47 s against 0.25. The kernel repeats
torch's operations in torch's order (its cascade sum of eight-lane vectors), so its floats are
torch's, and transformers'; `rms_norm_kernel_matches` checks that once per dtype and width
against the reference before a caller relies on it, since torch may sum in another order on
another build.
"""
from __future__ import annotations

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


def rms_norm_kernel_matches(dtype: torch.dtype, width: int) -> bool:
    """Whether the kernel runs here and gives the reference's floats on rows of `width` values of
    `dtype` (float32 or bfloat16). Checked on first call per (dtype, width) on rows of random
    values of several scales: a sum in another order than torch's gives other floats in most
    such rows, so a match is no accident."""
    if not cpu_rms_norm_available():  # (asked each time: BATCHGEN_CPU_KERNELS may change)
        return False
    key = (dtype, width)
    if key not in _matches:
        ok = dtype in _DTYPES and width > 0
        if ok:
            g = torch.Generator().manual_seed(width)
            scales = torch.logspace(-3, 3, _CHECK_ROWS, dtype=torch.float64).to(torch.float32).unsqueeze(1)
            x = (torch.randn(_CHECK_ROWS, width, generator=g) * scales).to(dtype)
            weight = torch.randn(width, generator=g).to(dtype)
            ok = torch.equal(rms_norm_cpu(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))
        _matches[key] = ok
    return _matches[key]


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
    rows = x.reshape(-1, n)
    if rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < n):
        rows = rows.contiguous()
    weight = weight.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype)
    lib.batchgen_rms_norm(_DTYPES[x.dtype], rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(),
                          rows.shape[0], n, float(eps), torch.get_num_threads())
    return out.view(x.shape)
