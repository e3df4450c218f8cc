"""The CPU paged attention kernel (batchgen_kernels.cpu_paged_attention) on decode shapes, and on
prompts sent to it a row per token against one SDPA call per prompt (attention.paged_prefill_context).

Decode: S sequences of up to `ctx` tokens, their blocks shuffled through the cache; "memory" puts
them among 8192 blocks (the reads reach DRAM), "cache" packs them into just the blocks they use.
GB/s counts each sequence's K and V rows once. The output's hash tells whether two builds give
the same floats. Prefill: 1024 prompt tokens as prompts of n tokens each, every token attending
its causal context; the ratio is SDPA's time over the kernel's.

    python benchmarks/bench_paged_attention.py --threads 2 [--repeats 3]
"""
from __future__ import annotations

import argparse
import hashlib

import torch
import torch.nn.functional as F
from bench_small_experts import per_call_s  # (benchmarks/ is on the path: scripts run from there)

from batchgen_kernels import cpu_paged_attention_available, paged_attention_gqa_cpu

DECODE = ((8, 4, 32, 100, 150), (16, 4, 64, 100, 150), (16, 4, 64, 16, 1000), (32, 8, 128, 16, 2000))
PREFILL = ((8, 4, 32), (16, 4, 64), (32, 8, 128))
BLOCK = 16
SECONDS = 0.3  # per timing


def decode_case(hq: int, hk: int, d: int, seqs: int, ctx: int, spread: bool, repeats: int) -> str:
    g = torch.Generator().manual_seed(0)
    blocks = -(-ctx // BLOCK)
    num_blocks = 8192 if spread else seqs * blocks
    cache = torch.randn(num_blocks * BLOCK, 2 * hk * d, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[:seqs * blocks].view(seqs, blocks).to(torch.int32)
    lens = torch.randint(ctx // 2, ctx + 1, (seqs,), generator=g, dtype=torch.int32)
    q = torch.randn(seqs, hq, d, generator=g)

    def call() -> torch.Tensor:
        return paged_attention_gqa_cpu(q, cache, tables, lens, BLOCK, hk, d ** -0.5, None)

    seconds = min(per_call_s(call, SECONDS) for _ in range(repeats))
    gb = int(lens.sum()) * 2 * hk * d * 4 / 1e9
    digest = hashlib.md5(call().numpy().tobytes()).hexdigest()[:8]
    where = "memory" if spread else "cache"
    return (f"decode {hq}/{hk} heads x {d}, {seqs} seqs, ctx <= {ctx:4d}, {where:6s}: {seconds * 1e3:7.3f} ms "
            f"{gb / seconds:5.1f} GB/s  output {digest}")


def prefill_case(hq: int, hk: int, d: int, n: int, repeats: int) -> str:
    g = torch.Generator().manual_seed(n)
    prompts = max(1, 1024 // n)
    blocks = -(-n // BLOCK)
    cache = torch.randn(prompts * blocks * BLOCK, 2 * hk * d, generator=g)
    q = torch.randn(prompts * n, hq, d, generator=g)
    tables = torch.arange(prompts * blocks, dtype=torch.int32).view(prompts, blocks).repeat_interleave(n, 0)
    lens = torch.arange(1, n + 1, dtype=torch.int32).repeat(prompts)
    kv = cache.view(prompts, blocks * BLOCK, 2, hk, d)[:, :n]

    def kernel() -> torch.Tensor:
        return paged_attention_gqa_cpu(q, cache, tables, lens, BLOCK, hk, d ** -0.5, None)

    def sdpa() -> torch.Tensor:
        return torch.cat([F.scaled_dot_product_attention(
            q[p * n:(p + 1) * n].transpose(0, 1)[None], kv[p, :, 0].transpose(0, 1)[None],
            kv[p, :, 1].transpose(0, 1)[None], is_causal=True, scale=d ** -0.5, enable_gqa=True)[0].transpose(0, 1)
            for p in range(prompts)])

    gap = (kernel() - sdpa()).abs().max().item()
    tk = min(per_call_s(kernel, SECONDS) for _ in range(repeats))
    ts = min(per_call_s(sdpa, SECONDS) for _ in range(repeats))
    return (f"prefill {hq}/{hk} heads x {d}, {prompts:3d} prompts of {n:4d}: kernel {tk * 1e3:7.3f} ms, "
            f"SDPA {ts * 1e3:7.3f} ms, {ts / tk:5.2f}x; largest gap {gap:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=3, help="timings per case; the best is kept")
    ap.add_argument("--prompt-lengths", default="16,32,64,128,256,512")
    args = ap.parse_args()
    if not cpu_paged_attention_available():
        raise SystemExit("the CPU paged attention kernel does not build here")
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, blocks of {BLOCK} tokens, fp32")
    for case in DECODE:
        for spread in (True, False):
            print(decode_case(*case, spread=spread, repeats=args.repeats))
    for heads in PREFILL:
        for n in (int(v) for v in args.prompt_lengths.split(",")):
            print(prefill_case(*heads, n=n, repeats=args.repeats))


if __name__ == "__main__":
    main()
