"""The host KV pool's default size: 1 GiB, or what max_num_seqs rows at max_model_len can fill
where that is less (its pages are faulted in at load); a configured size always wins."""
from __future__ import annotations

import pytest

from batchgen import Engine
from batchgen.engine.device import HOST_KV_BYTES


@pytest.fixture(scope="module")
def mixtral(checkpoint_factory):
    return checkpoint_factory("mixtral")


def pool_tokens(engine: Engine) -> int:
    return engine.allocator.num_blocks * engine.allocator.block_size


def test_a_small_models_pool_holds_every_seat_at_full_length_and_no_more(mixtral) -> None:
    engine = Engine(mixtral, device="cpu", block_size=8, max_num_seqs=6, max_model_len=100)
    assert pool_tokens(engine) == 6 * 104  # 100 tokens round up to 13 blocks a seat
    assert engine.executor.cache.shape[1] == pool_tokens(engine)


def test_the_pool_stops_at_a_gib_and_a_configured_size_wins(mixtral) -> None:
    engine = Engine(mixtral, device="cpu", block_size=8, max_num_seqs=20_000)
    per_token = engine.model.kv_bytes_per_token()
    assert 20_000 * engine.max_model_len * per_token > HOST_KV_BYTES  # so the GiB is the bound
    assert pool_tokens(engine) == HOST_KV_BYTES // (8 * per_token) * 8
    sized = Engine(mixtral, device="cpu", block_size=8, max_num_seqs=6, max_model_len=100,
                   kv_cache_bytes=64 * 8 * per_token)
    assert pool_tokens(sized) == 64 * 8
