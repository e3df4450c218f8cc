"""CUDA-graph decode, the torch-free part: which batch sizes get a graph, which graph a decode
step runs in, and how its inputs are padded up to that size (as vLLM does).

A graph replays fixed shapes, so a decode step of n sequences runs in the graph of the smallest
captured size >= n; the rows past n are padding: token 0 at position 0, attending one slot of
block 0 (a context of 1, so the kernel reads real memory), writing its KV to `pad_slot`, a
slot outside every block that nothing reads. Their outputs are dropped.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# vLLM's default capture sizes: 1, 2, 4, then every multiple of 8 up to this
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, largest: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, 24, ... up to min(max_num_seqs, largest),
    that bound included (so every decode step the scheduler can plan has a graph)."""
    top = min(max_num_seqs, largest)
    if top < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return tuple(sizes)


def pick_bucket(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds n rows; None when n is above them all (eager)."""
    return next((s for s in sorted(sizes) if s >= n), None) if n >= 1 else None


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """One decode step's graph inputs, padded to `bucket` rows (python lists, copied once)."""

    bucket: int
    tokens: list[int]  # [bucket]
    positions: list[int]  # [bucket]
    slots: list[int]  # [bucket] where each row's new KV goes
    context_lens: list[int]  # [bucket], the new token included
    tables: list[list[int]]  # [bucket, width]: width = the most blocks any row needs this step


def pad_decode(rows: Sequence[tuple[int, int, Sequence[int]]], bucket: int, block_size: int,
               pad_slot: int) -> DecodeStep:
    """rows: per sequence (its new token, tokens already computed, block ids) -> the padded step.

    The new token sits at position `computed`, so its context is computed + 1 tokens."""
    n = len(rows)
    if not 1 <= n <= bucket:
        raise ValueError(f"{n} rows do not fit a graph of {bucket}")
    width = max(-(-(computed + 1) // block_size) for _, computed, _ in rows)
    tokens, positions, slots, lens, tables = [], [], [], [], []
    for token, computed, blocks in rows:
        if len(blocks) * block_size <= computed:
            raise ValueError(f"position {computed} is past the {len(blocks)} blocks of its sequence")
        tokens.append(token)
        positions.append(computed)
        slots.append(blocks[computed // block_size] * block_size + computed % block_size)
        lens.append(computed + 1)
        table = list(blocks[:width])
        tables.append(table + [0] * (width - len(table)))
    pad = bucket - n
    return DecodeStep(bucket, tokens + [0] * pad, positions + [0] * pad, slots + [pad_slot] * pad,
                      lens + [1] * pad, tables + [[0] * width for _ in range(pad)])
