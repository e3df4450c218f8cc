"""CPU decode attention and rope per layer: the compiled kernels against the torch paths they
replace, in one process, on the demo MoE's attention shape (8 query heads, 2 kv heads, head dim
32, blocks of 16) unless told otherwise.

  decode: `paged_attention` on a batch built for length groups (blocks gathered into a padded
          copy per group, then SDPA) vs the same batch built for the paged kernel (the cache
          read in place through the block tables). Contexts uniform in [--min-context, --max-context],
          blocks shuffled over the pool.
  rope:   RotaryEmbedding.apply on q and k + cat(k, v) + index_copy_ vs rope_kv_write_cpu.

Times are process CPU time (one torch thread by default), best of --repeats, so other jobs on a
shared machine inflate them less than wall time would.

    python benchmarks/bench_cpu_attention.py [--seqs 4 16 128] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from batchgen.models.attention import AttentionBatch, paged_attention
from batchgen.models.cuda_decode import gqa_decode
from batchgen.models.rope import RotaryEmbedding
from batchgen.models.spec import RopeSpec
from batchgen_kernels import cpu_paged_attention_available, rope_kv_write_cpu


def best_of(fn: Callable[[], object], repeats: int, inner: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(inner):
            fn()
        best = min(best, (time.process_time() - start) / inner)
    return best


def decode_case(seqs: int, hq: int, hk: int, d: int, bs: int, lo: int, hi: int, repeats: int) -> tuple[float, float]:
    g = torch.Generator().manual_seed(seqs)
    lens = torch.randint(lo, hi + 1, (seqs,), generator=g).tolist()
    per_seq = -(-hi // bs)
    pool = torch.randperm(seqs * per_seq + 1, generator=g).tolist()
    items = [(n - 1, 1, pool[i * per_seq:(i + 1) * per_seq]) for i, n in enumerate(lens)]
    cache = torch.randn(len(pool) * bs, 2 * hk * d, generator=g)
    q = torch.randn(seqs, hq, d, generator=g)

    def expand(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = rows.split(hk * d, dim=-1)
        return k.unflatten(-1, (hk, d)), v.unflatten(-1, (hk, d))

    cpu = torch.device("cpu")
    grouped = AttentionBatch.build(items, bs, cpu)  # no dtype given: length groups
    paged = AttentionBatch.build(items, bs, cpu, torch.float32)
    assert paged.decode_tables is not None

    def kernel(qr: torch.Tensor, kv: torch.Tensor, t: object) -> torch.Tensor:
        return gqa_decode(qr, kv, t, hk, d ** -0.5, None)  # type: ignore[arg-type]

    def old() -> torch.Tensor:
        return paged_attention(q, grouped, cache, expand, d ** -0.5, None, d)

    def new() -> torch.Tensor:
        return paged_attention(q, paged, cache, expand, d ** -0.5, None, d, paged=kernel)

    torch.testing.assert_close(new(), old(), atol=1e-5, rtol=1e-5)
    t_old, t_new = float("inf"), float("inf")
    for _ in range(2):  # alternated
        t_old, t_new = min(t_old, best_of(old, repeats)), min(t_new, best_of(new, repeats))
    return t_old, t_new


def rope_case(tokens: int, hq: int, hk: int, d: int, repeats: int) -> tuple[float, float]:
    rotary = RotaryEmbedding(RopeSpec(theta=1e6, dim=d), 4096, torch.device("cpu"))
    positions = torch.randint(0, 4096, (tokens,))
    tables = rotary.tables(positions)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d)
    slots = torch.randperm(4 * tokens)[:tokens]
    cache = torch.zeros(4 * tokens, 2 * hk * d)

    def old() -> None:
        qk = rotary.apply(qkv[:, :(hq + hk) * d].view(tokens, hq + hk, d), positions, tables)
        kv = torch.cat([qk[:, hq:].reshape(tokens, -1), qkv[:, (hq + hk) * d:]], dim=-1)
        cache.index_copy_(0, slots, kv)

    def new() -> None:
        rope_kv_write_cpu(qkv, tables[0].squeeze(1), tables[1].squeeze(1), slots, cache, hq, hk, d)

    t_old, t_new = float("inf"), float("inf")
    for _ in range(2):
        t_old, t_new = min(t_old, best_of(old, repeats, 20)), min(t_new, best_of(new, repeats, 20))
    return t_old, t_new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[4, 16, 64, 128])
    ap.add_argument("--min-context", type=int, default=100)
    ap.add_argument("--max-context", type=int, default=300)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if not cpu_paged_attention_available():
        raise SystemExit("the CPU kernels did not build here; nothing to compare")
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}; Hq {args.heads}, Hk {args.kv_heads}, D {args.head_dim}, block {args.block_size}; "
          f"load {os.getloadavg()[0]:.1f}")
    for s in args.seqs:
        t_old, t_new = decode_case(s, args.heads, args.kv_heads, args.head_dim, args.block_size, args.min_context,
                                   args.max_context, args.repeats)
        print(f"decode, {s:4d} seqs, contexts {args.min_context}-{args.max_context}: gathered groups "
              f"{t_old * 1e3:7.3f} ms, kernel in place {t_new * 1e3:7.3f} ms, {t_old / t_new:.2f}x")
    for t in (1, 16, 128):
        t_old, t_new = rope_case(t, args.heads, args.kv_heads, args.head_dim, args.repeats)
        print(f"rope + KV write, {t:4d} tokens: torch {t_old * 1e6:7.1f} us, fused {t_new * 1e6:7.1f} us, "
              f"{t_old / t_new:.2f}x")


if __name__ == "__main__":
    main()
