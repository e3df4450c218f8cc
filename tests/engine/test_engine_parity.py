"""Greedy tokens identical to transformers (fp32, each prompt alone) for every architecture,
with prompts of lengths 1..200 run together in one batchgen engine."""
from __future__ import annotations

import pytest
import tiny_models

from batchgen import Engine, SamplingParams

ARCHS = sorted(tiny_models.ARCHS)
MAX_TOKENS = 10


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch: str, checkpoint_factory, prompt_ids) -> None:
    model_dir = checkpoint_factory(arch)
    engine = Engine(model_dir, dtype="float32", block_size=8)
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for prompt, out in zip(prompt_ids, outs):
        expected = tiny_models.reference_generate(model_dir, prompt, MAX_TOKENS)
        assert out.error is None
        assert out.token_ids == expected, f"{arch}: prompt of {len(prompt)} tokens"
        assert out.finish_reason == ("length" if len(expected) == MAX_TOKENS and
                                     expected[-1] not in engine.eos_token_ids else "stop")


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_legacy_rope_keys_load_the_same(arch: str, checkpoint_factory, prompt_ids) -> None:
    """Snapshots written by transformers 4.x spell rope as rope_theta + rope_scaling."""
    new = Engine(checkpoint_factory(arch), block_size=8)
    old = Engine(checkpoint_factory(arch, legacy_rope_keys=True), block_size=8)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in new.generate(prompt_ids, params)] == \
        [o.token_ids for o in old.generate(prompt_ids, params)]


def test_ignore_eos_runs_to_max_tokens(checkpoint_factory, prompt_ids) -> None:
    model_dir = checkpoint_factory("qwen3_moe")
    engine = Engine(model_dir, block_size=8)
    outs = engine.generate(prompt_ids[:3], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompt_ids, outs):
        assert out.token_ids == tiny_models.reference_generate(model_dir, prompt, 24, ignore_eos=True)
        assert out.finish_reason == "length" and len(out.token_ids) == 24
