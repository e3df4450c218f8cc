"""job_limits (bench_vllm's counts): the job's FLOPs and its roofline time agree with each other
and with counts made by hand on a tiny shape."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
job_limits = importlib.import_module("job_limits")

# hidden 4, 2 layers, 2 heads of 2 (1 kv head), 4 experts top-2 of width 3, vocab 5
CONFIG = dict(hidden_size=4, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              num_local_experts=4, num_experts_per_tok=2, intermediate_size=3, vocab_size=5)


def test_token_flops_by_hand() -> None:
    per_token, lm_head, per_position = job_limits.token_flops(CONFIG)
    proj = 4 * 4 * 2 + 4 * 2 * 2  # q and o 4x4; k and v 4x2
    assert per_token == 2 * 2 * (proj + 2 * 3 * 4 * 3 + 4 * 4)
    assert lm_head == 2 * 4 * 5
    assert per_position == 4 * 2 * 2 * 2


def test_job_flops_run_the_last_token_only_through_sampling() -> None:
    per_token, lm_head, per_position = job_limits.token_flops(CONFIG)
    last_ffn = 2 * (2 * 3 * 4 * 3 + 4 * 4)  # one token through one layer's experts and router
    assert job_limits.ffn_layer_flops(CONFIG) == last_ffn
    # prompt of 3, 2 new tokens: positions 0-3 run through the layers (attending 1-4 positions);
    # the prompt's first two skip the last layer's experts (only sampling rows need them)
    assert job_limits.flops(CONFIG, [[7, 8, 9]], [2]) == 4 * per_token - 2 * last_ffn + 2 * lm_head + per_position * 10


def test_roofline_without_a_memory_limit_is_the_flops_at_the_rate() -> None:
    prompts, lengths = [[1, 2, 3], [4] * 7, [5, 6]], [5, 1, 9]
    job = job_limits.flops(CONFIG, prompts, lengths)
    assert job_limits.roofline_seconds(CONFIG, prompts, lengths, 1e9, float("inf")) == pytest.approx(job / 1e9)


def test_roofline_of_one_row_bound_by_memory_by_hand() -> None:
    # one row, prompt 2, 3 new tokens, an unbounded FLOP rate: its two decode steps each read the
    # weights but the experts (q, k, v, o, router per layer; LM head), top_k experts a layer (one
    # row routes to exactly k), and its KV so far (3, then 4 positions, each K and V of one kv
    # head of 2 a layer)
    shared = 2 * (4 * 4 * 2 + 4 * 2 * 2 + 4 * 4) + 4 * 5
    experts = 2 * 2 * 3 * 4 * 3
    kv = [2 * 4 * 3, 2 * 4 * 4]
    want = sum(4 * (shared + experts + k) for k in kv) / 100.0
    got = job_limits.roofline_seconds(CONFIG, [[1, 2]], [3], float("inf"), 100.0)
    assert got == pytest.approx(want)


def test_roofline_reads_more_experts_with_more_rows_up_to_all() -> None:
    one = job_limits.roofline_seconds(CONFIG, [[1]], [2], float("inf"), 1.0)
    many = job_limits.roofline_seconds(CONFIG, [[1]] * 200, [2] * 200, float("inf"), 1.0)
    kv = 4 * 2 * 4 * 2  # fp32, 2 layers, K and V of 2 floats, 2 positions
    shared = 4 * (2 * (4 * 4 * 2 + 4 * 2 * 2 + 4 * 4) + 4 * 5)
    assert one == pytest.approx(shared + 4 * 2 * 2 * 36 + kv)  # top_k experts a layer
    assert many == pytest.approx(shared + 4 * 2 * 4 * 36 + 200 * kv, rel=1e-6)  # all 4 experts


def test_a_memory_bound_roofline_scales_with_the_bytes_a_value() -> None:
    fp32 = job_limits.roofline_seconds(CONFIG, [[1]] * 3, [4] * 3, float("inf"), 1.0)
    assert job_limits.roofline_seconds(CONFIG, [[1]] * 3, [4] * 3, float("inf"), 1.0, itemsize=2) == fp32 / 2
