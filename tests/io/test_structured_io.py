"""Structured outputs through the front ends: OpenAI batch JSONL (response_format on chat and
completions lines, vLLM's structured_outputs body field), Parquet with a per-row schema column,
`batchgen run` flags, and batchgen.generate (one schema for the job, or per_row json_schema)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from demo_builder import build_demo_model

from batchgen import StructuredOutputsParams
from batchgen.cli import main
from batchgen.cluster import generate
from batchgen.engine import Engine
from batchgen.io.job import run_file_job
from batchgen.io.spec import JobSpec

TINY: dict[str, Any] = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2,
                            intermediate_size=64, vocab_size=320, max_position_embeddings=256, dtype="float32")
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["label", "score"], "additionalProperties": False}
OTHER = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.getbasetemp() / "structured-io-model", **TINY)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine(model_dir)


def _line(cid: str, url: str = "/v1/completions", **body: Any) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _records(path: Path) -> dict[str, dict[str, Any]]:
    return {r["custom_id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_jsonl_response_format_and_structured_outputs(tmp_path: Path, engine: Engine) -> None:
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "Classify: buy now!!!"}]
    rf = {"type": "json_schema", "json_schema": {"name": "label", "schema": SCHEMA, "strict": True}}
    lines = [
        _line("chat-schema", chat, messages=msgs, max_tokens=24, seed=1, response_format=rf),
        _line("cmpl-schema", prompt="Classify: hello", max_tokens=24, seed=2, response_format=rf),
        _line("chat-object", chat, messages=msgs, max_tokens=24, seed=3, response_format={"type": "json_object"}),
        _line("text", prompt="free text", max_tokens=5, seed=4, response_format={"type": "text"}),
        _line("vllm-choice", prompt="yes or no?", max_tokens=6, seed=5, structured_outputs={"choice": ["yes", "no"]}),
        _line("vllm-regex", chat, messages=msgs, max_tokens=12, seed=6, structured_outputs={"regex": "[0-9]{3}"}),
        _line("bad-regex", prompt="x", structured_outputs={"regex": "([0-9"}),
        _line("bad-schema", prompt="x", response_format={"type": "json_schema", "json_schema": {
            "name": "n", "schema": {"type": "object", "if": {}}}}),
        _line("no-schema", prompt="x", response_format={"type": "json_schema", "json_schema": {"name": "n"}}),
        _line("bad-type", prompt="x", response_format={"type": "xml"}),
        _line("both", prompt="x", response_format=rf, structured_outputs={"regex": "a"}),
        _line("unknown", prompt="x", structured_outputs={"regexp": "a"}),
        _line("two-kinds", prompt="x", structured_outputs={"regex": "a", "choice": ["b"]}),
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    spec = JobSpec(input=src, output=out)
    spec.check()
    summary = run_file_job(spec, engine, progress="off")
    rec = _records(out)
    assert summary.errors == 7 and summary.succeeded == 6

    def body(cid: str) -> dict[str, Any]:
        assert rec[cid]["response"]["status_code"] == 200, rec[cid]
        return rec[cid]["response"]["body"]["choices"][0]

    for cid in ("chat-schema", "cmpl-schema", "chat-object"):
        choice = body(cid)
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        if choice["finish_reason"] == "stop":
            value = json.loads(text)
            jsonschema.validate(value, SCHEMA if "schema" in cid else {"type": "object"})
        else:
            assert choice["finish_reason"] == "length"
    assert body("chat-schema")["finish_reason"] == "stop"
    assert body("vllm-choice")["text"] in ("yes", "no")
    regex = body("vllm-regex")
    assert regex["finish_reason"] == "stop" and len(regex["message"]["content"]) == 3
    errors = {cid: rec[cid]["response"]["body"]["error"] for cid in rec if rec[cid]["response"]["status_code"] == 400}
    assert {cid: e["param"] for cid, e in errors.items()} == {
        "bad-regex": "body.structured_outputs",
        "bad-schema": "body.response_format.json_schema.schema",
        "no-schema": "body.response_format.json_schema.schema",
        "bad-type": "body.response_format.type",
        "both": "body.response_format",
        "unknown": "body.structured_outputs",
        "two-kinds": "body.structured_outputs",
    }
    assert "regex" in errors["bad-regex"]["message"] and "if" in errors["bad-schema"]["message"]
    assert "only one kind" in errors["two-kinds"]["message"]


def test_parquet_per_row_schema_column(tmp_path: Path, engine: Engine) -> None:
    schemas = [json.dumps(SCHEMA), None, json.dumps(OTHER), "{not json", json.dumps({"type": "nope"}), json.dumps(SCHEMA)]
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.table({"prompt": [f"row {i}" for i in range(len(schemas))], "schema_col": schemas}), src)
    spec = JobSpec(input=src, output=out, defaults={"max_tokens": 24, "seed": 7},
                   param_columns={"json_schema": "schema_col"})
    spec.check()
    run_file_job(spec, engine, progress="off")
    df = pd.read_parquet(out)
    assert df["error"].isna().tolist() == [True, True, True, False, False, True]
    assert "json_schema" in df["error"][3] and "not valid JSON" in df["error"][3]
    assert "json_schema" in df["error"][4] and "nope" in df["error"][4]
    for i in (0, 2, 5):
        if df["finish_reason"][i] == "stop":
            jsonschema.validate(json.loads(df["generated_text"][i]), SCHEMA if i != 2 else OTHER)
    assert (df["finish_reason"][[0, 2, 5]] == "stop").sum() >= 2
    assert df["num_generated_tokens"][1] == 24 or df["finish_reason"][1] == "stop"  # unconstrained


def test_cli_json_schema_flag(tmp_path: Path, model_dir: Path) -> None:
    src, out, schema = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    src.write_text("\n".join(_line(f"r{i}", prompt=f"row {i}", seed=i) for i in range(3)) + "\n"
                   + _line("own", prompt="x", seed=1, structured_outputs={"choice": ["A", "B"]}) + "\n")
    assert main(["run", "--model", str(model_dir), "--input", str(src), "--output", str(out),
                 "--max-tokens", "24", "--json-schema", str(schema), "--progress", "off"]) == 0
    rec = _records(out)
    assert rec["own"]["response"]["body"]["choices"][0]["text"] in ("A", "B")  # a row's own wins
    stops = [rec[f"r{i}"]["response"]["body"]["choices"][0] for i in range(3)]
    for c in stops:
        if c["finish_reason"] == "stop":
            jsonschema.validate(json.loads(c["text"]), SCHEMA)
    bad = tmp_path / "out2.jsonl"
    assert main(["run", "--model", str(model_dir), "--input", str(src), "--output", str(bad),
                 "--structured-outputs", '{"regex": "("}']) == 2


def test_generate_with_one_schema_or_a_per_row_column(model_dir: Path) -> None:
    pdf = pd.DataFrame({"prompt": [f"text {i}" for i in range(5)],
                        "schema": [json.dumps(SCHEMA), json.dumps(OTHER), None, "{bad", json.dumps(OTHER)]},
                       index=[4, 2, 9, 0, 7])
    opts = {"kv_cache_bytes": 16 << 20}
    out = generate(pdf, model=model_dir, per_row={"json_schema": "schema"}, engine_options=opts,
                   max_tokens=24, seed=3)
    assert out.index.tolist() == [4, 2, 9, 0, 7]
    assert out["error"].isna().tolist() == [True, True, True, False, True]
    assert "structured_outputs.json" in out["error"][0]
    for idx, schema in ((4, SCHEMA), (2, OTHER), (7, OTHER)):
        if out["finish_reason"][idx] == "stop":
            jsonschema.validate(json.loads(out["generated_text"][idx]), schema)
    job = generate(pdf[["prompt"]], model=model_dir, engine_options=opts, max_tokens=24, seed=3,
                   structured_outputs=StructuredOutputsParams(json=SCHEMA))
    same = generate(pdf[["prompt"]], model=model_dir, engine_options=opts, max_tokens=24, seed=3, json_schema=SCHEMA)
    assert job["generated_text"].tolist() == same["generated_text"].tolist()
    assert job["generated_text"][4] == out["generated_text"][4]  # the same schema, seed and prompt
    assert (job["finish_reason"] == "stop").sum() >= 3
    for text, reason in zip(job["generated_text"], job["finish_reason"]):
        if reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
