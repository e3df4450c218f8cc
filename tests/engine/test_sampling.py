"""SamplingParams validation/mapping, stop-string search, and the batched sampler (no model)."""
from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from batchgen.sampler import apply_penalties, apply_top_k_top_p, sample, step_seed
from batchgen.sampling_params import SamplingParams, find_stop_span, find_stop_string

EOS = 0


def run(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int] | None = None,
        steps: list[int] | None = None, prompt: list[list[int]] | None = None,
        output: list[list[int]] | None = None, eos: list[int] | None = None) -> list[int]:
    B = logits.shape[0]
    return sample(logits, params, seeds or list(range(B)), steps or [0] * B,
                  prompt or [[] for _ in range(B)], output or [[] for _ in range(B)],
                  [EOS] if eos is None else eos).token_ids


# --- SamplingParams ---------------------------------------------------------------------------

def test_defaults_are_vllms_and_valid() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == \
        (16, 0, 1.0, 0, 1.0, 0.0)
    assert p.seed is None and p.stop is None and p.stop_token_ids is None and p.logprobs is None
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.validate() is None and p.validate(vocab_size=10) is None


@pytest.mark.parametrize("field, value", [
    ("n", 2), ("n", 0),
    ("max_tokens", -3), ("max_tokens", 0), ("max_tokens", 2.5), ("max_tokens", True),
    ("max_tokens", "10"),
    ("min_tokens", -1), ("min_tokens", 1.5),
    ("temperature", float("nan")), ("temperature", -0.5), ("temperature", float("inf")),
    ("temperature", "hot"), ("temperature", None), ("temperature", True),
    ("top_k", -2), ("top_k", 1.5), ("top_k", False),
    ("top_p", 7), ("top_p", 0), ("top_p", -0.1), ("top_p", float("nan")), ("top_p", "1"),
    ("min_p", 1.5), ("min_p", -0.1), ("min_p", float("nan")),
    ("seed", 1.5), ("seed", "42"), ("seed", True),
    ("stop", 5), ("stop", ""), ("stop", ["ok", ""]), ("stop", ["ok", 3]),
    ("stop_token_ids", 5), ("stop_token_ids", [1, -1]), ("stop_token_ids", [1, 99]),
    ("stop_token_ids", [1, "2"]), ("stop_token_ids", [True]),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 2.0), ("logprobs", True),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("presence_penalty", float("nan")), ("presence_penalty", 3.0), ("presence_penalty", "x"),
    ("frequency_penalty", -2.5), ("frequency_penalty", float("-inf")),
    ("include_stop_str_in_output", None),
])
def test_validate_names_field_and_value(field: str, value: object) -> None:
    p = SamplingParams(**{field: value})                  # bad values never raise here
    msg = p.validate(vocab_size=50)
    assert msg is not None and msg.startswith(field), msg
    shown = repr(value)
    assert shown in msg or (isinstance(value, list) and any(repr(v) in msg for v in value)), msg


def test_validate_messages_read_well() -> None:
    assert SamplingParams(temperature=float("nan")).validate() == \
        "temperature must be a finite number >= 0, got nan"
    assert SamplingParams(temperature="hot").validate() == "temperature must be a number, got 'hot'"
    assert "top_p" in SamplingParams(top_p=7).validate() and "got 7" in SamplingParams(top_p=7).validate()
    assert SamplingParams(max_tokens=-3).validate() == "max_tokens must be an integer >= 1, got -3"


def test_validate_cross_field_and_vocab() -> None:
    msg = SamplingParams(max_tokens=4, min_tokens=5).validate()
    assert msg is not None and "min_tokens" in msg and "5" in msg and "max_tokens=4" in msg
    assert SamplingParams(max_tokens=5, min_tokens=5).validate() is None
    assert SamplingParams(stop_token_ids=[99]).validate() is None          # vocab unknown
    assert "99" in SamplingParams(stop_token_ids=[99]).validate(vocab_size=99)
    assert SamplingParams(stop_token_ids=[98]).validate(vocab_size=99) is None


def test_validate_accepts_good_edge_values() -> None:
    good = [dict(temperature=0), dict(temperature=0.0), dict(top_k=-1), dict(top_k=1),
            dict(top_k=10**6), dict(top_p=1), dict(min_p=1.0), dict(seed=-5), dict(seed=2**80),
            dict(stop="x"), dict(stop=("a", "b")), dict(stop_token_ids=[]), dict(logprobs=0),
            dict(logprobs=20), dict(presence_penalty=-2), dict(frequency_penalty=2),
            dict(repetition_penalty=0.5)]
    for kw in good:
        assert SamplingParams(**kw).validate(vocab_size=100) is None, kw


def test_numpy_scalars_are_numbers() -> None:
    np = pytest.importorskip("numpy")
    p = SamplingParams(max_tokens=np.int64(8), temperature=np.float32(0.5), top_k=np.int32(3))
    assert p.validate() is None


def test_unknown_field_and_positional_raise_typeerror() -> None:
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams(temprature=0.5)
    with pytest.raises(TypeError):
        SamplingParams(16)                                  # keyword-only: no silent misbinding


def test_from_mapping() -> None:
    p = SamplingParams.from_mapping({"temperature": 0.2, "top_p": 0.9, "stop": ["\n"], "seed": 3})
    assert p == SamplingParams(temperature=0.2, top_p=0.9, stop=["\n"], seed=3)
    with pytest.raises(TypeError, match="'top_pp'.*'top_p'"):
        SamplingParams.from_mapping({"top_pp": 0.9})
    with pytest.raises(TypeError):
        SamplingParams.from_mapping([("top_p", 0.9)])       # type: ignore[arg-type]
    assert SamplingParams.from_mapping({"max_completion_tokens": 7}).max_tokens == 7
    assert SamplingParams.from_mapping({"max_tokens": 3, "max_completion_tokens": 7}).max_tokens == 7
    # JSON null means "the default"
    assert SamplingParams.from_mapping({"temperature": None, "max_tokens": None}) == SamplingParams()
    # n != 1 is a per-request error message, not an exception
    msg = SamplingParams.from_mapping({"n": 3}).validate()
    assert msg is not None and msg.startswith("n ") and "3" in msg
    assert SamplingParams.from_mapping({"n": 1}).validate() is None
    # bad values pass through to validate()
    assert "'hot'" in SamplingParams.from_mapping({"temperature": "hot"}).validate()


def test_from_mapping_openai_logprobs() -> None:
    assert SamplingParams.from_mapping({"logprobs": 3}).logprobs == 3          # completions API
    assert SamplingParams.from_mapping({"logprobs": True}).logprobs == 0       # chat API
    assert SamplingParams.from_mapping({"logprobs": True, "top_logprobs": 5}).logprobs == 5
    assert SamplingParams.from_mapping({"logprobs": False, "top_logprobs": 5}).logprobs is None
    assert SamplingParams.from_mapping({"top_logprobs": 2}).logprobs == 2


def test_pickles_small_and_stop_list() -> None:
    p = SamplingParams(temperature=0.3, stop=["a", "b"], seed=1)
    b = pickle.dumps(p)
    assert pickle.loads(b) == p and len(b) < 500
    assert not hasattr(p, "__dict__")
    assert SamplingParams().stop_list == []
    assert SamplingParams(stop="x").stop_list == ["x"]
    assert SamplingParams(stop=("x", "y")).stop_list == ["x", "y"]


# --- stop strings -----------------------------------------------------------------------------

def test_find_stop_string() -> None:
    assert find_stop_string("hello world", ["wor"], 0) == 6
    assert find_stop_string("hello world", [], 0) is None
    assert find_stop_string("abST" + "OP", ["STOP"], 4) == 2          # straddles old/new text
    assert find_stop_string("abSTOPxyz", ["STOP"], 9) is None         # already searched
    assert find_stop_string("abSTOPxyz", ["STOP"], 5) == 2            # "P" was the new char
    assert find_stop_string("abSTOPxyz", ["STOP"], 6) is None         # complete in searched text
    assert find_stop_string("xx def cS", ["def", "cS"], 0) == 3       # earliest wins, not list order
    assert find_stop_span("abcd", ["abc", "ab"], 0) == (0, 2)         # same start: shortest
    assert find_stop_span("xxab", ["ab"], 3) == (2, 4)
    assert find_stop_span("xxab", ["ab"], 4) is None


# --- sampler ----------------------------------------------------------------------------------

def test_greedy_is_argmax_including_ties() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1                 # tie: lowest index
    assert run(logits, [SamplingParams(temperature=0)] * 6) == logits.argmax(-1).tolist()
    assert run(logits, [SamplingParams(temperature=0)] * 6)[2] == 7
    # the slow path (one row still under min_tokens) gives the same argmax for the other rows
    ps = [SamplingParams(temperature=0)] * 5 + [SamplingParams(temperature=0, min_tokens=1)]
    assert run(logits, ps)[:5] == logits.argmax(-1).tolist()[:5]
    assert run(torch.zeros(0, 10), []) == []


def _mixed_batch() -> tuple[torch.Tensor, list[SamplingParams], list[list[int]], list[list[int]]]:
    torch.manual_seed(1)
    V = 2000
    logits = torch.randn(7, V) * 3
    params = [SamplingParams(temperature=0.9), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, top_k=40), SamplingParams(top_p=0.8, min_p=0.02),
              SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(min_tokens=3, stop_token_ids=[5]), SamplingParams(top_k=5, top_p=0.5)]
    prompt = [[1, 2, 3]] * 7
    output = [[4, 4, 9]] * 7
    return logits, params, prompt, output


def test_seeded_row_independent_of_batch_company_and_order() -> None:
    logits, params, prompt, output = _mixed_batch()
    seeds = [11, 12, 13, 14, 15, 16, 17]
    steps = [0, 3, 1, 4, 2, 0, 9]
    full = run(logits, params, seeds, steps, prompt, output)
    for i in range(7):
        alone = run(logits[i:i + 1], params[i:i + 1], seeds[i:i + 1], steps[i:i + 1],
                    prompt[i:i + 1], output[i:i + 1])
        assert alone == [full[i]]
    perm = [6, 3, 0, 5, 2, 4, 1]
    shuffled = run(logits[perm], [params[i] for i in perm], [seeds[i] for i in perm],
                   [steps[i] for i in perm], [prompt[i] for i in perm], [output[i] for i in perm])
    assert shuffled == [full[i] for i in perm]
    # with a different companion logit row the token is still the same
    other = logits.clone()
    other[1:] = torch.randn(6, logits.shape[1])
    assert run(other, params, seeds, steps, prompt, output)[0] == full[0]


def test_different_seeds_and_steps_differ() -> None:
    logits = torch.zeros(1, 1000)                                      # uniform
    by_seed = {run(logits, [SamplingParams()], [s], [0])[0] for s in range(20)}
    by_step = {run(logits, [SamplingParams()], [5], [t])[0] for t in range(20)}
    assert len(by_seed) >= 15 and len(by_step) >= 15
    assert step_seed(5, 0) != step_seed(5, 1) != step_seed(6, 1)
    assert step_seed(5, 1) == step_seed(5, 1) and 0 <= step_seed(-1, 2**70) < 2**64


def test_exponential_race_matches_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    logits = probs.log().expand(n, 4).contiguous()
    for temp, want in [(1.0, probs), (0.5, probs**2 / (probs**2).sum())]:
        toks = run(logits, [SamplingParams(temperature=temp)] * n, list(range(n)), [0] * n)
        freq = torch.bincount(torch.tensor(toks), minlength=4).float() / n
        assert torch.allclose(freq, want, atol=0.03), (temp, freq)


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(16, 500) * 2
    greedy = logits.argmax(-1).tolist()
    seeds = list(range(100, 116))
    assert run(logits, [SamplingParams(temperature=1.5, top_k=1)] * 16, seeds) == greedy
    assert run(logits, [SamplingParams(temperature=1.5, top_p=1e-6)] * 16, seeds) == greedy
    assert run(logits, [SamplingParams(temperature=1.5, min_p=1.0)] * 16, seeds) == greedy


def test_top_k_keeps_ties() -> None:
    x = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0]])
    out = apply_top_k_top_p(x, [2], [1.0])
    assert torch.isfinite(out).tolist() == [[True, False, True, False, True]]
    out = apply_top_k_top_p(x, [2], [0.99])                           # the sort path
    assert torch.isfinite(out).tolist() == [[True, False, True, False, True]]
    # rows without top_k in a batch with it are untouched
    out = apply_top_k_top_p(torch.cat([x, x]), [0, 1], [1.0, 1.0])
    assert torch.isfinite(out).tolist() == [[True] * 5, [True, False, True, False, True]]


def test_min_p() -> None:
    # probs 0.5, 0.3, 0.15, 0.05; min_p=0.35 keeps p >= 0.175: tokens 0 and 1
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(300, 4).contiguous()
    toks = run(logits, [SamplingParams(min_p=0.35)] * 300, list(range(300)))
    assert set(toks) == {0, 1}
    toks = run(logits, [SamplingParams(min_p=0.0)] * 300, list(range(300)))
    assert set(toks) == {0, 1, 2, 3}


# probs of [0, .5, 1, 1.5, 2] ~ [.058, .096, .158, .260, .429]
@pytest.mark.parametrize("kw, support", [
    (dict(top_p=0.3), {4}), (dict(top_p=0.5), {3, 4}), (dict(top_p=0.75), {2, 3, 4}),
    (dict(top_p=0.9), {1, 2, 3, 4}), (dict(top_k=2), {3, 4}), (dict(top_k=-1), {0, 1, 2, 3, 4}),
    (dict(min_p=0.5), {3, 4}), (dict(min_p=0.3), {2, 3, 4}),
    # vLLM order: min_p first, then top_p over the renormalised survivors {2, 3, 4}
    (dict(min_p=0.3, top_p=0.8), {3, 4}), (dict(top_k=3, top_p=0.6), {3, 4}),
    (dict(top_k=2, top_p=0.9), {3, 4}), (dict(top_k=3, top_p=0.95), {2, 3, 4}),
    (dict(temperature=0.5, top_p=0.75), {3, 4}),
])
def test_exact_support(kw: dict, support: set[int]) -> None:
    n = 400
    logits = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0]]).expand(n, -1).contiguous()
    assert set(run(logits, [SamplingParams(**kw)] * n, list(range(n)))) == support


def test_penalties_on_crafted_logits() -> None:
    x = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    out = apply_penalties(x, [2.0], [0.5], [0.25],
                          prompt_ids=[[0]], output_ids=[[1, 1, 2, 77]])   # 77: out of vocab
    # rep 2 on {0,1,2}: [1, -4, .5, -1, .5]; freq .25*count {1:2, 2:1}; presence .5 on {1, 2}
    assert out.tolist() == [[1.0, -5.0, -0.25, -1.0, 0.5]]
    # presence/frequency ignore prompt tokens
    out = apply_penalties(x, [1.0], [1.0], [1.0], prompt_ids=[[0, 3]], output_ids=[[]])
    assert out.tolist() == x.tolist()
    # through sample(): repetition flips the greedy choice from 0 to 4
    y = torch.tensor([[2.0, -2.0, 1.0, -1.0, 1.5]])
    assert run(y, [SamplingParams(temperature=0)]) == [0]
    assert run(y, [SamplingParams(temperature=0, repetition_penalty=2.0)], prompt=[[0]]) == [4]
    assert run(y, [SamplingParams(temperature=0, presence_penalty=0.6)], output=[[0]]) == [4]
    assert run(y, [SamplingParams(temperature=0, presence_penalty=0.6)], prompt=[[0]]) == [0]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[9.0, 8.0, 7.0, 1.0]])                     # eos=0 best, then 1, 2
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    assert run(logits, [p], steps=[0]) == [2]
    assert run(logits, [p], steps=[1]) == [2]
    assert run(logits, [p], steps=[2]) == [0]
    # vLLM: with ignore_eos the eos id is not a stop, so it is not masked
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1], ignore_eos=True)
    assert run(logits, [p], steps=[0]) == [0]
    # sampled rows never pick a masked id either
    p = SamplingParams(temperature=2.0, min_tokens=5, stop_token_ids=[1])
    toks = run(logits.expand(200, 4).contiguous(), [p] * 200, list(range(200)))
    assert set(toks) <= {2, 3}


def test_logprobs_are_raw_log_softmax() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.7, repetition_penalty=1.5, logprobs=3),
              SamplingParams(temperature=0, logprobs=0), SamplingParams()]
    res = sample(logits, params, [1, 2, 3], [0, 0, 0], [[1, 2]] * 3, [[3]] * 3, [EOS])
    ref = torch.log_softmax(logits, -1)
    top3 = ref[0].topk(3).indices.tolist()
    d0 = res.logprobs[0]
    assert list(d0)[0] == res.token_ids[0] and set(top3) <= set(d0)
    assert len(d0) == 3 + (res.token_ids[0] not in top3)
    for t, v in d0.items():
        assert v == pytest.approx(ref[0, t].item(), abs=1e-6)
    assert res.logprobs[1] == {res.token_ids[1]: pytest.approx(ref[1].max().item(), abs=1e-6)}
    assert res.logprobs[2] is None
    # the greedy fast path too
    res = sample(logits, [SamplingParams(temperature=0, logprobs=2)] * 3, [0] * 3, [0] * 3,
                 [[]] * 3, [[]] * 3, [EOS])
    assert all(len(d) == 2 for d in res.logprobs)


def test_half_precision_logits() -> None:
    logits = torch.randn(4, 64).to(torch.bfloat16)
    toks = run(logits, [SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2)] * 4)
    assert all(0 <= t < 64 for t in toks)


# --- property: sampled tokens stay in the support top_k / top_p / min_p allow -------------------

def _allowed(logits: list[float], p: SamplingParams) -> set[int] | None:
    """Superset of the ids vLLM's order (temperature, min_p, top_k, top_p) may return, in float64.

    Returns None when a min_p boundary is too close to call in float32 (the example is skipped).
    """
    z = torch.tensor(logits, dtype=torch.float64)
    if p.temperature < 1e-5:
        return {int(z.argmax())}
    z = z / p.temperature
    probs = torch.softmax(z, -1)
    cut = probs.max() * p.min_p
    if p.min_p > 0 and ((probs - cut).abs() < 1e-5 * probs.max()).any():
        return None
    alive = [i for i in range(len(z)) if probs[i] >= cut]
    if 0 < p.top_k < len(alive):
        kth = sorted((z[i].item() for i in alive), reverse=True)[p.top_k - 1]
        alive = [i for i in alive if z[i] >= kth]
    w = torch.softmax(z[alive], -1)
    za = z[alive]
    mass_above = {i: w[za > z[i]].sum().item() for i in alive}
    return {i for i in alive if mass_above[i] < p.top_p + 1e-5}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(-8, 8), min_size=1, max_size=24),
       st.sampled_from([0.0, 0.1, 0.5, 1.0, 1.7]),
       st.integers(-1, 30), st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
       st.one_of(st.just(0.0), st.floats(0.0, 0.3), st.floats(0.0, 1.0)),
       st.integers(-2**62, 2**62), st.integers(0, 10_000))
def test_sample_stays_in_support(ints: list[int], temperature: float, top_k: int, top_p: float,
                                 min_p: float, seed: int, step: int) -> None:
    logits = [i / 4 for i in ints]                                      # exact, with ties
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    assert p.validate() is None
    allowed = _allowed(logits, p)
    assume(allowed is not None)
    n = 64                                     # many draws, so a wrongly kept tail token shows
    toks = run(torch.tensor([logits]).expand(n, -1).contiguous(), [p] * n,
               [seed + i for i in range(n)], [step] * n)
    assert set(toks) <= allowed, (toks, allowed)
