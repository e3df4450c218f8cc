"""Engine vs transformers `generate` on one model and one heavy-tailed workload.

Output lengths are lognormal (a few rows ~10x the median) and ignore_eos holds both sides to the
same token counts. The transformers side does what users do: rows in input order, fixed batches,
left padding, `max_new_tokens` = the longest row of the batch, each row then cut to its length.
Reports tokens/s of useful tokens for both and their ratio (same process, same machine).
Denormal floats are flushed to zero for both sides: the random weights make transformers' MoE
path produce denormals that slow an x86 CPU 10-60x, which would flatter us. Flushing is a
per-thread CPU flag that torch sets only on the calling thread, so both sides run on one
intra-op thread by default (--threads) to keep the comparison free of that artefact.

    python benchmarks/bench_engine.py [--rows 192] [--batch 16] [--attention-kv-tokens 512]
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from batchgen import Engine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # the checkpoint builders
from demo_builder import build_demo_model  # noqa: E402


def workload(rows: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(8, 96))] for _ in range(rows)]
    lengths = [max(2, min(400, int(rng.lognormvariate(3.3, 0.9)))) for _ in range(rows)]  # median ~27
    return prompts, lengths


def run_transformers(model_dir: Path, prompts: list[list[int]], lengths: list[int], batch: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return generate_in_batches(model, prompts, lengths, batch)


def generate_in_batches(model: torch.nn.Module, prompts: list[list[int]], lengths: list[int], batch: int) -> float:
    """transformers `generate` as users write it: input order, fixed batches, left padding,
    every row of a batch run to the batch's longest length; -> seconds."""
    pad = 2
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            chunk, lens = prompts[i:i + batch], lengths[i:i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=False, eos_token_id=[], pad_token_id=pad)
    return time.perf_counter() - start


def run_batchgen(model_dir: Path, prompts: list[list[int]], lengths: list[int], **options: object
                 ) -> tuple[float, dict[str, float], list[list[int]]]:
    """-> (seconds, stats_summary, generated tokens per row); options go to Engine (dtype float32
    unless given)."""
    engine = Engine(model_dir, **({"dtype": "float32"} | options))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    engine.close()
    assert [len(o.token_ids) for o in outs] == lengths
    return elapsed, engine.stats_summary(), [o.token_ids for o in outs]


def sweep_eviction(model_dir: Path, prompts: list[list[int]], lengths: list[int], kv_tokens: int) -> None:
    times: dict[str, float] = {}
    for policy in ("newest", "fewest_computed", "most_remaining"):
        elapsed, stats, _ = run_batchgen(model_dir, prompts, lengths, num_kv_blocks=kv_tokens // 16,
                                      eviction=policy, swap_space_bytes=0)
        times[policy] = elapsed
        print(f"eviction {policy:16} completion {elapsed / times['newest']:.2f}x of 'newest', "
              f"{stats['preemptions']} preemptions")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=192)
    ap.add_argument("--batch", type=int, default=16, help="transformers batch size")
    ap.add_argument("--attention-kv-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both sides")
    ap.add_argument("--eviction-sweep", type=int, metavar="KV_TOKENS", default=0,
                    help="instead: batch completion time of each eviction policy with a KV pool of this "
                         "many tokens (recompute only), relative to 'newest'")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_demo_model(Path(tmp) / "demo", dtype="float32")
        prompts, lengths = workload(args.rows, 1000, args.seed)
        if args.eviction_sweep:
            sweep_eviction(model_dir, prompts, lengths, args.eviction_sweep)
            return
        tokens = sum(lengths)
        t_hf = run_transformers(model_dir, prompts, lengths, args.batch)
        t_bg, stats, _ = run_batchgen(model_dir, prompts, lengths)
        t_mb, stats_mb, _ = run_batchgen(model_dir, prompts, lengths, attention_kv_tokens=args.attention_kv_tokens)
    print(f"threads: {args.threads}; workload: {args.rows} rows, {tokens} output tokens, lengths median "
          f"{sorted(lengths)[len(lengths) // 2]} max {max(lengths)}")
    print(f"transformers generate (batch {args.batch}, left padding): {tokens / t_hf:8.1f} tok/s")
    print(f"batchgen (one attention batch):                {tokens / t_bg:8.1f} tok/s   ratio {t_hf / t_bg:.2f}x")
    print(f"batchgen (attention micro-batches <= {args.attention_kv_tokens} KV tokens): {tokens / t_mb:8.1f} tok/s"
          f"   ratio {t_hf / t_mb:.2f}x")
    print(f"  attention batch mean {stats_mb['attention_batch_mean']:.1f} tokens, MoE batch mean "
          f"{stats_mb['moe_batch_mean']:.1f} tokens, tokens per expert call mean "
          f"{stats_mb['tokens_per_expert_call_mean']:.1f} (p50 {stats_mb['tokens_per_expert_call_p50']:.0f})")


if __name__ == "__main__":
    main()
