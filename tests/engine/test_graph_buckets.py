"""CUDA-graph decode: bucketing and padding (pure, on CPU); capture and replay on CUDA only."""
from __future__ import annotations

import pytest
import tiny_models
import torch

from batchgen import Engine, SamplingParams
from batchgen.runtime.graph_buckets import DecodeStep, capture_sizes, pad_decode, pick_bucket


def test_capture_sizes_are_vllms_and_reach_max_num_seqs() -> None:
    assert capture_sizes(256)[:6] == (1, 2, 4, 8, 16, 24) and capture_sizes(256)[-1] == 256
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(4096)[-1] == 512 and len(capture_sizes(4096)) == 3 + 64
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


@pytest.mark.parametrize("n, want", [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (20, 20), (21, None), (0, None)])
def test_pick_bucket(n: int, want: int | None) -> None:
    assert pick_bucket(n, capture_sizes(20)) == want


def test_pad_decode_pads_rows_to_the_bucket_and_tables_to_the_widest_context() -> None:
    # block size 4: a row at position 0 (1 block), one at 6 (2 blocks), one at 8 (a 3rd block starts)
    rows = [(11, 0, [7]), (12, 6, [3, 5]), (13, 8, [1, 2, 9, 4])]
    step = pad_decode(rows, 8, 4, pad_slot=999)
    assert step == DecodeStep(
        bucket=8, tokens=[11, 12, 13] + [0] * 5, positions=[0, 6, 8] + [0] * 5,
        slots=[7 * 4 + 0, 5 * 4 + 2, 9 * 4 + 0] + [999] * 5, context_lens=[1, 7, 9] + [1] * 5,
        tables=[[7, 0, 0], [3, 5, 0], [1, 2, 9]] + [[0, 0, 0]] * 5)


def test_pad_decode_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode([(1, 0, [0])] * 3, 2, 4, 99)
    with pytest.raises(ValueError, match="past the 1 blocks"):
        pad_decode([(1, 4, [0])], 1, 4, 99)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_cuda_graph_decode_matches_eager_and_transformers(arch: str, checkpoint_factory, prompt_ids) -> None:
    model_dir = checkpoint_factory(arch)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    graphs = Engine(model_dir, dtype="float32", device="cuda", block_size=8, kv_cache_bytes=16 << 20)
    eager = Engine(model_dir, dtype="float32", device="cuda", block_size=8, kv_cache_bytes=16 << 20,
                   enforce_eager=True)
    assert graphs.executor.graphs is not None and eager.executor.graphs is None
    outs = graphs.generate(prompt_ids, params)
    assert graphs.stats.graph_steps > 0, "no decode step ran in a graph"
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager.generate(prompt_ids, params)]
    for prompt, out in zip(prompt_ids, outs):
        assert out.token_ids == tiny_models.reference_generate(model_dir, prompt, 12, ignore_eos=True)
    torch.cuda.synchronize()
