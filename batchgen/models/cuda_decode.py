"""Decode attention on CUDA: block tables handed to the Triton paged-attention kernel, which
reads the cache in place (no per-group gather into a padded copy).

Shape legend: Sd decoding sequences, MB blocks in the widest table, Hq query heads.
Only `attention.py` and `mla.py` use this, and only when the KV pool is a CUDA tensor and
triton imports; everywhere else decode attends through the torch path.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchgen_kernels import triton_available


@dataclass(slots=True)
class DecodeTables:
    """The decoding tokens of a flat batch, as the paged kernel reads them."""

    rows: torch.Tensor  # [Sd] rows of their single new tokens in the flat batch
    block_tables: torch.Tensor  # [Sd, MB] int32 (columns past a context's blocks: 0, never read)
    context_lens: torch.Tensor  # [Sd] int32, the new token included
    block_size: int

    @staticmethod
    def build(decodes: Sequence[tuple[int, int, Sequence[int]]], block_size: int,
              device: torch.device) -> "DecodeTables":
        """decodes: per decoding sequence (row, context length, block ids)."""
        width = max(-(-n // block_size) for _, n, _ in decodes)
        table = [list(blocks[:width]) + [0] * (width - min(len(blocks), width)) for _, _, blocks in decodes]
        return DecodeTables(torch.tensor([r for r, _, _ in decodes], dtype=torch.long, device=device),
                            torch.tensor(table, dtype=torch.int32, device=device),
                            torch.tensor([n for _, n, _ in decodes], dtype=torch.int32, device=device), block_size)


def use_paged_kernel(device: torch.device) -> bool:
    """Whether decode attention on a KV pool on `device` runs in the Triton kernel."""
    return device.type == "cuda" and triton_available()
