"""An ETL-shaped job: one long shared instruction, a short row-specific part, a short answer.

Part 1 (issue 11): 2,000 rows, a 400-token shared instruction, 10-60 tokens of row text, 8-32
output tokens (ignore_eos, so both sides generate the same tokens), the demo MoE of
bench_engine.py, rows streamed through `run_requests` (1024 in flight). Throughput with prefix
caching on vs off, and the hit rate; the two sides' tokens are checked equal.

Part 2 (--ordering): admission order under a KV pool too small to keep every instruction: K
distinct instructions interleaved row by row (row i uses instruction i % K), prefix caching
on for both sides, `admission_order="prefix"` (rows grouped by shared prefix) vs "fifo".

Sides alternate and each reports its best of --repeats runs. Both wall time and process CPU time
are reported: on a machine shared with other work (one torch thread per side) wall time mostly
measures the neighbours, CPU time the work this process did.

    python benchmarks/bench_etl.py [--rows 2000] [--repeats 2]
    python benchmarks/bench_etl.py --ordering [--instructions 48 --kv-blocks 512 --rows 600]
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


def workload(rows: int, instructions: int, instruction_tokens: int, vocab: int, seed: int
             ) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(5, vocab) for _ in range(instruction_tokens)] for _ in range(instructions)]
    prompts = [heads[i % instructions] + [rng.randrange(5, vocab) for _ in range(rng.randint(10, 60))]
               for i in range(rows)]
    return prompts, [rng.randint(8, 32) for _ in range(rows)]


def run(model_dir: Path, prompts: list[list[int]], lengths: list[int], **options: object
        ) -> tuple[tuple[float, float], dict[str, float], list[list[int]]]:
    """-> ((wall s, CPU s), stats_summary, tokens per row in input order)."""
    engine = Engine(model_dir, dtype="float32", **options)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    start, cpu = time.perf_counter(), time.process_time()
    outs = dict(engine.run_requests(zip(prompts, params), max_in_flight=1024))
    elapsed = time.perf_counter() - start, time.process_time() - cpu
    engine.close()
    tokens = [outs[i].token_ids for i in range(len(prompts))]
    assert [len(t) for t in tokens] == lengths
    return elapsed, engine.stats_summary(), tokens


def compare(model_dir: Path, prompts: list[list[int]], lengths: list[int], sides: dict[str, dict[str, object]],
            repeats: int) -> dict[str, tuple[tuple[float, float], dict[str, float]]]:
    best: dict[str, tuple[tuple[float, float], dict[str, float]]] = {}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(repeats):
        for name, options in (sides.items() if r % 2 == 0 else reversed(sides.items())):
            elapsed, stats, toks = run(model_dir, prompts, lengths, **options)
            print(f"  run {r + 1} {name:10} wall {elapsed[0]:7.1f} s  CPU {elapsed[1]:7.1f} s  hit rate "
                  f"{stats.get('prefix_cache_hit_rate', 0):.3f}", flush=True)
            tokens[name] = toks
            if name not in best:
                best[name] = (elapsed, stats)
            else:  # best wall and best CPU time, each over the repeats
                old = best[name][0]
                best[name] = ((min(old[0], elapsed[0]), min(old[1], elapsed[1])), stats)
    first = next(iter(tokens.values()))
    assert all(t == first for t in tokens.values()), "greedy tokens differ between sides"
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=None, help="default 2000 (part 1), 600 (--ordering)")
    ap.add_argument("--instruction-tokens", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ordering", action="store_true", help="part 2: admission order under a tight pool")
    ap.add_argument("--instructions", type=int, default=48, help="--ordering: distinct instructions")
    ap.add_argument("--kv-blocks", type=int, default=512, help="--ordering: KV pool in blocks of 16 tokens")
    args = ap.parse_args()
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    rows = args.rows or (600 if args.ordering else 2000)
    instructions = args.instructions if args.ordering else 1
    prompts, lengths = workload(rows, instructions, args.instruction_tokens, 1000, args.seed)
    tokens = sum(lengths)
    print(f"threads {args.threads}; {rows} rows, {instructions} instruction(s) of {args.instruction_tokens} "
          f"tokens, prompts {sum(map(len, prompts))} tokens, {tokens} output tokens", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_demo_model(Path(tmp) / "demo", dtype="float32")
        if args.ordering:
            pool = dict(num_kv_blocks=args.kv_blocks, swap_space_bytes=0)
            best = compare(model_dir, prompts, lengths, {"prefix": dict(admission_order="prefix", **pool),
                                                         "fifo": dict(admission_order="fifo", **pool)}, args.repeats)
            base, other = "fifo", "prefix"
        else:
            best = compare(model_dir, prompts, lengths, {"cache-on": {}, "cache-off": dict(enable_prefix_caching=False)},
                           args.repeats)
            base, other = "cache-off", "cache-on"
    for name, ((elapsed, cpu), stats) in best.items():
        print(f"{name:10} {tokens / elapsed:8.1f} output tok/s  {rows / elapsed:6.1f} rows/s (wall)  "
              f"{rows / cpu:6.1f} rows per CPU s  hit rate "
              f"{stats.get('prefix_cache_hit_rate', 0.0):.3f}  preemptions {stats['preemptions']}  "
              f"deferred {stats.get('prefix_cache_deferred', 0)}  evicted blocks {stats.get('prefix_cache_evicted_blocks', 0)}")
    print(f"throughput {other} / {base}: {best[base][0][0] / best[other][0][0]:.2f}x wall, "
          f"{best[base][0][1] / best[other][0][1]:.2f}x CPU time")


if __name__ == "__main__":
    main()
