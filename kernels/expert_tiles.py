"""Experts stored in tiles for the CPU (csrc/small_rows_cpu.cpp, `batchgen_moe_routed_tiled`).

Each weight matrix's rows are taken eight at a time and interleaved along k: w13 [E, 2N, K] is
kept as [E, 2N / 8, K, 8] and w2 [E, K, N] as [E, K / 8, N, 8] (tile[k, lane] = w[8 p + lane, k]).
One kernel tile reads them for every row count: an x element broadcast against eight weight rows,
so rows of x are never padded to a panel of eight, and the weights stream as one contiguous run
per eight rows. The whole routed layer (gather by expert, the experts, the weighted sum over the
choices) is one call for any number of rows: no sgemm path is left, since the tiles are the only
copy of the experts.

Every output is one chain of fused multiply-adds over k, in the same order whatever rows are
batched with it: a row's result never depends on its batch (the plain layout's kernel changes
its order at PANEL_ROWS). The reference is `fused_moe_reference` on the untiled weights; they
agree within fp32 rounding.

Measured against the plain layout's kernel (8 experts of 1024 x 1024 read from memory, 2 AVX2
threads, equal rows per expert, alternated builds): 1.13-1.15x at 1-8 rows an expert, 1.09-1.33x
at 9-17, level at 24, 1.04-1.14x at 32-512 (166 GFLOP/s at 512, the rate of torch's sgemm on
these shapes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_small_rows
from .errors import KernelInputError

LANES = 8  # weight rows a tile interleaves (the kernel's kLanes)


@dataclass(frozen=True, slots=True)
class ExpertTiles:
    """The routed experts of one MoE layer, tiled: w13 [E, 2N / 8, K, 8], w2 [E, K / 8, N, 8]."""

    w13: torch.Tensor
    w2: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:  # K
        return self.w13.shape[2]

    @property
    def width(self) -> int:  # N
        return self.w2.shape[2]

    def untiled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """w13 [E, 2N, K] and w2 [E, K, N] again (new tensors)."""
        return _untile(self.w13), _untile(self.w2)


def _tile(w: torch.Tensor) -> torch.Tensor:
    E, rows, k = w.shape
    return w.view(E, rows // LANES, LANES, k).transpose(2, 3).contiguous()


def _untile(t: torch.Tensor) -> torch.Tensor:
    E, panels, k, lanes = t.shape
    return t.transpose(2, 3).reshape(E, panels * lanes, k)


def tiles_supported(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether these experts (w13 [E, 2N, K], w2 [E, K, N]) should be tiled and run by the
    kernel here: fp32 on the CPU, N and K multiples of eight, an expert's weights too large for
    the cache (below cpu_small_rows.IN_CACHE_BYTES sgemm wins at every row count, and the plain
    layout keeps it), the kernel built and not turned off (BATCHGEN_SMALL_ROWS_KERNEL=0 keeps the
    plain layout and its paths)."""
    if w13.dim() != 3 or w2.dim() != 3:
        return False
    E, K, N = w2.shape
    return (w13.dtype == w2.dtype == torch.float32 and w13.device.type == w2.device.type == "cpu"
            and w13.shape == (E, 2 * N, K) and N % LANES == 0 and K % LANES == 0
            and 3 * N * K * 4 >= cpu_small_rows.IN_CACHE_BYTES and cpu_small_rows.small_rows_enabled())


def tile_experts(w13: torch.Tensor, w2: torch.Tensor) -> ExpertTiles:
    """w13 [E, 2N, K] and w2 [E, K, N] (fp32, N and K multiples of eight) as tiles."""
    if w13.dim() != 3 or w2.dim() != 3 or w13.dtype != torch.float32 or w2.dtype != torch.float32:
        raise KernelInputError(f"w13 and w2 must be 3-D float32 tensors, got {tuple(w13.shape)} {w13.dtype} and "
                               f"{tuple(w2.shape)} {w2.dtype}")
    E, K, N = w2.shape
    if w13.shape != (E, 2 * N, K) or N % LANES or K % LANES:
        raise KernelInputError(f"w13 must be [{E}, {2 * N}, {K}] with N = {N} and K = {K} multiples of {LANES}, "
                               f"got w13 {tuple(w13.shape)}")
    return ExpertTiles(_tile(w13), _tile(w2))


def moe_tiled_cpu(x: torch.Tensor, tiles: ExpertTiles, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed expert layer: x [T, K] fp32; topk_weights [T, A] fp32; topk_ids [T, A] int64
    (outside [0, E): unrouted) -> [T, K], `fused_moe_reference(x, *tiles.untiled(), ...)`
    within fp32 rounding."""
    lib = cpu_small_rows.small_rows_library()
    E, K, N = tiles.num_experts, tiles.hidden, tiles.width
    if tiles.w13.shape != (E, 2 * N // LANES, K, LANES) or tiles.w2.shape != (E, K // LANES, N, LANES):
        raise KernelInputError(f"tiles must be [E, 2N / {LANES}, K, {LANES}] and [E, K / {LANES}, N, {LANES}], got "
                               f"{tuple(tiles.w13.shape)} and {tuple(tiles.w2.shape)}")
    cpu_small_rows.check_fp32(**{"x": x, "topk_weights": topk_weights, "tiles.w13": tiles.w13, "tiles.w2": tiles.w2})
    if (topk_ids.dim() != 2 or topk_ids.dtype != torch.int64 or topk_ids.device.type != "cpu"
            or not topk_ids.is_contiguous()):
        raise KernelInputError(f"topk_ids must be a contiguous CPU int64 [T, A] tensor, got {tuple(topk_ids.shape)} "
                               f"{topk_ids.dtype} on {topk_ids.device}")
    T, A = topk_ids.shape
    if x.shape != (T, K) or topk_weights.shape != (T, A):
        raise KernelInputError(f"x must be [{T}, {K}] and topk_weights [{T}, {A}], got {tuple(x.shape)} and "
                               f"{tuple(topk_weights.shape)}")
    out = torch.empty(T, K, dtype=torch.float32)
    lib.batchgen_moe_routed_tiled(torch.get_num_threads(), x.data_ptr(), T, A, topk_ids.data_ptr(),
                                  topk_weights.data_ptr(), tiles.w13.data_ptr(), tiles.w2.data_ptr(), E, K, N,
                                  out.data_ptr())
    return out
