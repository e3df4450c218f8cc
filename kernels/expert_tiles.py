"""Experts stored in tiles for the CPU (csrc/small_rows_cpu.cpp, `batchgen_moe_routed_tiled`).

Each weight matrix's rows are taken L at a time and interleaved along k: w13 [E, 2N, K] is kept
as [E, 2N / L, K, L] and w2 [E, K, N] as [E, K / L, N, L] (tile[k, lane] = w[L p + lane, k]). L,
the tiles' lanes, is 16 where the kernel is built with AVX-512 and N and K are multiples of 16,
else 8 (`tile_lanes`). One kernel tile reads them for every row count: an x element broadcast
against L weight rows, so rows of x are never padded to a panel, and the weights stream as one
contiguous run per L rows. The whole routed layer (gather by expert, the experts, the weighted sum
over the choices) is one call for any number of rows: no sgemm path is left, since the tiles are
the only copy of the experts.

Every output is one chain of fused multiply-adds over k, in the same order whatever rows are
batched with it and whatever L: a row's result never depends on its batch (the plain layout's
kernel changes its order at PANEL_ROWS), and 8- and 16-lane tiles give the same floats. The
reference is `fused_moe_reference` on the untiled weights; they agree within fp32 rounding.

Measured against the plain layout's kernel (8 experts of 1024 x 1024 read from memory, 2 AVX2
threads, equal rows per expert, alternated builds): 1.13-1.15x at 1-8 rows an expert, 1.09-1.33x
at 9-17, level at 24, 1.04-1.14x at 32-512 (166 GFLOP/s at 512, the rate of torch's sgemm on
these shapes). Sixteen lanes against eight (Zen 4, the same experts): 1.04-1.14x at 5-64 rows an
expert, 1.02x at 512.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_small_rows
from .errors import KernelInputError
from .huge_pages import contiguous_on_huge_pages

LANE_COUNTS = (8, 16)  # weight rows a tile may interleave (the kernel's TileShape)


@dataclass(frozen=True, slots=True)
class ExpertTiles:
    """The routed experts of one MoE layer, tiled: w13 [E, 2N / L, K, L], w2 [E, K / L, N, L]."""

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

    @property
    def lanes(self) -> int:  # L
        return self.w13.shape[3]

    def untiled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """w13 [E, 2N, K] and w2 [E, K, N] again (new tensors)."""
        return _untile(self.w13), _untile(self.w2)


def _tile(w: torch.Tensor, lanes: int) -> torch.Tensor:
    E, rows, k = w.shape
    return contiguous_on_huge_pages(w.view(E, rows // lanes, lanes, k).transpose(2, 3))


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
            and w13.shape == (E, 2 * N, K) and N % 8 == 0 and K % 8 == 0
            and 3 * N * K * 4 >= cpu_small_rows.IN_CACHE_BYTES and cpu_small_rows.small_rows_enabled())


def widest_lanes() -> int:
    """The widest tiles the kernel built here takes: 16 with AVX-512, else 8."""
    return int(cpu_small_rows.small_rows_library().batchgen_tile_lanes())


def tile_lanes(lanes: int | None, **sizes: int) -> int:
    """`lanes` for tiles whose named sizes (N, K, ...) the lanes must divide, checked
    (KernelInputError naming them); None: the widest the kernel built here takes that divides
    them all, at least 8."""
    named = " and ".join(f"{name} = {size}" for name, size in sizes.items())
    if lanes is None:
        lanes = next((n for n in sorted(LANE_COUNTS, reverse=True)
                      if n <= widest_lanes() and all(size % n == 0 for size in sizes.values())), 8)
    if lanes not in LANE_COUNTS:
        raise KernelInputError(f"tiles have 8 or 16 lanes, not {lanes}")
    if any(size % lanes for size in sizes.values()):
        raise KernelInputError(f"tiles of {lanes} lanes need {named} multiples of {lanes}")
    return lanes


def tile_experts(w13: torch.Tensor, w2: torch.Tensor, lanes: int | None = None) -> ExpertTiles:
    """w13 [E, 2N, K] and w2 [E, K, N] (fp32, N and K multiples of `lanes`) as tiles of `lanes`
    lanes (8 or 16; None: the widest the kernel built here takes that divides N and K)."""
    if w13.dim() != 3 or w2.dim() != 3 or w13.dtype != torch.float32 or w2.dtype != torch.float32:
        raise KernelInputError(f"w13 and w2 must be 3-D float32 tensors, got {tuple(w13.shape)} {w13.dtype} and "
                               f"{tuple(w2.shape)} {w2.dtype}")
    E, K, N = w2.shape
    if w13.shape != (E, 2 * N, K):
        raise KernelInputError(f"w13 must be [{E}, {2 * N}, {K}] for w2 {tuple(w2.shape)}, got {tuple(w13.shape)}")
    lanes = tile_lanes(lanes, N=N, K=K)
    return ExpertTiles(_tile(w13, lanes), _tile(w2, lanes))


def moe_tiled_cpu(x: torch.Tensor, tiles: ExpertTiles, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed expert layer: x [T, K] fp32; topk_weights [T, A] fp32; topk_ids [T, A] int64
    (outside [0, E): unrouted) -> [T, K], `fused_moe_reference(x, *tiles.untiled(), ...)`
    within fp32 rounding."""
    lib = cpu_small_rows.small_rows_library()
    if tiles.w13.dim() != 4 or tiles.w2.dim() != 4 or tiles.lanes not in LANE_COUNTS:
        raise KernelInputError(f"tiles must be [E, 2N / L, K, L] and [E, K / L, N, L] with L 8 or 16, got "
                               f"{tuple(tiles.w13.shape)} and {tuple(tiles.w2.shape)}")
    E, K, N, L = tiles.num_experts, tiles.hidden, tiles.width, tiles.lanes
    if tiles.w13.shape != (E, 2 * N // L, K, L) or tiles.w2.shape != (E, K // L, N, L):
        raise KernelInputError(f"tiles must be [E, 2N / L, K, L] and [E, K / L, N, L], got "
                               f"{tuple(tiles.w13.shape)} and {tuple(tiles.w2.shape)}")
    if L > widest_lanes():
        raise KernelInputError(f"tiles of {L} lanes: the kernel built on this CPU takes 8"
                               f"{' or 16' if widest_lanes() == 16 else ''} (re-tile the experts here)")
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
    status = lib.batchgen_moe_routed_tiled(torch.get_num_threads(), x.data_ptr(), T, A, topk_ids.data_ptr(),
                                           topk_weights.data_ptr(), tiles.w13.data_ptr(), tiles.w2.data_ptr(), E, K,
                                           N, L, out.data_ptr())
    if status != 0:  # (checked above; a build that disagrees with batchgen_tile_lanes would land here)
        raise KernelInputError(f"the CPU kernel refused tiles of {L} lanes")
    return out
