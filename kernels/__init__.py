"""batchgen_kernels: fused Mixture-of-Experts and paged decode attention kernels (Triton on
CUDA; compiled C++ on CPU, cpu_paged_attention.py) and their plain-torch references, and the
grouped-GEMM CPU MoE path (grouped_moe.py), whose experts with few rows take a compiled kernel, as do
dense projections with few rows (`linear_rows`, cpu_small_rows.py). A CPU model's fp32 weights past
the cache are kept in tiles and run by one compiled kernel at every row count (expert_tiles.py,
tiled_linear.py).

Importing this package never imports triton; `fused_moe` and the paged-attention launchers do on first call and raises
`TritonUnavailableError` (an ImportError) when it is missing.
"""
from __future__ import annotations

from .config import get_config
from .cpu_paged_attention import cpu_paged_attention_available, paged_attention_gqa_cpu, paged_attention_mla_cpu
from .cpu_rope import cpu_rope_kv_available, rope_kv_write_cpu, rope_kv_write_reference
from .cpu_small_rows import cpu_small_rows_available, linear_rows
from .errors import CpuKernelUnavailableError, KernelError, KernelInputError, TritonUnavailableError
from .fused_moe import fused_moe, moe_align_triton, triton_available
from .grouped_moe import fused_moe_grouped, fused_moe_grouped_into, grouped_mm_supported
from .paged_attention import paged_attention_gqa, paged_attention_mla
from .paged_attention_reference import paged_attention_gqa_reference, paged_attention_mla_reference
from .reference import fused_moe_reference, fused_moe_reference_into, moe_align, moe_align_sizes

__all__ = [
    "CpuKernelUnavailableError",
    "KernelError",
    "KernelInputError",
    "TritonUnavailableError",
    "fused_moe",
    "fused_moe_grouped",
    "fused_moe_grouped_into",
    "fused_moe_reference",
    "fused_moe_reference_into",
    "cpu_paged_attention_available",
    "cpu_rope_kv_available",
    "cpu_small_rows_available",
    "get_config",
    "grouped_mm_supported",
    "linear_rows",
    "moe_align",
    "moe_align_sizes",
    "moe_align_triton",
    "paged_attention_gqa",
    "paged_attention_gqa_cpu",
    "paged_attention_gqa_reference",
    "paged_attention_mla",
    "paged_attention_mla_cpu",
    "paged_attention_mla_reference",
    "rope_kv_write_cpu",
    "rope_kv_write_reference",
    "triton_available",
]
