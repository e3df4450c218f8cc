"""profile_cost: measured costs, profiled at the batch the engine reaches."""
from __future__ import annotations

from pathlib import Path

from batchgen.config import EngineConfig
from batchgen.engine import Engine
from batchgen.moa.costs import profile_cost, reachable_batch
from batchgen.runtime.kv_cache import blocks_for
from batchgen.sampling_params import SamplingParams

PROMPT, TOKENS = 8, 16
PER_ROW = blocks_for(PROMPT + TOKENS, EngineConfig().block_size)  # KV blocks a row holds at its end


def test_reachable_batch_is_the_seats_or_what_the_kv_cache_holds(checkpoint_factory) -> None:
    model: Path = checkpoint_factory("llama")
    assert reachable_batch(Engine(model, max_num_seqs=12), PROMPT + TOKENS) == 12  # seats bind
    engine = Engine(model, max_num_seqs=64, num_kv_blocks=20 * PER_ROW + PER_ROW - 1)  # KV binds: 20 rows and a part
    rows = reachable_batch(engine, PROMPT + TOKENS)
    assert rows == 20
    engine.generate([[1 + i % 40] * PROMPT for i in range(rows)],
                    SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))
    assert engine.stats.preemptions == 0  # that many run at once, to their last token


def test_profile_cost_defaults_to_the_reachable_batch(checkpoint_factory) -> None:
    model: Path = checkpoint_factory("llama")
    options = {"max_num_seqs": 64, "num_kv_blocks": 12 * PER_ROW}
    cost = profile_cost(model, max_tokens=TOKENS, prompt_tokens=PROMPT, repeat=1, engine_options=options)
    assert cost.max_batch == 12
    assert cost.seconds_per_token > 0  # (per row and per step are >= 0 by ModelCost's own check)
    assert cost.load_s > 0 and cost.memory_bytes > 0
    assert profile_cost(model, rows=8, max_tokens=TOKENS, repeat=1).max_batch == 8  # given: kept
