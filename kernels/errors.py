"""Every exception batchgen_kernels raises on purpose lives here.

`kernels/` must not import `batchgen`, so these do not derive from `batchgen.errors`; callers
that want one family catch `KernelError`.
"""
from __future__ import annotations


class KernelError(Exception):
    """Base class of batchgen_kernels' own errors."""


class KernelInputError(KernelError, ValueError):
    """A tensor or launch config has the wrong shape, dtype, device or layout; the message names
    the argument, the field and the bad value."""


class TritonUnavailableError(KernelError, ImportError):
    """Triton is not installed (or failed to import), so the fused kernels cannot run."""


class CpuKernelUnavailableError(KernelError, ImportError):
    """The compiled CPU kernels could not be built or loaded here (no compiler, a failed build)."""
