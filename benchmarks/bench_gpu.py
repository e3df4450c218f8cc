"""bench_engine's workload on a CUDA GPU, at a size that fills it (run by gpu_check.sh).

A larger demo MoE in bf16 (dtype "auto" picks the checkpoint's bf16 on CUDA), bench_engine's
heavy-tailed lognormal output lengths, enough rows to keep max_num_seqs sequences decoding.
Compared in one process: batchgen with CUDA-graph decode, batchgen eager (enforce_eager), and
transformers `generate` in bf16 on the same GPU in batches (on the first --hf-rows rows only,
to bound its time; tokens/s is the figure compared). Prints tokens/s and ratios.

    python benchmarks/bench_gpu.py [--rows 2048] [--max-num-seqs 512] [--hf-rows 256]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import workload  # noqa: E402

from batchgen import Engine, SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # the checkpoint builders
from demo_builder import build_demo_model  # noqa: E402


def run_engine(model_dir: Path, prompts: list[list[int]], lengths: list[int], **options: object
               ) -> tuple[float, dict[str, float]]:
    engine = Engine(model_dir, device="cuda", **options)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    engine.generate(prompts[:8], params[:8])  # compile Triton kernels outside the timing
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == lengths
    summary = engine.stats_summary()
    summary["dtype"] = str(engine.model.dtype)  # type: ignore[assignment]
    del engine
    torch.cuda.empty_cache()
    return elapsed, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--hf-rows", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_demo_model(Path(tmp) / "demo", hidden_size=args.hidden, num_layers=args.layers,
                                     num_heads=16, num_kv_heads=4, num_experts=16, top_k=2,
                                     intermediate_size=args.hidden, dtype="bfloat16")
        prompts, lengths = workload(args.rows, 1000, 0)
        tokens = sum(lengths)
        opts = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": 8192}
        t_graph, s_graph = run_engine(model_dir, prompts, lengths, **opts)
        t_eager, s_eager = run_engine(model_dir, prompts, lengths, enforce_eager=True, **opts)
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
        hp, hl = prompts[:args.hf_rows], lengths[:args.hf_rows]
        hf_tokens = sum(hl)
        torch.cuda.synchronize()
        start = time.perf_counter()
        _cuda_batches(hf, hp, hl, args.hf_batch)
        torch.cuda.synchronize()
        t_hf = time.perf_counter() - start
    graph_tps, eager_tps, hf_tps = tokens / t_graph, tokens / t_eager, hf_tokens / t_hf
    print(f"{torch.cuda.get_device_name()}: demo MoE hidden {args.hidden} x {args.layers} layers, "
          f"{s_graph['dtype']}; {args.rows} rows, {tokens} tokens, max_num_seqs {args.max_num_seqs}")
    print(f"batchgen, CUDA graphs: {graph_tps:10.0f} tok/s ({s_graph['graph_steps']} of {s_graph['forwards']} "
          f"forwards in graphs, MoE batch mean {s_graph['moe_batch_mean']:.0f})")
    print(f"batchgen, eager:       {eager_tps:10.0f} tok/s   graphs / eager {graph_tps / eager_tps:.2f}x")
    print(f"transformers bf16 (batches of {args.hf_batch}, {args.hf_rows} rows): {hf_tps:10.0f} tok/s   "
          f"batchgen / transformers {graph_tps / hf_tps:.2f}x")
    print(f"BENCH graphs {graph_tps:.0f} tok/s, eager {eager_tps:.0f} tok/s, transformers {hf_tps:.0f} tok/s")


def _cuda_batches(model: torch.nn.Module, prompts: list[list[int]], lengths: list[int], batch: int) -> None:
    """bench_engine's transformers side (input order, fixed batches, left padding, each batch run
    to its longest row) with the tensors on the GPU."""
    pad = 2
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            chunk, lens = prompts[i:i + batch], lengths[i:i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device="cuda")
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device="cuda")
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=False, eos_token_id=[], pad_token_id=pad)


if __name__ == "__main__":
    main()
