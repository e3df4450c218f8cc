"""The small-row expert kernel (kernels/cpu_small_rows.py) against torch._grouped_mm (sgemm), per
rows per expert: where the CPU MoE path should switch (cpu_small_rows.small_rows_limit).

One expert layer (gate/up GEMM, silu * up, down GEMM) over E experts with the same number of rows
each, fp32, timed alternately for about a second each; GB/s counts the experts' weights once.

    python benchmarks/bench_small_experts.py --threads 2 --hidden 1024 --width 1024 --rows 1,2,4,8,16,24,32,48
"""
from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from batchgen_kernels.cpu_small_rows import cpu_small_rows_available, moe_small_rows_cpu


def grouped_gemms(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    N = w2.shape[2]
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)
    return torch._grouped_mm(F.silu(gate_up[:, :N]) * gate_up[:, N:], w2.transpose(1, 2), offs=offs)


def small_rows_kernel(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
                      take: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    moe_small_rows_cpu(rows, w13, w2, counts, take, out)
    return out


def per_call_s(fn: Callable[[], object], seconds: float) -> float:
    fn()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--rows", default="1,2,4,8,16,24,32,48", help="rows per expert, comma-separated")
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    if not cpu_small_rows_available():
        raise SystemExit("the CPU expert kernel does not build here")
    torch.set_num_threads(args.threads)
    E, K, N = args.experts, args.hidden, args.width
    w13, w2 = torch.randn(E, 2 * N, K) / K ** 0.5, torch.randn(E, K, N) / N ** 0.5
    gb = (w13.numel() + w2.numel()) * 4 / 1e9
    print(f"{E} experts, hidden {K}, width {N}, {args.threads} threads; weights {gb * 1e3:.0f} MB")
    for m in (int(v) for v in args.rows.split(",")):
        rows, counts = torch.randn(E * m, K), torch.full((E,), m)
        offs, take, out = counts.cumsum(0).to(torch.int32), torch.ones(E, dtype=torch.bool), torch.empty(E * m, K)

        sgemm = functools.partial(grouped_gemms, rows, w13, w2, offs)
        kernel = functools.partial(small_rows_kernel, rows, w13, w2, counts, take, out)
        want = sgemm()
        err = float((kernel() - want).abs().max() / want.abs().max())
        t_sgemm, t_kernel = per_call_s(sgemm, args.seconds), per_call_s(kernel, args.seconds)
        print(f"rows {m:3d}: sgemm {t_sgemm * 1e3:7.2f} ms ({gb / t_sgemm:5.1f} GB/s), kernel {t_kernel * 1e3:7.2f} ms "
              f"({gb / t_kernel:5.1f} GB/s), {t_sgemm / t_kernel:.2f}x; largest gap {err:.1e} of the largest entry")


if __name__ == "__main__":
    main()
