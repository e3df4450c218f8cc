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

bf16 experts, on a CPU with AVX512-BF16, are tiled too: 16 lanes whose k runs in pairs (w13 as
[E, 2N / 16, K / 2, 16, 2], tile[kp, lane, j] = w[16 p + lane, 2 kp + j]) for vdpbf16ps, which
multiplies a pair of bf16 x elements against a pair of each of 16 weight rows and accumulates in
fp32: twice the fp32 tile's multiply-adds an instruction, from half the bytes. x and the
activation between the two products are bf16 (as a bf16 model's are); the result is the fp32 sum
over the choices, rounded to bf16 once. The reference is `fused_moe_reference` in fp32 on the
same bf16 values, within bf16 rounding of the activation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_small_rows
from ._cpu_build import cpu_features
from .errors import KernelInputError
from .huge_pages import contiguous_on_huge_pages

LANE_COUNTS = (8, 16)  # weight rows a tile may interleave (the kernel's TileShape)
BF16_LANES = 16  # bf16 tiles' lanes (the kernel's kBf16Lanes)


@dataclass(frozen=True, slots=True)
class ExpertTiles:
    """The routed experts of one MoE layer, tiled: w13 [E, 2N / L, K, L], w2 [E, K / L, N, L]."""

    w13: torch.Tensor
    w2: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def paired(self) -> bool:
        """bf16 tiles whose k runs in pairs ([E, 2N / 16, K / 2, 16, 2])."""
        return self.w13.dim() == 5

    @property
    def hidden(self) -> int:  # K
        return self.w13.shape[2] * (2 if self.paired else 1)

    @property
    def width(self) -> int:  # N
        return self.w2.shape[2] * (2 if self.paired else 1)

    @property
    def lanes(self) -> int:  # L
        return self.w13.shape[3]

    def untiled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """w13 [E, 2N, K] and w2 [E, K, N] again (new tensors)."""
        return _untile(self.w13), _untile(self.w2)


def _tile(w: torch.Tensor, lanes: int) -> torch.Tensor:
    E, rows, k = w.shape
    return contiguous_on_huge_pages(w.view(E, rows // lanes, lanes, k).transpose(2, 3))


def _tile_pairs(w: torch.Tensor) -> torch.Tensor:
    E, rows, k = w.shape
    return contiguous_on_huge_pages(w.view(E, rows // BF16_LANES, BF16_LANES, k // 2, 2).transpose(2, 3))


def _untile(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 5:
        E, panels, pairs, lanes, two = t.shape
        return t.transpose(2, 3).reshape(E, panels * lanes, pairs * two)
    E, panels, k, lanes = t.shape
    return t.transpose(2, 3).reshape(E, panels * lanes, k)


def bf16_tiles_supported() -> bool:
    """Whether bf16 experts run in the kernel here: it builds, is not turned off, and the CPU has
    AVX512-BF16."""
    return (cpu_small_rows.small_rows_enabled()
            and bool(cpu_small_rows.small_rows_library().batchgen_bf16_experts_supported()))


def cpu_has_amx_bf16() -> bool:
    """Whether the CPU has AMX tiles for bf16 (Intel Sapphire Rapids and later)."""
    return "amx_bf16" in cpu_features()


def cpu_multiplies_bf16() -> bool:
    """Whether the CPU multiplies bf16 values in hardware (AVX512-BF16 or AMX): elsewhere a bf16
    GEMM is emulated in fp32 and far slower."""
    return bool(cpu_features() & {"avx512_bf16", "amx_bf16"})


def bf16_tiles_preferred() -> bool:
    """Whether a bf16 model's weights are kept in bf16 tiles here: bf16_tiles_supported(), on a
    CPU without AMX. Where it has AMX, torch's bf16 GEMM (oneDNN) runs on AMX's tiles, whose
    multiply-adds per cycle are many times vdpbf16ps's, so the plain weights and torch's paths
    stay; the tiles were only measured against torch on CPUs without it."""
    return bf16_tiles_supported() and not cpu_has_amx_bf16()


def tiles_supported(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether these experts (w13 [E, 2N, K], w2 [E, K, N]) should be tiled and run by the
    kernel here: fp32 on the CPU, N and K multiples of eight, an expert's weights too large for
    the cache (below cpu_small_rows.IN_CACHE_BYTES sgemm wins at every row count, and the plain
    layout keeps it), the kernel built and not turned off (BATCHGEN_SMALL_ROWS_KERNEL=0 keeps the
    plain layout and its paths); or bf16 on the CPU, N and K multiples of 16, of any size, where
    bf16_tiles_preferred()."""
    if w13.dim() != 3 or w2.dim() != 3:
        return False
    E, K, N = w2.shape
    plain = w13.device.type == w2.device.type == "cpu" and w13.shape == (E, 2 * N, K)
    if w13.dtype == w2.dtype == torch.bfloat16:  # (any size: no sgemm path is faster in bf16)
        return plain and N % BF16_LANES == 0 and K % BF16_LANES == 0 and bf16_tiles_preferred()
    return (w13.dtype == w2.dtype == torch.float32 and plain and N % 8 == 0 and K % 8 == 0
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
    lanes (8 or 16; None: the widest the kernel built here takes that divides N and K); bf16
    ones (N and K multiples of 16) as bf16 tiles of 16 lanes, k in pairs."""
    bf16 = w13.dtype == w2.dtype == torch.bfloat16
    if w13.dim() != 3 or w2.dim() != 3 or not (bf16 or w13.dtype == w2.dtype == torch.float32):
        raise KernelInputError(f"w13 and w2 must be 3-D float32 (or both bfloat16) tensors, got {tuple(w13.shape)} "
                               f"{w13.dtype} and {tuple(w2.shape)} {w2.dtype}")
    E, K, N = w2.shape
    if w13.shape != (E, 2 * N, K):
        raise KernelInputError(f"w13 must be [{E}, {2 * N}, {K}] for w2 {tuple(w2.shape)}, got {tuple(w13.shape)}")
    if bf16:
        if lanes not in (None, BF16_LANES) or N % BF16_LANES or K % BF16_LANES:
            raise KernelInputError(f"bf16 tiles have {BF16_LANES} lanes and need N and K multiples of {BF16_LANES}, "
                                   f"got N = {N}, K = {K}" + (f", lanes = {lanes}" if lanes is not None else ""))
        return ExpertTiles(_tile_pairs(w13), _tile_pairs(w2))
    lanes = tile_lanes(lanes, N=N, K=K)
    return ExpertTiles(_tile(w13, lanes), _tile(w2, lanes))


def moe_tiled_cpu(x: torch.Tensor, tiles: ExpertTiles, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed expert layer: x [T, K] fp32; topk_weights [T, A] fp32; topk_ids [T, A] int64
    (outside [0, E): unrouted) -> [T, K], `fused_moe_reference(x, *tiles.untiled(), ...)`
    within fp32 rounding. On bf16 tiles x is bf16 and so is the result (topk_weights in either
    dtype), within bf16 rounding of the reference in fp32 on the same values."""
    if tiles.paired:
        return _moe_paired(x, tiles, topk_weights, topk_ids)
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
    T, A = _routing_shape(x, topk_weights, topk_ids, K)
    out = torch.empty(T, K, dtype=torch.float32)
    status = lib.batchgen_moe_routed_tiled(torch.get_num_threads(), x.data_ptr(), T, A, topk_ids.data_ptr(),
                                           topk_weights.data_ptr(), tiles.w13.data_ptr(), tiles.w2.data_ptr(), E, K,
                                           N, L, out.data_ptr())
    if status != 0:  # (checked above; a build that disagrees with batchgen_tile_lanes would land here)
        raise KernelInputError(f"the CPU kernel refused tiles of {L} lanes")
    return out


def _moe_paired(x: torch.Tensor, tiles: ExpertTiles, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """moe_tiled_cpu on bf16 tiles."""
    lib = cpu_small_rows.small_rows_library()
    E, K, N = tiles.num_experts, tiles.hidden, tiles.width
    if (tiles.w13.shape != (E, 2 * N // BF16_LANES, K // 2, BF16_LANES, 2)
            or tiles.w2.shape != (E, K // BF16_LANES, N // 2, BF16_LANES, 2)):
        raise KernelInputError(f"bf16 tiles must be [E, 2N / 16, K / 2, 16, 2] and [E, K / 16, N / 2, 16, 2], got "
                               f"{tuple(tiles.w13.shape)} and {tuple(tiles.w2.shape)}")
    for name, t in (("x", x), ("tiles.w13", tiles.w13), ("tiles.w2", tiles.w2)):
        if t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous():
            raise KernelInputError(f"{name} must be a contiguous CPU bfloat16 tensor, got {t.dtype} on {t.device}")
    T, A = _routing_shape(x, topk_weights, topk_ids, K)
    weights = topk_weights.to(device="cpu", dtype=torch.float32).contiguous()
    out = torch.empty(T, K, dtype=torch.float32)
    status = lib.batchgen_moe_routed_bf16(torch.get_num_threads(), x.data_ptr(), T, A, topk_ids.data_ptr(),
                                          weights.data_ptr(), tiles.w13.data_ptr(), tiles.w2.data_ptr(), E, K, N,
                                          out.data_ptr())
    if status != 0:
        raise KernelInputError("the CPU kernel has no bf16 experts here (no AVX512-BF16)")
    return out.to(torch.bfloat16)


def _routing_shape(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, K: int) -> tuple[int, int]:
    """(T, A) of topk_ids, checked with x [T, K] and topk_weights [T, A] (KernelInputError naming them)."""
    if (topk_ids.dim() != 2 or topk_ids.dtype != torch.int64 or topk_ids.device.type != "cpu"
            or not topk_ids.is_contiguous()):
        raise KernelInputError(f"topk_ids must be a contiguous CPU int64 [T, A] tensor, got {tuple(topk_ids.shape)} "
                               f"{topk_ids.dtype} on {topk_ids.device}")
    T, A = topk_ids.shape
    if x.shape != (T, K) or topk_weights.shape != (T, A):
        raise KernelInputError(f"x must be [{T}, {K}] and topk_weights [{T}, {A}], got {tuple(x.shape)} and "
                               f"{tuple(topk_weights.shape)}")
    return T, A
