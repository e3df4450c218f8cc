"""batchgen_kernels: fused Mixture-of-Experts kernels (Triton on CUDA) and their plain-torch
references, and the grouped-GEMM CPU path (grouped_moe.py).

Importing this package never imports triton; `fused_moe` does on first call and raises
`TritonUnavailableError` (an ImportError) when it is missing.
"""
from __future__ import annotations

from .config import get_config
from .errors import KernelError, KernelInputError, TritonUnavailableError
from .fused_moe import fused_moe, moe_align_triton, triton_available
from .grouped_moe import fused_moe_grouped, fused_moe_grouped_into, grouped_mm_supported
from .reference import fused_moe_reference, fused_moe_reference_into, moe_align, moe_align_sizes

__all__ = [
    "KernelError",
    "KernelInputError",
    "TritonUnavailableError",
    "fused_moe",
    "fused_moe_grouped",
    "fused_moe_grouped_into",
    "fused_moe_reference",
    "fused_moe_reference_into",
    "get_config",
    "grouped_mm_supported",
    "moe_align",
    "moe_align_sizes",
    "moe_align_triton",
    "triton_available",
]
