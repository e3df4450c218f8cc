"""File jobs end to end in-process, on a tiny demo model: Parquet round trip and resume, and a
hypothesis-generated mix of good and bad JSONL lines."""
from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from demo_builder import build_demo_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.engine import Engine
from batchgen.io.backend import EngineBackend
from batchgen.io.job import run_file_job
from batchgen.io.openai_batch import record_error, record_key
from batchgen.io.spec import JobSpec
from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams

TINY: dict[str, Any] = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            num_experts=4, top_k=2, intermediate_size=64, vocab_size=320,
                            max_position_embeddings=128, dtype="float32")
GREEDY = {"temperature": 0.0, "max_tokens": 4}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine(build_demo_model(tmp_path_factory.getbasetemp() / "io-tiny-model", **TINY))


def _reference(engine: Engine, prompts: Sequence[str | list[int]], max_tokens: Sequence[int]) -> list[str]:
    """A clean run of just these prompts, straight through the engine."""
    outs = engine.generate(list(prompts), [SamplingParams(temperature=0.0, max_tokens=m)
                                           for m in max_tokens])
    return [o.text for o in outs]


def _run(engine: Engine, spec: JobSpec, **kw: Any) -> Any:
    spec.check()
    return run_file_job(spec, engine, progress="off", **kw)


PROMPTS = ["The for statement", "Exceptions are", "", "A list comprehension", "def f(x):"]


def _parquet_input(path: Path) -> None:
    table = pa.table({"doc": [f"d{i}" for i in range(5)], "text": PROMPTS,
                      "max_tok": [3, None, 4, -1, 5], "meta": [1.5, 2.5, 3.5, 4.5, 5.5]})
    pq.write_table(table, path)


def test_parquet_round_trip(tmp_path: Path, engine: Engine) -> None:
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    _parquet_input(src)
    spec = JobSpec(input=src, output=out, defaults=dict(GREEDY), prompt_column="text",
                   id_column="doc", param_columns={"max_tokens": "max_tok"})
    summary = _run(engine, spec, chunk_size=2)
    assert (summary.succeeded, summary.errors) == (3, 2)
    rows = pq.read_table(out).to_pylist()
    assert [r["doc"] for r in rows] == [f"d{i}" for i in range(5)]  # input order
    assert [r["meta"] for r in rows] == [1.5, 2.5, 3.5, 4.5, 5.5]  # pass-through
    ok = [0, 1, 4]
    expected = _reference(engine, [PROMPTS[i] for i in ok], [3, 4, 5])
    assert [rows[i]["generated_text"] for i in ok] == expected
    assert [rows[i]["finish_reason"] for i in ok] == ["length"] * 3
    assert rows[0]["num_generated_tokens"] == 3 and rows[0]["error"] is None
    assert rows[2]["error"].startswith("row 2 (doc='d2'): text must not be empty")
    assert rows[3]["error"].startswith("row 3 (doc='d3'): max_tokens must be an integer")
    assert rows[3]["finish_reason"] == "error" and rows[3]["generated_text"] is None


def test_parquet_chat_messages_and_per_row_params(tmp_path: Path, engine: Engine) -> None:
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    msgs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]]
    pq.write_table(pa.table({"prompt": msgs, "max_tokens": [2, 3]}), src)
    _run(engine, JobSpec(input=src, output=out, defaults={"temperature": 0.0},
                         per_row_params=True))
    rows = pq.read_table(out).to_pylist()
    tok = engine.tokenizer
    ids = [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in msgs]
    assert [r["generated_text"] for r in rows] == _reference(engine, ids, [2, 3])


class _DiesAfter:
    """Interrupt the job after ``n`` results, as Ctrl-C would."""

    def __init__(self, engine: Engine, n: int) -> None:
        self.inner, self.left = EngineBackend(engine), n

    def run(self, requests: Iterable[tuple[list[int], SamplingParams]],
            max_in_flight: int) -> Iterator[tuple[int, RequestOutput]]:
        for item in self.inner.run(requests, max_in_flight):
            if self.left == 0:
                raise KeyboardInterrupt
            self.left -= 1
            yield item


def test_parquet_resume_after_interrupt(tmp_path: Path, engine: Engine) -> None:
    src, out, clean = tmp_path / "in.parquet", tmp_path / "out.parquet", tmp_path / "clean.parquet"
    _parquet_input(src)
    kw = dict(defaults=dict(GREEDY), prompt_column="text", param_columns={"max_tokens": "max_tok"})
    _run(engine, JobSpec(input=src, output=clean, **kw))
    with pytest.raises(KeyboardInterrupt):
        _run(engine, JobSpec(input=src, output=out, **kw), chunk_size=2,
             backend=_DiesAfter(engine, 1))
    assert not out.exists() and out.with_name("out.parquet.parts").is_dir()
    summary = _run(engine, JobSpec(input=src, output=out, resume=True, **kw))
    assert summary.resumed >= 1 and summary.rows == 5 - summary.resumed
    assert pq.read_table(out).equals(pq.read_table(clean))


# -- hypothesis: every input line -> exactly one output line ------------------------------------
BAD = {
    "json": lambda cid: '{"custom_id": ' + json.dumps(cid) + ', "method": ',
    "no_id": lambda cid: {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
    "url": lambda cid: {**_good(cid, "x", 2), "url": "/v1/embeddings"},
    "method": lambda cid: {**_good(cid, "x", 2), "method": "PUT"},
    "body": lambda cid: {"custom_id": cid, "method": "POST", "url": "/v1/completions"},
    "empty": lambda cid: _good(cid, "", 2),
    "hot": lambda cid: _good(cid, "x", 2, temperature="hot"),
    "top_p": lambda cid: _good(cid, "x", 2, top_p=7),
    "neg": lambda cid: _good(cid, "x", -3),
    "unknown": lambda cid: _good(cid, "x", 2, banana=1),
    "too_long": lambda cid: _good(cid, "word " * 300, 2),
}
LINE_KEYED = {"json", "no_id", "dup"}


def _good(cid: str, prompt: str, max_tokens: int, chat: bool = False, **extra: Any) -> dict[str, Any]:
    if chat:
        body = {"messages": [{"role": "user", "content": prompt}]}
    else:
        body = {"prompt": prompt}
    return {"custom_id": cid, "method": "POST",
            "url": "/v1/chat/completions" if chat else "/v1/completions",
            "body": {**body, "max_tokens": max_tokens, **extra}}


_valid = st.tuples(st.just("ok"), st.text("abcdefgh xyz.", min_size=1, max_size=16),
                   st.integers(1, 4), st.booleans())
_invalid = st.tuples(st.sampled_from([*BAD, "dup"]), st.just(""), st.just(0), st.just(False))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(_valid, _invalid), min_size=1, max_size=10))
def test_every_line_answered_once(engine: Engine, lines: list[tuple[str, str, int, bool]]) -> None:
    text_lines, expected, valid, ids = [], [], [], []
    for i, (kind, prompt, max_tokens, chat) in enumerate(lines):
        number, cid = i + 1, f"r{i}"
        if kind == "dup" and not ids:
            kind = "no_id"
        if kind == "ok":
            obj: Any = _good(cid, prompt, max_tokens, chat)
            valid.append((cid, prompt, max_tokens, chat))
        elif kind == "dup":
            obj = _good(ids[0], "x", 2)
        else:
            obj = BAD[kind](cid)
        if kind not in LINE_KEYED:
            ids.append(cid)
        text_lines.append(obj if isinstance(obj, str) else json.dumps(obj))
        key = ("line", number) if kind in LINE_KEYED else ("id", cid)
        expected.append((key, kind == "ok"))
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        src.write_text("\n".join(text_lines) + "\n")
        _run(engine, JobSpec(input=src, output=out, defaults={"temperature": 0.0}), chunk_size=3)
        records = [json.loads(x) for x in out.read_text().splitlines()]
    got = {}
    for r in records:
        key, err = record_key(r), record_error(r)
        assert key not in got, f"{key} answered twice"
        got[key] = r
        assert r["error"] is None  # only a request that got no response fills it
        if err:
            assert err["message"].startswith(f"line {err['line']}: ")
            assert r["response"]["status_code"] == 400
    assert sorted(got) == sorted(k for k, _ in expected)
    assert all((record_error(got[k]) is None) == ok for k, ok in expected)
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                          add_special_tokens=False) if chat else p for _, p, _, chat in valid]
    want = _reference(engine, prompts, [m for _, _, m, _ in valid])
    for (cid, _, _, chat), text in zip(valid, want):
        choice = got[("id", cid)]["response"]["body"]["choices"][0]
        assert (choice["message"]["content"] if chat else choice["text"]) == text
