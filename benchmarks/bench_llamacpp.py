"""batchgen vs llama.cpp (llama-cpp-python) on the same CPU, threads and workload, in one run.

The workload is bench_engine's: the demo Mixtral-style MoE in fp32, heavy-tailed output lengths,
greedy, ignore_eos (both sides produce exactly the same token counts). llama.cpp runs the
checkpoint converted to GGUF f32 by the converter its source distribution ships, with continuous
batching over --slots sequences as llama-server does it: each `llama_decode` carries one token per
decoding slot plus prompt tokens of newly admitted rows up to --n-batch, and a finished row's slot
takes the next row at once. Reports tokens/s of both and their ratio, and checks batchgen's greedy
tokens against transformers' on the first --check-rows rows. Also runs batchgen with its compiled
CPU kernels off (BATCHGEN_CPU_KERNELS=0: decode attention through gathered length groups, torch
rope) in the same alternation, as the previous path.

    pip install llama-cpp-python            # builds llama.cpp from source (minutes)
    pip download --no-binary :all: --no-deps llama-cpp-python -d sdist && tar xzf sdist/*.tar.gz
    python benchmarks/bench_llamacpp.py --converter llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py

Our test tokenizers are byte-level BPE that the converter's pre-tokenizer table does not know;
it is told the GPT-2 one (which is what they are), see `convert`.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_engine import run_batchgen, workload
from demo_builder import build_demo_model
from tiny_models import reference_generate

# Runs the converter with two patches: our byte-level BPE tokenizers' pre-tokenizer hash is
# unknown to it (they are GPT-2's), and it imports sentencepiece even with no tokenizer.model.
_CONVERT = '''
import runpy, sys
from pathlib import Path
conv = Path(sys.argv[1]); sys.path.insert(0, str(conv.parent)); sys.path.insert(1, str(conv.parent / "gguf-py"))
import conversion.base as base
for c in vars(base).values():
    if isinstance(c, type) and "get_vocab_base_pre" in vars(c):
        c.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
_sp = base.TextModel._set_vocab_sentencepiece
def _sentencepiece_or_missing(self, *args, **kwargs):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return _sp(self, *args, **kwargs)
base.TextModel._set_vocab_sentencepiece = _sentencepiece_or_missing
sys.argv = [str(conv), *sys.argv[2:]]
runpy.run_path(str(conv), run_name="__main__")
'''


def convert(model_dir: Path, converter: Path, out: Path, outtype: str = "f32") -> Path:
    """HF checkpoint -> GGUF (`outtype`: f32, bf16, ...) with llama.cpp's own converter."""
    subprocess.run([sys.executable, "-c", _CONVERT, str(converter), str(model_dir), "--outfile", str(out),
                    "--outtype", outtype], check=True, capture_output=True)
    return out


def run_llamacpp(gguf: Path, prompts: list[list[int]], lengths: list[int], slots: int, threads: int,
                 n_batch: int) -> tuple[float, list[list[int]]]:
    """Greedy continuous batching over `slots` sequences; -> (seconds, generated tokens per row)."""
    import llama_cpp as lc

    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    per_seq = max(len(p) + n for p, n in zip(prompts, lengths))
    cp = lc.llama_context_default_params()
    cp.n_ctx = slots * (-(-per_seq // 256) * 256)
    cp.n_batch = cp.n_ubatch = n_batch
    cp.n_seq_max = slots
    cp.n_threads = cp.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, cp)
    memory = lc.llama_get_memory(ctx)
    batch = lc.llama_batch_init(n_batch, 0, 1)
    outputs: list[list[int]] = [[] for _ in prompts]
    # per slot: [row, tokens of the row in its KV so far]; rows queue in input order
    active: dict[int, list[int]] = {}
    queue = list(range(len(prompts)))[::-1]
    free = list(range(slots))[::-1]
    start = time.perf_counter()
    while queue or active:
        while free and queue:
            active[free.pop()] = [queue.pop(), 0]
        n, sample_at = 0, []  # (batch index, slot)
        for slot, state in active.items():  # decoding slots first: their last token each
            row, fed = state
            if fed >= len(prompts[row]):
                batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.seq_id[n][0] = outputs[row][-1], fed, 1, slot
                batch.logits[n] = True
                sample_at.append((n, slot))
                n, state[1] = n + 1, fed + 1
        for slot, state in active.items():  # then prompt tokens of admitted rows, up to n_batch
            row, fed = state
            prompt = prompts[row]
            for pos in range(fed, min(len(prompt), fed + n_batch - n)):
                batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.seq_id[n][0] = prompt[pos], pos, 1, slot
                batch.logits[n] = pos == len(prompt) - 1
                if batch.logits[n]:
                    sample_at.append((n, slot))
                n, state[1] = n + 1, pos + 1
        batch.n_tokens = n
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        for index, slot in sample_at:
            row = active[slot][0]
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, index), shape=(vocab,))
            outputs[row].append(int(logits.argmax()))
            if len(outputs[row]) == lengths[row]:
                del active[slot]
                lc.llama_memory_seq_rm(memory, slot, -1, -1)
                free.append(slot)
    elapsed = time.perf_counter() - start
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return elapsed, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--converter", type=Path, help="llama.cpp's convert_hf_to_gguf.py (from the sdist)")
    ap.add_argument("--gguf", type=Path, help="an already converted GGUF of the demo model (skips --converter)")
    ap.add_argument("--rows", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="threads for both sides")
    ap.add_argument("--slots", type=int, default=16, help="llama.cpp parallel sequences")
    ap.add_argument("--n-batch", type=int, default=512, help="llama.cpp tokens per decode")
    ap.add_argument("--repeats", type=int, default=2, help="alternated runs per side; best of them is reported")
    ap.add_argument("--check-rows", type=int, default=8, help="rows whose batchgen tokens must equal transformers'")
    args = ap.parse_args()
    if args.gguf is None and args.converter is None:
        ap.error("give --converter (convert_hf_to_gguf.py from the llama-cpp-python sdist) or --gguf")
    torch.manual_seed(args.seed)
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_demo_model(Path(tmp) / "demo", dtype="float32")
        gguf = args.gguf or convert(model_dir, args.converter, Path(tmp) / "demo-f32.gguf")
        prompts, lengths = workload(args.rows, 1000, args.seed)
        tokens = sum(lengths)
        t_lc, t_bg, t_off = float("inf"), float("inf"), float("inf")
        for _ in range(args.repeats):
            elapsed, out_lc = run_llamacpp(gguf, prompts, lengths, args.slots, args.threads, args.n_batch)
            t_lc = min(t_lc, elapsed)
            elapsed, _, out_bg = run_batchgen(model_dir, prompts, lengths)
            t_bg = min(t_bg, elapsed)
            os.environ["BATCHGEN_CPU_KERNELS"] = "0"
            try:
                elapsed, _, out_off = run_batchgen(model_dir, prompts, lengths)
            finally:
                del os.environ["BATCHGEN_CPU_KERNELS"]
            t_off = min(t_off, elapsed)
        k = min(args.check_rows, args.rows)
        hf = [reference_generate(model_dir, p, n, ignore_eos=True) for p, n in zip(prompts[:k], lengths[:k])]
    assert [len(o) for o in out_lc] == lengths
    same_hf = sum(a == b for a, b in zip(out_bg[:k], hf))
    agree = sum(a == b for a, b in zip(out_bg, out_lc))
    print(f"threads: {args.threads}; workload: {args.rows} rows, {tokens} output tokens, lengths median "
          f"{sorted(lengths)[len(lengths) // 2]} max {max(lengths)}; best of {args.repeats}")
    print(f"llama.cpp (GGUF f32, {args.slots} slots, n_batch {args.n_batch}): {tokens / t_lc:8.1f} tok/s")
    print(f"batchgen:                                      {tokens / t_bg:8.1f} tok/s   ratio {t_lc / t_bg:.2f}x")
    print(f"batchgen, CPU kernels off (previous path):     {tokens / t_off:8.1f} tok/s   ratio {t_lc / t_off:.2f}x"
          f"   kernels on / off {t_off / t_bg:.2f}x, tokens equal on {sum(a == b for a, b in zip(out_bg, out_off))}"
          f"/{args.rows} rows")
    print(f"batchgen greedy tokens equal to transformers on {same_hf}/{k} rows; "
          f"rows where llama.cpp's tokens equal batchgen's: {agree}/{args.rows}")
    if same_hf != k:
        raise SystemExit("batchgen's greedy tokens differ from transformers'")


if __name__ == "__main__":
    main()
