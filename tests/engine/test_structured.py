"""Structured outputs on a random-weight tiny MoE: every finished output follows its constraint.

jsonschema is the oracle for JSON; Python's re.fullmatch for regexes; exact membership for
choices. Random weights make the model a stress test: it follows the grammar only because the
mask forces it to.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from batchgen import Engine, SamplingParams, StructuredOutputsParams
from batchgen.structured.bitmask import TokenBitmask, apply_token_bitmask, apply_token_bitmask_reference

NAME = {"type": "string", "maxLength": 8}
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "address": {"type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["id", "address"], "additionalProperties": False},
    "array_enum": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "level": {"enum": ["low", "mid", "high"]}},
        "required": ["tags", "level"], "additionalProperties": False},
    "optional_bounds": {"type": "object", "properties": {
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50},
        "note": NAME, "ok": {"type": "boolean"}},
        "required": ["score", "ok"], "additionalProperties": False},
    "array_of_objects": {"type": "array", "items": {
        "type": "object", "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["k", "v"], "additionalProperties": False}, "minItems": 1, "maxItems": 2},
}


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    return checkpoint_factory("qwen3_moe")


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(model_dir, block_size=8)


def _json(schema: dict, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 64), temperature=kw.pop("temperature", 1.0), seed=seed,
                          structured_outputs=StructuredOutputsParams(json=schema, **kw))


def _no_space_outside_strings(text: str) -> bool:
    in_str = esc = False
    for c in text:
        if in_str:
            esc, in_str = (False, in_str) if esc else (c == "\\", c != '"')
        elif c == '"':
            in_str = True
        elif c.isspace():
            return False
    return True


def test_every_finished_json_output_validates_in_a_mixed_batch(engine: Engine, prompt_ids) -> None:
    rows: list[tuple[list[int], SamplingParams, dict | None]] = []
    for k, (_name, schema) in enumerate(SCHEMAS.items()):
        for i in range(4):
            rows.append((prompt_ids[(k + i) % 6], _json(schema, seed=10 * k + i), schema))
            if i % 2:
                rows.append((prompt_ids[i], SamplingParams(max_tokens=8, temperature=1.0, seed=k + i), None))  # free
    outs = engine.generate([p for p, _, _ in rows], [s for _, s, _ in rows])
    finished = 0
    for (_, _, schema), out in zip(rows, outs):
        assert out.error is None
        if schema is None:
            assert out.finish_reason in ("stop", "length")
            continue
        if out.finish_reason == "stop":
            finished += 1
            value = json.loads(out.text)
            jsonschema.validate(value, schema)
            assert _no_space_outside_strings(out.text), out.text  # compact by default
            assert out.token_ids[-1] not in engine.eos_token_ids  # the grammar ended the row
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 64
    assert finished >= 0.75 * len(SCHEMAS) * 4, finished  # the test is not vacuous


def test_json_object_and_whitespace_option(engine: Engine, prompt_ids) -> None:
    outs = engine.generate(prompt_ids[:3], [SamplingParams(
        max_tokens=24, seed=i, structured_outputs=StructuredOutputsParams(json_object=True)) for i in range(3)])
    for out in outs:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
    tok = engine.tokenizer
    space = tok.encode(" ", add_special_tokens=False)
    brace = tok.encode("{", add_special_tokens=False)
    assert len(space) == 1 and len(brace) == 1
    compiler = engine.grammars.compiler
    allowed = {}
    for name, options in {"compact": {}, "any": {"disable_any_whitespace": False},
                          "pattern": {"whitespace_pattern": "[ ]?"}}.items():
        m = compiler.matcher(StructuredOutputsParams(json={"type": "object"}, **options))
        assert m.consume_token(brace[0])
        bits = torch.empty(1, (compiler.n_vocab + 31) // 32, dtype=torch.int32)
        m.unsafe_compute_mask_ptr(bits.data_ptr(), bits.shape[1] * 4)
        allowed[name] = bool((bits[0, space[0] // 32] >> (space[0] % 32)) & 1)
    assert allowed == {"compact": False, "any": True, "pattern": True}


def test_choice_regex_and_grammar_rows_match_exactly(engine: Engine, prompt_ids) -> None:
    choices = ["positive", "negative", "neutral", "n/a"]
    regexes = [r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"(cat|dog)s? [a-z]{1,4}", r"[A-Z][a-z]{0,5}@[a-z]{1,5}\.com"]
    lark = 'start: greet " " NAME\ngreet: "hi" | "hello"\nNAME: /[a-z]{1,5}/'
    gbnf = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'
    rows = [("choice", SamplingParams(max_tokens=12, seed=i, structured_outputs=StructuredOutputsParams(choice=choices)))
            for i in range(6)]
    rows += [(rx, SamplingParams(max_tokens=24, seed=i, structured_outputs=StructuredOutputsParams(regex=rx)))
             for rx in regexes for i in range(3)]
    rows += [(r"(hi|hello) [a-z]{1,5}", SamplingParams(max_tokens=16, seed=i, structured_outputs=StructuredOutputsParams(
        grammar=lark))) for i in range(3)]
    rows += [(r"(yes|no) [0-9][0-9]?", SamplingParams(max_tokens=16, seed=i, structured_outputs=StructuredOutputsParams(
        grammar=gbnf))) for i in range(3)]
    rows += [("greedy-choice", SamplingParams(max_tokens=12, temperature=0.0,
                                              structured_outputs=StructuredOutputsParams(choice=choices)))]
    outs = engine.generate([prompt_ids[i % 8] for i in range(len(rows))], [p for _, p in rows])
    stops = 0
    for (what, _), out in zip(rows, outs):
        assert out.error is None, out.error
        if out.finish_reason != "stop":
            continue
        stops += 1
        if what.endswith("choice"):
            assert out.text in choices
        else:
            assert re.fullmatch(what, out.text), (what, out.text)
    assert stops >= len(rows) - 3, [o.finish_reason for o in outs]


def test_max_tokens_before_the_grammar_completes_is_length(engine: Engine, prompt_ids) -> None:
    out = engine.generate([prompt_ids[3]], [_json(SCHEMAS["nested"], seed=1, max_tokens=3)])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_seeded_rows_are_batch_invariant(engine: Engine, prompt_ids) -> None:
    params = [_json(SCHEMAS["array_enum"], seed=5, max_tokens=32), _json(SCHEMAS["flat"], seed=6, temperature=0.7,
                                                                       max_tokens=32),
              SamplingParams(max_tokens=20, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,6}[0-9]{1,3}"))]
    alone = [engine.generate([prompt_ids[i]], [p])[0].token_ids for i, p in enumerate(params)]
    company = [SamplingParams(max_tokens=10, seed=99 + i) for i in range(3)] + \
              [_json(SCHEMAS["nested"], seed=70 + i, max_tokens=24) for i in range(2)]
    mixed_prompts = [prompt_ids[5]] * 3 + [prompt_ids[4]] * 2 + prompt_ids[:3]
    mixed = engine.generate(mixed_prompts, company + params)
    assert [o.token_ids for o in mixed[-3:]] == alone
    reversed_outs = engine.generate(list(reversed(mixed_prompts)), list(reversed(company + params)))
    assert [o.token_ids for o in reversed_outs[:3]][::-1] == alone


def test_grammar_state_survives_suspend_resume_to_another_engine(model_dir, engine: Engine, prompt_ids) -> None:
    params = [_json(SCHEMAS["nested"], seed=21, max_tokens=32), SamplingParams(
        max_tokens=24, seed=3, structured_outputs=StructuredOutputsParams(regex=r"(cat|dog)s? [a-z]{1,4}"))]
    expected = [o.token_ids for o in engine.generate(prompt_ids[1:3], params)]
    other = Engine(model_dir, block_size=8)
    for with_kv in (False, True):
        ids = [engine.add_request(p, s) for p, s in zip(prompt_ids[1:3], params)]
        for _ in range(5):  # a few tokens into the grammar
            engine.step()
        assert all(0 < len(engine.get(i).output_ids) for i in ids)
        moved = [other.resume(engine.suspend(i, with_kv=with_kv)) for i in ids]
        while other.has_unfinished():
            other.step()
        assert [other.pop_output(i).token_ids for i in moved] == expected
    assert other.grammars.stats.rebuilt >= 4  # rebuilt from the tokens, never pickled


def test_grammar_state_survives_preemption(model_dir, prompt_ids) -> None:
    params = [_json(SCHEMAS["optional_bounds"], seed=30 + i, max_tokens=24) for i in range(len(prompt_ids))]
    roomy = Engine(model_dir, block_size=8).generate(prompt_ids, params)
    tight = Engine(model_dir, block_size=8, num_kv_blocks=40)
    outs = tight.generate(prompt_ids, params)
    assert tight.stats.preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    swapping = Engine(model_dir, block_size=8, num_kv_blocks=40, host_link_bytes_per_s=10**15)
    assert [o.token_ids for o in swapping.generate(prompt_ids, params)] == [o.token_ids for o in roomy]


def test_a_bad_schema_or_regex_fails_only_its_row(engine: Engine, prompt_ids) -> None:
    bad = [StructuredOutputsParams(regex="(unclosed"),
           StructuredOutputsParams(json={"type": "object", "if": {"required": ["a"]}}),
           StructuredOutputsParams(json={"type": "nonsense"}),
           StructuredOutputsParams(json="{not json"),
           StructuredOutputsParams(grammar="start: undefined_rule")]
    params = [SamplingParams(max_tokens=8, seed=1, structured_outputs=b) for b in bad]
    good = _json(SCHEMAS["flat"], seed=2)
    outs = engine.generate(prompt_ids[:len(bad) + 1], params + [good])
    fields = ["regex", "json", "json", "json", "grammar"]
    for out, field in zip(outs, fields):
        assert out.finish_reason == "error" and out.error.startswith(f"structured_outputs.{field}"), out.error
    assert outs[-1].error is None
    assert engine.generate([prompt_ids[len(bad)]], [good])[0].token_ids == outs[-1].token_ids


def test_each_distinct_spec_compiles_once_per_engine(model_dir, prompt_ids) -> None:
    fresh = Engine(model_dir, block_size=8)
    schema = SCHEMAS["flat"]
    fresh.generate(prompt_ids[:5] * 2, [_json(dict(schema), seed=i, max_tokens=4) for i in range(10)])
    assert fresh.grammars.compiler.num_compiled == 1
    fresh.generate(prompt_ids[:2], [_json(schema, seed=1, max_tokens=4, disable_any_whitespace=False),
                                     _json(schema, seed=2, max_tokens=4)])
    assert fresh.grammars.compiler.num_compiled == 2  # another option is another grammar


def test_logprobs_of_constrained_rows_are_finite(engine: Engine, prompt_ids) -> None:
    out = engine.generate([prompt_ids[2]], [SamplingParams(
        max_tokens=6, temperature=0.0, logprobs=5,
        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))])[0]
    assert out.logprobs and all(v > float("-inf") for d in out.logprobs for v in d.values())


def test_params_api() -> None:
    import batchgen

    assert batchgen.StructuredOutputsParams is StructuredOutputsParams
    with pytest.raises(ValueError, match="only one kind"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="all are unset"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="all are unset"):
        StructuredOutputsParams(json_object=False)
    with pytest.raises(TypeError, match="unknown field 'jsn'"):
        SamplingParams(structured_outputs={"jsn": {}})
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert p.structured_outputs == StructuredOutputsParams(choice=["a", "b"]) and p.validate() is None
    assert "structured_outputs.choice" in SamplingParams(structured_outputs={"choice": []}).validate()
    assert "structured_outputs.regex" in SamplingParams(structured_outputs={"regex": 5}).validate()
    assert "structured_outputs.json" in SamplingParams(structured_outputs={"json": 3}).validate()
    assert "disable_any_whitespace" in StructuredOutputsParams(json={}, disable_any_whitespace="no").validate()
    assert StructuredOutputsParams(json={}).disable_any_whitespace is True  # compact JSON by default


@pytest.mark.parametrize("V", [1, 31, 32, 33, 481])
def test_bitmask_matches_the_reference(V: int) -> None:
    gen = torch.Generator().manual_seed(V)
    logits = torch.randn(5, V, generator=gen)
    W = (V + 31) // 32 - (1 if V == 481 else 0)  # 481: a mask narrower than the logits (padded vocab)
    bits = torch.randint(-2**31, 2**31 - 1, (2, max(W, 1)), generator=gen, dtype=torch.int32)
    mask = TokenBitmask([1, 4], bits)
    a, b = logits.clone(), logits.clone()
    apply_token_bitmask(a, mask)
    apply_token_bitmask_reference(b, mask)
    assert torch.equal(a, b)
    assert torch.equal(a[[0, 2, 3]], logits[[0, 2, 3]])  # rows without a grammar untouched


def test_padded_vocabulary_masks_the_ids_past_the_tokenizer(checkpoint_factory, prompt_ids) -> None:
    qwen2 = Engine(checkpoint_factory("qwen2"), block_size=8)  # 16 logits past the tokenizer's ids
    assert qwen2.vocab_size > qwen2.tokenizer.vocab_size
    outs = qwen2.generate(prompt_ids[:3], [_json(SCHEMAS["array_enum"], seed=i, max_tokens=40) for i in range(3)])
    assert all(t < qwen2.tokenizer.vocab_size for o in outs for t in o.token_ids)
    for out in outs:
        assert out.error is None
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMAS["array_enum"])


def test_disable_additional_properties_closes_objects_that_do_not_say() -> None:
    from batchgen.structured.compiler import _no_additional_properties

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                               "c": {"type": "object", "additionalProperties": True},
                                               "d": {"anyOf": [{"type": "object"}, {"type": "integer"}]}}}
    out = _no_additional_properties(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["additionalProperties"] is True  # said explicitly: kept
    assert out["properties"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["d"]["anyOf"][1]
    assert "additionalProperties" not in schema  # the caller's schema is not edited
