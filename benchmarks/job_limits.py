"""What a Mixtral-layout job costs and what the machine allows: the job's matmul FLOPs from its
config, the machine's GEMM peak and memory read rate measured with torch, and the job's roofline
time from the two (bench_vllm.py reports each engine against them).

FLOPs per token: the attention projections, the router, top_k experts and (for generated tokens)
the LM head, 2 FLOPs a multiply-add, plus the attention's score and value products over the
context. The last layer's router and experts count only for the rows that sample (a prompt's last
token and each decode row): nothing reads the other rows' output of that layer, and an engine
need not compute it (batchgen and llama.cpp do not; vLLM does, uncounted). That layer's
projections and attention still count for every row (batchgen skips most of them too).
"""
from __future__ import annotations

import time
from typing import Any

import torch

from batchgen.sim.cost import experts_touched
from batchgen_kernels.expert_tiles import cpu_multiplies_bf16


def head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def dense_params(config: dict[str, Any]) -> int:
    """Weights of one layer a token multiplies by besides its experts: q, k, v, o and the router."""
    h = config["hidden_size"]
    return h * head_dim(config) * 2 * (config["num_attention_heads"] + config["num_key_value_heads"]) \
        + h * config["num_local_experts"]


def token_flops(config: dict[str, Any]) -> tuple[float, float, float]:
    """-> (matmul FLOPs of one token through the layers: attention projections, router, top_k
    experts; of the LM head for one sampled token; of attention per position a token attends to),
    2 FLOPs a multiply-add."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    experts = config["num_experts_per_tok"] * 3 * h * config["intermediate_size"]
    # QK^T and AV: 2 FLOPs each per head dim
    return (2 * layers * (dense_params(config) + experts), 2 * h * config["vocab_size"],
            4 * layers * config["num_attention_heads"] * head_dim(config))


def ffn_layer_flops(config: dict[str, Any]) -> float:
    """Matmul FLOPs of one token through one layer's router and top_k experts."""
    h = config["hidden_size"]
    return 2 * h * (config["num_local_experts"] + config["num_experts_per_tok"] * 3 * config["intermediate_size"])


def flops(config: dict[str, Any], prompts: list[list[int]], lengths: list[int]) -> float:
    """Matmul FLOPs of the whole job (see the module docstring). A row of prompt p and n new tokens
    runs p + n - 1 tokens through the layers (its last token is only sampled) and samples n, so
    p - 1 of them skip the last layer's router and experts."""
    per_token, lm_head, per_position = token_flops(config)
    last_ffn = ffn_layer_flops(config)
    total = 0.0
    for p, n in zip(prompts, lengths):
        tokens = len(p) + n - 1
        # position i attends to i + 1 positions
        total += tokens * per_token - (len(p) - 1) * last_ffn + n * lm_head + per_position * tokens * (tokens + 1) / 2
    return total


def best_seconds(fn: Any, repeats: int) -> float:
    """The shortest of `repeats` timed calls of fn, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gemm_peak(threads: int, dtype: torch.dtype, n: int = 4096, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` n x n x n matmuls with torch on `threads` threads."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b), repeats)


def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of the best of `repeats` reads of a `gib` GiB fp32 tensor (a max over it) with torch
    on `threads` threads: far larger than the caches, so read from memory each time."""
    torch.set_num_threads(threads)
    x = torch.empty(int(gib * (1 << 30)) // 4).normal_()
    return x.numel() * 4 / best_seconds(lambda: torch.amax(x), repeats)


def roofline_seconds(config: dict[str, Any], prompts: list[list[int]], lengths: list[int], flop_rate: float,
                     byte_rate: float, itemsize: int = 4) -> float:
    """The job's time if every step ran at its roofline, all rows batched from the start (as
    batchgen and vLLM run them while they fit one batch): the prompts at their FLOPs over
    flop_rate (the last layer's experts for their last rows only, as `flops`), then one decode
    step per generated position after the first, each taking the larger
    of its FLOPs over flop_rate and the bytes it must read over byte_rate (the attention
    projections, router and LM head, the experts its rows route to, every running row's KV cache
    so far; `itemsize` bytes a value). Experts read: the expected number under uniform routing
    (random routers route about evenly), so this is an estimate, not a bound: a skewed router
    reads fewer."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    kv_width = 2 * config["num_key_value_heads"] * head_dim(config)
    experts, top_k = config["num_local_experts"], config["num_experts_per_tok"]
    per_token, lm_head_flops, per_position = token_flops(config)
    last_ffn = ffn_layer_flops(config)
    expert = 3 * h * config["intermediate_size"]
    shared = layers * dense_params(config) + h * config["vocab_size"]  # what a step reads but experts
    seconds = sum(len(p) * per_token - (len(p) - 1) * last_ffn + lm_head_flops + per_position * len(p) * (len(p) + 1) / 2
                  for p in prompts) / flop_rate
    for step in range(1, max(lengths)):
        running = [i for i, n in enumerate(lengths) if n > step]
        positions = sum(len(prompts[i]) + step for i in running)  # each running row's context
        step_flops = len(running) * (per_token + lm_head_flops) + per_position * positions
        read_experts = float(experts_touched(len(running), experts, top_k))
        step_bytes = itemsize * (shared + layers * read_experts * expert + layers * kv_width * positions)
        seconds += max(step_flops / flop_rate, step_bytes / byte_rate)
    return seconds


def has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX, by its feature flags, which
    is what batchgen's bf16 tiles need too): without it a bf16 GEMM is emulated and a 4096^3 one
    takes minutes, so its "peak" would mean nothing."""
    return cpu_multiplies_bf16()
