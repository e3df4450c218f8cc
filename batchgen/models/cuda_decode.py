"""Decode attention through block tables, reading the paged cache in place (no per-group gather
into a padded copy): the Triton paged-attention kernel on CUDA, the compiled C++ kernel
(batchgen_kernels.cpu_paged_attention) on CPU.

Shape legend: Sd decoding sequences, MB blocks in the widest table, Hq query heads.
Only `attention.py` and `mla.py` use this, and only when `use_paged_kernel` says the KV pool's
device and dtype have a kernel; everywhere else decode attends through the torch path (length
groups, blocks gathered per group), which stays the reference.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchgen_kernels import (
    cpu_paged_attention_available,
    cpu_rope_kv_available,
    paged_attention_gqa,
    paged_attention_gqa_cpu,
    paged_attention_mla,
    paged_attention_mla_cpu,
    triton_available,
)

CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(slots=True)
class DecodeTables:
    """The decoding tokens of a flat batch, as the paged kernel reads them."""

    rows: torch.Tensor  # [Sd] rows of their single new tokens in the flat batch
    block_tables: torch.Tensor  # [Sd, MB] int32 (columns past a context's blocks: 0, never read)
    context_lens: torch.Tensor  # [Sd] int32, the new token included
    block_size: int

    @staticmethod
    def build(decodes: Sequence[tuple[int, int, Sequence[int]]], block_size: int,
              device: torch.device) -> DecodeTables:
        """decodes: per decoding sequence (row, context length, block ids)."""
        width = max(-(-n // block_size) for _, n, _ in decodes)
        table = [list(blocks[:width]) + [0] * (width - min(len(blocks), width)) for _, _, blocks in decodes]
        return DecodeTables(torch.tensor([r for r, _, _ in decodes], dtype=torch.long, device=device),
                            torch.tensor(table, dtype=torch.int32, device=device),
                            torch.tensor([n for _, n, _ in decodes], dtype=torch.int32, device=device), block_size)


def use_paged_kernel(device: torch.device, dtype: torch.dtype | None = None) -> bool:
    """Whether decode attention on a KV pool on `device` (holding `dtype`) runs in a paged kernel.
    CUDA: when triton imports. CPU: when the C++ kernel builds here and dtype (which must be
    given) is float32 or bfloat16; BATCHGEN_CPU_KERNELS=0 turns it off."""
    if device.type == "cuda":
        return triton_available()
    return device.type == "cpu" and dtype in CPU_KERNEL_DTYPES and cpu_paged_attention_available()


def use_fused_rope(qkv: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether rope of q/k and the KV write run as one compiled CPU pass (rope_kv_write_cpu):
    both on CPU in one supported dtype, and the kernel built here."""
    return qkv.device.type == "cpu" and cache.device.type == "cpu" and qkv.dtype == cache.dtype \
        and qkv.dtype in CPU_KERNEL_DTYPES and cpu_rope_kv_available()


def _on_cpu_kernel(q: torch.Tensor) -> bool:
    # a CPU tensor without the C++ kernel only gets here when a test forces the Triton interpreter
    return q.device.type == "cpu" and q.dtype in CPU_KERNEL_DTYPES and cpu_paged_attention_available()


def gqa_decode(q: torch.Tensor, cache: torch.Tensor, t: DecodeTables, num_kv_heads: int, scale: float,
               window: int | None) -> torch.Tensor:
    """q: [Sd, Hq, D]; cache: [slots, 2 Hk D] -> [Sd, Hq, D]."""
    fn = paged_attention_gqa_cpu if _on_cpu_kernel(q) else paged_attention_gqa
    return fn(q, cache, t.block_tables, t.context_lens, t.block_size, num_kv_heads, scale, window)


def mla_decode(q: torch.Tensor, cache: torch.Tensor, t: DecodeTables, kv_lora_rank: int,
               scale: float) -> torch.Tensor:
    """q: [Sd, Hq, R + P] (absorbed); cache: [slots, R + P] -> [Sd, Hq, R]."""
    fn = paged_attention_mla_cpu if _on_cpu_kernel(q) else paged_attention_mla
    return fn(q, cache, t.block_tables, t.context_lens, t.block_size, kv_lora_rank, scale)
