"""Dense weights stored in tiles for the CPU (csrc/small_rows_cpu.cpp, `batchgen_linear_tiled`).

A weight w [Nout, K] of at least TILE_BYTES is kept as [Nout / L, K, L] (tile[k, lane] =
w[L p + lane, k]), L the lanes of expert_tiles.py's tiles (16 with AVX-512 where Nout and K
allow, else 8). The experts' kernel tile reads it at every row count: an x element broadcast
against L weight rows, the next block's weights prefetched while one computes. It replaces both
paths of a plain weight (the small-row kernel up to 256 rows, sgemm above): measured on Zen 4
(2 threads, 16 weights of 1536 x 1024 read from memory in turn, alternated) 1.26-1.71x the
small-row kernel at 1-8 rows, 1.06-1.12x at 16-256, and 1.18-1.34x torch's sgemm at 512-2048
rows (212-222 GFLOP/s against 166-180).

Every output is one chain of fused multiply-adds over k: a row's result never depends on its
batch, and 8- and 16-lane tiles give the same floats. The reference is F.linear on the untiled
weight; they agree within fp32 rounding.

A bf16 weight, where the CPU has AVX512-BF16, is tiled as the bf16 experts are ([Nout / 16, K / 2,
16, 2], k in pairs) and run by their tile (vdpbf16ps, fp32 sums); the result is rounded to bf16
once, after the bias. torch's bf16 GEMM (oneDNN) reads a weight at 11-14 GB/s at 1-8 rows here
(3 MiB, 2 threads, Zen 4), the memory's rate is over 30.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import cpu_small_rows
from ._cpu_build import cpu_kernels
from .errors import KernelInputError
from .expert_tiles import BF16_LANES, LANE_COUNTS, bf16_tiles_preferred, tile_lanes, widest_lanes
from .huge_pages import contiguous_on_huge_pages


@dataclass(frozen=True, slots=True)
class TiledWeight:
    """A dense weight [Nout, K] in tiles: [Nout / L, K, L], or bf16 ones [Nout / 16, K / 2, 16, 2]."""

    tiles: torch.Tensor

    @property
    def paired(self) -> bool:
        return self.tiles.dim() == 4

    @property
    def out_features(self) -> int:
        return self.tiles.shape[0] * self.tiles.shape[2]

    @property
    def in_features(self) -> int:
        return self.tiles.shape[1] * (2 if self.paired else 1)

    @property
    def lanes(self) -> int:
        return self.tiles.shape[2]

    def untiled(self) -> torch.Tensor:
        """w [Nout, K] again (a new tensor)."""
        return self.tiles.transpose(1, 2).reshape(self.out_features, self.in_features)


# Weights of at least this many bytes are tiled. Through `linear` against the plain path (16
# weights in turn, 2 threads, Zen 4, 1-2048 rows): 480-512 KiB (512 x 256, 480 x 256, 1024 x 128)
# 1.03-2.24x at every row count; 256 KiB 0.94-0.96x at 1 and 2048 rows, 1.04-1.64x between; 16-64
# KiB 0.42-0.71x at 1 and 512-2048 rows, where sgemm's weights sit in L2 and each call's own cost
# counts.
TILE_BYTES = 384 << 10


def weight_rows_from(w: torch.Tensor | TiledWeight, start: int) -> TiledWeight | None:
    """The output rows start.. of a tiled weight [Nout, K] as a weight of their own, a view:
    `linear` with it gives those columns of `linear` with w, the same floats (each output is one
    chain over k). None for a plain weight (a narrower product may take another torch or kernel
    path, whose sums differ in rounding) and where the tiles cannot be cut there (start not a
    multiple of their lanes)."""
    if not isinstance(w, TiledWeight):
        return None
    lanes = BF16_LANES if w.paired else w.lanes
    return TiledWeight(w.tiles[start // lanes:]) if start % lanes == 0 else None


def weight_tiles_supported(w: torch.Tensor) -> bool:
    """Whether this dense weight [Nout, K] should be tiled and run by the kernel here: fp32 on the
    CPU, Nout and K multiples of eight, at least TILE_BYTES, and the kernel built and not turned
    off (BATCHGEN_SMALL_ROWS_KERNEL=0); or bf16 with Nout and K multiples of 16, at least
    TILE_BYTES / 2, where expert_tiles.bf16_tiles_preferred()."""
    if w.dim() != 2 or w.device.type != "cpu":
        return False
    if w.dtype == torch.bfloat16:
        return (w.shape[0] % BF16_LANES == 0 and w.shape[1] % BF16_LANES == 0 and 4 * w.numel() >= TILE_BYTES
                and bf16_tiles_preferred())
    return (w.dtype == torch.float32 and w.shape[0] % 8 == 0 and w.shape[1] % 8 == 0
            and 4 * w.numel() >= TILE_BYTES and cpu_small_rows.small_rows_enabled())


def tile_weight(w: torch.Tensor, lanes: int | None = None) -> TiledWeight:
    """w [Nout, K] (fp32, Nout and K multiples of `lanes`) as tiles of `lanes` lanes (8 or 16;
    None: the widest the kernel built here takes that divides both); a bf16 one (Nout and K
    multiples of 16) as bf16 tiles of 16 lanes, k in pairs."""
    if w.dim() != 2 or w.dtype not in (torch.float32, torch.bfloat16):
        raise KernelInputError(f"w must be a 2-D float32 or bfloat16 tensor, got {tuple(w.shape)} {w.dtype}")
    n_out, k = w.shape
    if w.dtype == torch.bfloat16:
        if lanes not in (None, BF16_LANES) or n_out % BF16_LANES or k % BF16_LANES:
            raise KernelInputError(f"bf16 tiles have {BF16_LANES} lanes and need Nout and K multiples of "
                                   f"{BF16_LANES}, got Nout = {n_out}, K = {k}"
                                   + (f", lanes = {lanes}" if lanes is not None else ""))
        return TiledWeight(contiguous_on_huge_pages(w.reshape(n_out // BF16_LANES, BF16_LANES, k // 2, 2)
                                                    .transpose(1, 2)))
    lanes = tile_lanes(lanes, Nout=n_out, K=k)
    return TiledWeight(contiguous_on_huge_pages(w.reshape(n_out // lanes, lanes, k).transpose(1, 2)))


def linear_tiled_cpu(x: torch.Tensor, w: TiledWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 on the CPU (M >= 0) -> x w^T + bias [M, Nout], F.linear(x, w.untiled(), bias)
    within fp32 rounding; on bf16 tiles x, bias and the result are bf16, within bf16 rounding."""
    if w.paired:
        return _linear_paired(x, w, bias)
    n_out, k, lanes = w.out_features, w.in_features, w.lanes
    if w.tiles.dim() != 3 or lanes not in LANE_COUNTS or lanes > widest_lanes():
        taken = " or ".join(str(n) for n in LANE_COUNTS if n <= widest_lanes())
        raise KernelInputError(f"w must be tiles [Nout / L, K, L] with L {taken} on this CPU, got "
                               f"{tuple(w.tiles.shape)}")
    cpu_small_rows.check_fp32(**{"w.tiles": w.tiles, **({"bias": bias} if bias is not None else {})})
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] != k:
        raise KernelInputError(f"x must be a CPU float32 [M, {k}] tensor, got {tuple(x.shape)} {x.dtype} on {x.device}")
    if bias is not None and bias.shape != (n_out,):
        raise KernelInputError(f"bias must be [{n_out}], got {tuple(bias.shape)}")
    return linear_tiled_unchecked(cpu_small_rows.small_rows_library(), x, w, bias)


def linear_tiled_unchecked(lib: Any, x: torch.Tensor, w: TiledWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel call on checked operands (x [M, K] fp32 on the CPU; w's tiles and bias as
    linear_tiled_cpu checks them)."""
    y = torch.empty(x.shape[0], w.tiles.shape[0] * w.tiles.shape[2], dtype=torch.float32)
    if x.shape[0] == 0:
        return y
    if x.stride(1) != 1:
        x = x.contiguous()
    status = lib.batchgen_linear_tiled(torch.get_num_threads(), x.data_ptr(), x.stride(0), w.tiles.data_ptr(),
                                       None if bias is None else bias.data_ptr(), y.data_ptr(), x.shape[0],
                                       w.tiles.shape[1], y.shape[1], w.tiles.shape[2])
    if status != 0:  # (checked at tiling; a build that disagrees with batchgen_tile_lanes would land here)
        raise KernelInputError(f"the CPU kernel refused tiles of {w.tiles.shape[2]} lanes")
    return y


def linear(x: torch.Tensor, w: torch.Tensor | TiledWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for a plain weight (`cpu_small_rows.linear_rows`: the small-row kernel
    where x has few rows, else sgemm) or a tiled one (the tiled kernel at every row count). Called
    for every projection of every forward, so it checks only what keeps the kernel in bounds
    (the kernel itself refuses lanes it was not built for); anything else goes to
    linear_tiled_cpu, which names the problem."""
    if not isinstance(w, TiledWeight):
        return cpu_small_rows.linear_rows(x, w, bias)
    if w.paired:
        return _linear_paired(x, w, bias)
    lib, t = cpu_kernels("small_rows_cpu"), w.tiles
    if (lib is None or x.dtype is not torch.float32 or x.dim() != 2 or x.shape[1] != t.shape[1]
            or x.device.type != "cpu" or not t.is_contiguous()
            or (bias is not None and (bias.dtype is not torch.float32 or bias.shape != (t.shape[0] * t.shape[2],)
                                      or not bias.is_contiguous()))):
        return linear_tiled_cpu(x, w, bias)  # (it names what is wrong)
    return linear_tiled_unchecked(lib, x, w, bias)


def _linear_paired(x: torch.Tensor, w: TiledWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """linear on bf16 tiles (checked: a projection's few-row call costs little beside torch's)."""
    n_out, k = w.out_features, w.in_features
    t = w.tiles
    if t.shape != (n_out // BF16_LANES, k // 2, BF16_LANES, 2) or t.dtype != torch.bfloat16 or not t.is_contiguous():
        raise KernelInputError(f"w must be contiguous bf16 tiles [Nout / 16, K / 2, 16, 2], got {tuple(t.shape)} "
                               f"{t.dtype}")
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[1] != k:
        raise KernelInputError(f"x must be a CPU bfloat16 [M, {k}] tensor, got {tuple(x.shape)} {x.dtype} on "
                               f"{x.device}")
    if bias is not None and bias.shape != (n_out,):
        raise KernelInputError(f"bias must be [{n_out}], got {tuple(bias.shape)}")
    y = torch.empty(x.shape[0], n_out, dtype=torch.float32)
    if x.shape[0] == 0:
        return y.to(torch.bfloat16)
    if x.stride(1) != 1 or x.stride(0) < k:
        x = x.contiguous()
    fp32_bias = None if bias is None else bias.to(device="cpu", dtype=torch.float32).contiguous()
    status = cpu_small_rows.small_rows_library().batchgen_linear_bf16(
        torch.get_num_threads(), x.data_ptr(), x.stride(0), t.data_ptr(),
        None if fp32_bias is None else fp32_bias.data_ptr(), y.data_ptr(), x.shape[0], k, n_out)
    if status != 0:
        raise KernelInputError("the CPU kernel has no bf16 tiles here (no AVX512-BF16)")
    return y.to(torch.bfloat16)
