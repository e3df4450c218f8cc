"""OpenAI batch JSONL parsing and output records (no engine needed: a real tokenizer only)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from demo_builder import train_tokenizer

from batchgen.demo import EOS_ID
from batchgen.io.openai_batch import (
    OpenAIBatchReader,
    error_record,
    record_error,
    record_key,
    response_record,
    row_key,
    success_record,
)
from batchgen.io.request import Request
from batchgen.io.rows import RowContext
from batchgen.outputs import RequestOutput
from batchgen.tokenizer import Tokenizer

MAX_LEN = 128


VOCAB = 320


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> RowContext:
    tok = Tokenizer.from_dir(train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=VOCAB),
                             [EOS_ID])
    assert tok is not None
    return RowContext(tok, tok.vocab_size, MAX_LEN, {"max_tokens": 8})


def _line(cid: str | None = "r", url: str = "/v1/completions", **body: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"method": "POST", "url": url, "body": body}
    if cid is not None:
        d["custom_id"] = cid
    return d


def _parse(tmp_path: Path, ctx: RowContext, lines: list[Any]) -> list[Request]:
    path = tmp_path / "in.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return list(OpenAIBatchReader(path, ctx).requests())


def test_valid_completion_and_chat(tmp_path: Path, ctx: RowContext) -> None:
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    reqs = _parse(tmp_path, ctx, [
        _line("a", prompt="Hello world", max_tokens=5, temperature=0, model="anything"),
        _line("b", url="/v1/chat/completions", messages=msgs, max_completion_tokens=3, top_k=4),
        _line("c", prompt=[5, 6, 7], seed=3, stop=["\n"], logprobs=2, stream=False, n=1),
    ])
    assert [r.error for r in reqs] == [None, None, None]
    a, b, c = reqs
    assert a.key == ("id", "a") and not a.chat
    assert a.prompt_token_ids == ctx.tokenizer.encode("Hello world")
    assert (a.params.max_tokens, a.params.temperature) == (5, 0)
    text = ctx.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])
    assert b.chat and b.prompt_token_ids == ctx.tokenizer.encode(text, add_special_tokens=False)
    assert (b.params.max_tokens, b.params.top_k) == (3, 4)
    assert c.prompt_token_ids == [5, 6, 7] and c.params.max_tokens == 8  # the job default
    assert (c.params.seed, c.params.stop, c.params.logprobs) == (3, ["\n"], 2)


def test_integral_floats_are_ints(tmp_path: Path, ctx: RowContext) -> None:
    """As the OpenAI server (pydantic, lax mode) takes them: 3.0 is 3 in an integer field."""
    a, b = _parse(tmp_path, ctx, [
        _line("a", prompt="x", max_tokens=3.0, min_tokens=1.0, top_k=4.0, seed=7.0, logprobs=2.0,
              n=1.0, stop_token_ids=[5.0, 6]),
        _line("b", url="/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
              max_completion_tokens=2.0, logprobs=True, top_logprobs=3.0, temperature=1),
    ])
    assert a.error is None and b.error is None
    p = a.params
    got = (p.max_tokens, p.min_tokens, p.top_k, p.seed, p.logprobs, p.n, p.stop_token_ids)
    assert got == (3, 1, 4, 7, 2, 1, [5, 6])
    assert all(type(v) is int for v in (*got[:-1], *got[-1]))
    assert (b.params.max_tokens, b.params.logprobs) == (2, 3)
    assert type(b.params.max_tokens) is int and type(b.params.logprobs) is int
    assert type(b.params.temperature) is int  # float fields are left alone


BAD_LINES: list[tuple[Any, str, list[str]]] = [
    ("{not json", "invalid_json", ["not valid JSON", "{not json"]),
    ("[1, 2]", "invalid_json", ["[1, 2]"]),
    (_line(None, prompt="x"), "missing_custom_id", ["custom_id", "missing"]),
    (_line(7, prompt="x"), "missing_custom_id", ["custom_id=7"]),  # type: ignore[arg-type]
    ({**_line(prompt="x"), "method": "GET"}, "invalid_method", ["method='GET'"]),
    (_line(url="/v1/embeddings", prompt="x"), "invalid_url", ["url='/v1/embeddings'"]),
    ({"custom_id": "r", "method": "POST", "url": "/v1/completions"}, "missing_body", ["body"]),
    ({**_line(), "body": "hi"}, "invalid_body", ["body='hi'"]),
    (_line(max_tokens=4), "invalid_prompt", ["body.prompt", "missing"]),
    (_line(prompt=""), "invalid_prompt", ["body.prompt", "''"]),
    (_line(prompt=[]), "invalid_prompt", ["body.prompt", "[]"]),
    (_line(prompt=[1, 99999]), "invalid_prompt", ["body.prompt", "99999"]),
    (_line(prompt="word " * 200), "prompt_too_long", ["body.prompt", str(MAX_LEN)]),
    (_line(prompt="x", max_tokens=-1), "invalid_value", ["body.max_tokens", "-1"]),
    (_line(prompt="x", temperature="hot"), "invalid_value", ["body.temperature", "'hot'"]),
    (_line(prompt="x", top_p=7), "invalid_value", ["body.top_p", "7"]),
    (_line(prompt="x", temprature=1), "unknown_field", ["body.temprature", "'temperature'"]),
    (_line(prompt="x", n=2), "invalid_value", ["body.n", "2"]),
    # Integral floats are ints (test_integral_floats_are_ints); nothing else is.
    (_line(prompt="x", max_tokens=3.5), "invalid_value", ["body.max_tokens", "3.5"]),
    (_line(prompt="x", max_tokens=True), "invalid_value", ["body.max_tokens", "True"]),
    (_line(prompt="x", max_tokens="3"), "invalid_value", ["body.max_tokens", "'3'"]),
    (_line(prompt="x", seed=1.5), "invalid_value", ["body.seed", "1.5"]),
    (_line(prompt="x", top_k=float("inf")), "invalid_value", ["body.top_k", "inf"]),
    (_line(prompt="x", stop_token_ids=[2.5]), "invalid_value", ["body.stop_token_ids", "2.5"]),
    (_line(prompt="x", stream=True), "unsupported_value", ["body.stream=True"]),
    (_line(url="/v1/chat/completions", messages="hi"), "invalid_prompt",
     ["body.messages", "'hi'"]),
    (_line(url="/v1/chat/completions", messages=[{"content": "x"}]), "invalid_prompt",
     ["body.messages[0]", "role"]),
]


@pytest.mark.parametrize("line,code,named", BAD_LINES, ids=[c for _, c, _ in BAD_LINES])
def test_bad_line_is_an_error_naming_line_field_value(tmp_path: Path, ctx: RowContext,
                                                      line: Any, code: str,
                                                      named: list[str]) -> None:
    good = _line("ok", prompt="fine")
    reqs = _parse(tmp_path, ctx, [good, line, {**good, "custom_id": "ok2"}])
    assert [r.is_valid for r in reqs] == [True, False, True]
    err = reqs[1].error
    assert err is not None and err.code == code
    assert err.message.startswith("line 2: ")
    for part in named:
        assert part in err.message
    record = error_record(reqs[1])
    _assert_openai_400(record, code, err.message, err.param, line=2)


def _assert_openai_400(record: dict[str, Any], code: str, message: str, param: str | None,
                       line: int) -> None:
    """OpenAI's batch output for a request its API rejected: the error in one place, under
    ``response.body``, with the top-level ``error`` null."""
    assert record["error"] is None
    assert record["response"]["status_code"] == 400
    assert record["response"]["body"] == {"error": {
        "message": message, "type": "invalid_request_error", "param": param, "code": code,
        "line": line, "retryable": False}}
    assert record_error(record) is record["response"]["body"]["error"]


def test_engine_failure_is_the_same_400_shape(tmp_path: Path) -> None:
    """A row the engine rejects (after parsing) gets the same record as a bad line."""
    from batchgen.io.job import run_job
    from batchgen.io.jsonl_sink import JsonlSink
    from batchgen.sampling_params import SamplingParams

    class Rejects:
        def run(self, requests: Any, max_in_flight: int) -> Any:
            for position, _ in enumerate(requests):
                yield position, RequestOutput(index=0, prompt_token_ids=[1], token_ids=[], text="",
                                              finish_reason="error", error="does not fit the KV pool")

    req = Request(key=("id", "a"), where="line 3", number=3, custom_id="a",
                  prompt_token_ids=[1, 2], params=SamplingParams())
    path = tmp_path / "out.jsonl"
    summary = run_job([req], JsonlSink(path, model="m", resume=False), Rejects())
    assert summary.errors == 1
    [record] = [json.loads(x) for x in path.read_text().splitlines()]
    _assert_openai_400(record, "invalid_request", "line 3: does not fit the KV pool", None, line=3)
    assert record["custom_id"] == "a" and record_key(record) == ("id", "a")


def test_record_key_reads_previous_and_response_less_shapes() -> None:
    """Outputs of earlier versions (the error in both places) still resume; so would a line
    with a top-level error and no response (OpenAI's expired requests)."""
    old = {"custom_id": None, "error": {"code": "invalid_json", "line": 4},
           "response": {"status_code": 400, "body": {"error": {"code": "invalid_json", "line": 4}}}}
    assert record_key(old) == ("line", 4)
    expired = {"custom_id": "x", "response": None,
               "error": {"code": "batch_expired", "message": "not run in time"}}
    assert record_error(expired) == expired["error"] and record_key(expired) == ("id", "x")
    ok = {"custom_id": "y", "error": None, "response": {"status_code": 200, "body": {"choices": []}}}
    assert record_error(ok) is None and record_key(ok) == ("id", "y")


def test_output_keys_are_the_input_keys(tmp_path: Path, ctx: RowContext) -> None:
    """What --resume rests on: a row's record (or an image job's Parquet row, by ``row_key`` of
    its columns) has the key of the input row it answers."""
    reqs = _parse(tmp_path, ctx, [_line("a", prompt="x"), "{bad", _line("a", prompt="y"), _line(None, prompt="z"),
                                  _line("b", prompt="x", top_p=7)])
    for req in reqs:
        record = error_record(req) if req.error else response_record(req, 200, {"data": []})
        code = (record_error(record) or {}).get("code")
        assert record_key(record) == row_key(req.custom_id, code, req.number) == req.key
    with pytest.raises(KeyError):
        row_key(None, None, None)  # keyed by a line it does not name: not a batchgen record


def test_no_chat_template_is_a_row_error(tmp_path: Path, ctx: RowContext) -> None:
    plain = train_tokenizer(tmp_path / "plain", vocab_size=VOCAB, chat_template=False)
    bare = RowContext(Tokenizer.from_dir(plain, [EOS_ID]), ctx.vocab_size, MAX_LEN)
    [req] = _parse(tmp_path, bare, [_line(url="/v1/chat/completions",
                                          messages=[{"role": "user", "content": "hi"}])])
    assert req.error is not None and "chat_template" in req.error.message
    assert req.error.message.startswith("line 1: body.messages")


def test_duplicate_custom_id_second_is_the_error(tmp_path: Path, ctx: RowContext) -> None:
    reqs = _parse(tmp_path, ctx, [_line("a", prompt="x"), _line("b", prompt="y"),
                                  _line("a", prompt="z")])
    assert [r.key for r in reqs] == [("id", "a"), ("id", "b"), ("line", 3)]
    assert reqs[0].is_valid and not reqs[2].is_valid
    assert "already used on line 1" in reqs[2].error.message  # type: ignore[union-attr]
    # The duplicate's record keeps the custom_id but resumes by line.
    rec = error_record(reqs[2])
    assert rec["custom_id"] == "a" and record_key(rec) == ("line", 3)


def test_skip_keys_and_blank_lines(tmp_path: Path, ctx: RowContext) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(_line("a", prompt="x")) + "\n\n{bad\n"
                    + json.dumps(_line("a", prompt="y")) + "\n" + json.dumps(_line("b", prompt="z")))
    reader = OpenAIBatchReader(path, ctx)
    assert reader.count() == 4
    all_keys = [r.key for r in reader.requests()]
    assert all_keys == [("id", "a"), ("line", 3), ("line", 4), ("id", "b")]
    assert [r.key for r in reader.requests({("id", "a"), ("line", 4)})] == [("line", 3), ("id", "b")]


def test_success_record_shapes(ctx: RowContext) -> None:
    out = RequestOutput(index=0, prompt_token_ids=[1, 2, 3], token_ids=[40, 41], text="ab",
                        finish_reason="length", logprobs=[{40: -0.1, 7: -2.0}, {41: -0.2}], num_cached_tokens=2)
    comp = Request(key=("id", "c1"), where="line 1", number=1, custom_id="c1")
    rec = success_record(comp, out, "tiny", ctx.tokenizer)
    assert rec["id"].startswith("batch_req_") and rec["custom_id"] == "c1"
    assert rec["error"] is None and rec["response"]["status_code"] == 200
    body = rec["response"]["body"]
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    choice = body["choices"][0]
    assert (choice["index"], choice["text"], choice["finish_reason"]) == (0, "ab", "length")
    assert choice["logprobs"]["token_logprobs"] == [-0.1, -0.2]
    assert len(choice["logprobs"]["top_logprobs"][0]) == 2
    chat = Request(key=("id", "c2"), where="line 2", number=2, custom_id="c2", chat=True)
    body = success_record(chat, out, "tiny", ctx.tokenizer)["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]] == [-0.1, -0.2]
    assert record_key(rec) == ("id", "c1")


def test_lone_surrogates_and_prompt_lists_fail_their_line_only(tmp_path, ) -> None:
    """A \\ud800 escape is valid JSON but not UTF-8; a list of prompts is not one prompt."""
    import json as _json

    from tiny_models import build_checkpoint

    from batchgen.cli import main

    model = build_checkpoint("llama", tmp_path / "m")
    lines = [
        '{"custom_id": "ok1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hello", "max_tokens": 2}}',
        '{"custom_id": "s\\ud800", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 2}}',
        '{"custom_id": "p2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "bad \\udc00", "max_tokens": 2}}',
        '{"custom_id": "p3", "method": "POST", "url": "/v1/completions", "body": {"prompt": ["a", "b"], "max_tokens": 2}}',
        '{"custom_id": "ok2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "world", "max_tokens": 2}}',
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert main(["run", "--model", str(model), "--input", str(src), "--output", str(out), "--progress", "off",
                 "--max-error-rate", "1"]) == 0
    rows = {r["custom_id"]: r for r in map(_json.loads, out.read_text().splitlines())}
    assert len(rows) == 5 and all(r["error"] is None for r in rows.values())
    assert record_error(rows["ok1"]) is None and record_error(rows["ok2"]) is None
    assert "tokenized" in record_error(rows["p2"])["message"]
    assert "list of several prompts" in record_error(rows["p3"])["message"]


def test_null_content_is_a_field_error_for_non_assistant_messages() -> None:
    from batchgen.tokenizer import message_problem as _message_problem

    assert _message_problem([{"role": "user", "content": None}]) == \
        "messages[0].content must be a string or a list of text parts, got null"
    assert _message_problem([{"role": "assistant", "content": None}, {"role": "user", "content": "hi"}]) is None
