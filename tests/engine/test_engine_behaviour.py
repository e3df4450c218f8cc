"""Engine behaviour beyond parity: seeded sampling, preemption, bad input, fail-fast loading."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import tiny_models
import torch

from batchgen import Engine, ModelLoadError, SamplingParams, UnsupportedModelError


@pytest.fixture(scope="module")
def mixtral(checkpoint_factory):
    return checkpoint_factory("mixtral")


@pytest.fixture(scope="module")
def engine(mixtral) -> Engine:
    return Engine(mixtral, block_size=8)


def test_seeded_sampling_is_independent_of_batch_company_and_order(engine: Engine, prompt_ids) -> None:
    seeded = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(len(prompt_ids))]
    alone = [engine.generate([p], [s])[0].token_ids for p, s in zip(prompt_ids, seeded)]
    together = [o.token_ids for o in engine.generate(prompt_ids, seeded)]
    order = list(reversed(range(len(prompt_ids))))
    reversed_outs = engine.generate([prompt_ids[i] for i in order], [seeded[i] for i in order])
    assert together == alone
    assert [reversed_outs[order.index(i)].token_ids for i in range(len(prompt_ids))] == alone
    # the seed matters: another seed gives another continuation for at least one prompt
    other = engine.generate(prompt_ids, [SamplingParams(max_tokens=12, temperature=0.9, seed=7 + i)
                                         for i in range(len(prompt_ids))])
    assert [o.token_ids for o in other] != alone


def test_preemption_under_tiny_kv_pool_keeps_greedy_tokens(mixtral, prompt_ids) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    roomy = Engine(mixtral, block_size=8).generate(prompt_ids, params)
    # 40 blocks of 8 = 320 tokens: the 200-token prompt plus a few others cannot all stay resident
    tight = Engine(mixtral, block_size=8, num_kv_blocks=40)
    outs = tight.generate(prompt_ids, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert tight.stats.preemptions > 0
    assert sum(o.num_preemptions for o in outs) == tight.stats.preemptions


@pytest.mark.parametrize("eviction", ["fewest_computed", "most_remaining"])
def test_other_eviction_policies_are_exact_too(mixtral, prompt_ids, eviction: str) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = [tiny_models.reference_generate(mixtral, p, 10, ignore_eos=True) for p in prompt_ids[:5]]
    outs = Engine(mixtral, block_size=8, num_kv_blocks=12, eviction=eviction).generate(prompt_ids[:5], params)
    assert [o.token_ids for o in outs] == expected


BAD = [
    ("", SamplingParams(max_tokens=4), "prompt"),
    ([], SamplingParams(max_tokens=4), "prompt"),
    ([5] * 600, SamplingParams(max_tokens=4), "max_model_len"),
    ([1, 2, 3], SamplingParams(max_tokens=0), "max_tokens"),
    ([1, 2, 3], SamplingParams(max_tokens=-3), "max_tokens"),
    ([1, 2, 3], SamplingParams(temperature=-1.0), "temperature"),
    ([1, 2, 3], SamplingParams(temperature=math.nan), "temperature"),
    ([1, 2, 3], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2, 3], SamplingParams(top_p=7), "top_p"),
    ([1, 99999, 3], SamplingParams(max_tokens=4), "99999"),
    ([1, -1, 3], SamplingParams(max_tokens=4), "-1"),
]


def test_each_bad_request_fails_alone(engine: Engine, prompt_ids) -> None:
    good = SamplingParams(max_tokens=5, temperature=0.0)
    prompts = [prompt_ids[3]] + [b[0] for b in BAD] + [prompt_ids[4]]
    params = [good] + [b[1] for b in BAD] + [good]
    outs = engine.generate(prompts, params)
    assert outs[0].error is None and outs[-1].error is None
    assert outs[0].token_ids == engine.generate([prompt_ids[3]], good)[0].token_ids
    for out, (_, _, word) in zip(outs[1:-1], BAD):
        assert out.finish_reason == "error" and out.token_ids == []
        assert word in out.error, out.error


def test_unknown_sampling_field_raises_type_error() -> None:
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams(temprature=0.5)  # type: ignore[call-arg]


def test_stop_strings_and_stop_token_ids(engine: Engine, prompt_ids) -> None:
    free = engine.generate([prompt_ids[5]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    target = free.token_ids[6]
    by_id = engine.generate([prompt_ids[5]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                              stop_token_ids=[target]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[:free.token_ids.index(target) + 1]
    stop = free.text[len(free.text) // 2:][:3]
    by_text = engine.generate([prompt_ids[5]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                                stop=[stop]))[0]
    assert by_text.finish_reason == "stop" and stop not in by_text.text
    assert free.text.startswith(by_text.text)


def test_logprobs_are_returned_per_token(engine: Engine, prompt_ids) -> None:
    out = engine.generate([prompt_ids[2]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and lp[tok] == max(lp.values()) and len(lp) >= 3


def test_string_prompts_are_tokenized_with_bos(engine: Engine) -> None:
    out = engine.generate(["The quick brown fox"], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert out.prompt_token_ids[0] == engine.tokenizer.bos_token_id and out.error is None


def test_missing_model_dir_fails_fast(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(tmp_path / "nope")


def test_broken_model_dirs_fail_with_one_clear_message(mixtral, tmp_path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(mixtral, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        Engine(broken)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(mixtral / "config.json", no_weights / "config.json")
    with pytest.raises(ModelLoadError, match="safetensors"):
        Engine(no_weights)


@pytest.mark.parametrize("patch, word", [
    ({"model_type": "gpt2"}, "gpt2"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantiz"),
])
def test_unsupported_config_fails_at_load(mixtral, tmp_path, patch: dict, word: str) -> None:
    target = tmp_path / "m"
    shutil.copytree(mixtral, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg.pop("rope_parameters", None) if "rope_scaling" in patch else None
    (target / "config.json").write_text(json.dumps(cfg | patch))
    with pytest.raises(UnsupportedModelError, match=word):
        Engine(target)


def test_run_requests_pulls_lazily_and_bounds_rows_in_flight(engine: Engine, prompt_ids) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    pulled: list[int] = []
    finished: list[int] = []

    def source():
        for i in range(12):
            assert len(pulled) - len(finished) <= 3, "more than max_in_flight rows pulled ahead"
            pulled.append(i)
            yield ([5] if i == 7 else prompt_ids[i % 4]), (params if i != 5 else SamplingParams(max_tokens=0))

    outs = {}
    for i, out in engine.run_requests(source(), max_in_flight=3):
        finished.append(i)
        outs[i] = out
    assert sorted(outs) == list(range(12))
    assert outs[5].finish_reason == "error" and "max_tokens" in outs[5].error
    expected = engine.generate([prompt_ids[1]], params)[0].token_ids
    assert outs[1].token_ids == expected and outs[9].token_ids == expected


def test_stop_string_cut_survives_suspend_and_resume(mixtral, engine: Engine, prompt_ids) -> None:
    base = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    free = engine.generate([prompt_ids[5]], base)[0]
    stop = free.text[len(free.text) // 2:][:3]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop])
    local = engine.generate([prompt_ids[5]], params)[0]
    seq_id = engine.add_request(prompt_ids[5], params)
    while not engine.get(seq_id).is_finished:
        engine.step()
    other = Engine(mixtral, block_size=8)
    moved = other.pop_output(other.resume(engine.suspend(seq_id)))
    assert moved.text == local.text and stop not in moved.text and moved.finish_reason == "stop"


def test_stop_string_seen_before_min_tokens_does_not_stop_later(engine: Engine, prompt_ids) -> None:
    free = engine.generate([prompt_ids[5]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    early = engine.tokenizer.decode(free.token_ids[:2])
    assert early and early not in engine.tokenizer.decode(free.token_ids)[len(early):]
    out = engine.generate([prompt_ids[5]], SamplingParams(max_tokens=12, min_tokens=6, temperature=0.0,
                                                           ignore_eos=True, stop=[early]))[0]
    assert out.finish_reason == "length" and out.token_ids == free.token_ids


def test_engine_options_come_from_dask_config(mixtral) -> None:
    import dask.config

    with dask.config.set({"batchgen.dtype": "bfloat16", "batchgen.max-num-seqs": 3}):
        configured = Engine(mixtral, block_size=8)
    assert configured.model.dtype == torch.bfloat16 and configured.config.max_num_seqs == 3
    with dask.config.set({"batchgen.dtype": "bfloat16"}):
        assert Engine(mixtral, dtype="float32").model.dtype == torch.float32  # keywords win


def test_unknown_sequence_ids_name_the_problem(engine: Engine) -> None:
    with pytest.raises(KeyError, match="no sequence 12345"):
        engine.suspend(12345)  # type: ignore[arg-type]


def test_public_names_resolve_lazily() -> None:
    import batchgen

    assert callable(batchgen.generate) and callable(batchgen.cluster.connect)
    assert batchgen.Engine is Engine and batchgen.SamplingParams is SamplingParams
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        batchgen.nope  # noqa: B018
