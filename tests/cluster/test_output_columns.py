"""The DataFrame output columns against the batch-file path for the same rows: logprobs equal the
chat endpoint's `logprobs.content`, token counts equal OpenAI's `usage`, and chat_template_kwargs
(in a JSONL body, a Parquet column, a DataFrame column) shape the prompt the same way."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny_models import build_thinking_checkpoint

import batchgen
from batchgen.cli import main
from batchgen.io.openai_batch import OpenAIBatchReader
from batchgen.io.rows import RowContext
from batchgen.models.info import ModelInfo

CONVERSATIONS = [
    [{"role": "user", "content": "alpha beta gamma"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}],
]
KWARGS: list[dict[str, Any] | None] = [{"enable_thinking": False}, None, {"enable_thinking": False}]
MAX_TOKENS = [4, 6, 3]
OPTIONS = {"kv_cache_bytes": 16 << 20}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_thinking_checkpoint(tmp_path_factory.mktemp("qwen3-thinking"))


@pytest.fixture(scope="module")
def frame_out(qwen3: Path) -> pd.DataFrame:
    pdf = pd.DataFrame({"messages": [json.dumps(c) for c in CONVERSATIONS], "max_tokens": MAX_TOKENS,
                        "tmpl": [json.dumps(k) if k else None for k in KWARGS]})
    return batchgen.generate(pdf, model=qwen3, messages_column="messages", logprobs=2, temperature=0.0,
                             ignore_eos=True, per_row={"max_tokens": "max_tokens", "chat_template_kwargs": "tmpl"},
                             engine_options=OPTIONS)


def run_jsonl(qwen3: Path, tmp_path: Path) -> list[dict[str, Any]]:
    lines = []
    for i, (c, k, n) in enumerate(zip(CONVERSATIONS, KWARGS, MAX_TOKENS)):
        body: dict[str, Any] = {"messages": c, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                                "logprobs": True, "top_logprobs": 2}
        if k is not None:
            body["chat_template_kwargs"] = k
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert main(["run", "--model", str(qwen3), "--input", str(src), "--output", str(dst), "--progress", "off"]) == 0
    records = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, dst.read_text().splitlines())}
    return [records[f"r{i}"] for i in range(len(CONVERSATIONS))]


def test_logprobs_and_token_counts_equal_the_jsonl_path(qwen3: Path, frame_out: pd.DataFrame, tmp_path: Path) -> None:
    bodies = run_jsonl(qwen3, tmp_path)
    assert frame_out["error"].isna().all() and all("error" not in b for b in bodies)
    assert frame_out["generated_text"].tolist() == [b["choices"][0]["message"]["content"] for b in bodies]
    for row, body in zip(frame_out.itertuples(), bodies):
        content = body["choices"][0]["logprobs"]["content"]
        assert row.logprobs == [{"token": e["token"], "logprob": e["logprob"],
                                 "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                                                  for t in e["top_logprobs"]]} for e in content]
        assert all(len(e["top_logprobs"]) == 2 for e in row.logprobs)
        usage = body["usage"]
        assert (row.num_input_tokens, row.num_generated_tokens, row.num_cached_tokens) == (
            usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
    assert frame_out["num_generated_tokens"].tolist() == MAX_TOKENS
    # thinking off writes the empty think block: the same conversation is longer with it
    assert frame_out["num_input_tokens"][0] > 0


def test_jsonl_chat_template_kwargs_change_the_prompt(qwen3: Path, tmp_path: Path) -> None:
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": CONVERSATIONS[0], "max_tokens": 1, **extra}})
             for i, extra in enumerate([{}, {"chat_template_kwargs": {"enable_thinking": False}},
                                        {"chat_template_kwargs": "thinking"}])]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines[:2]) + "\n")
    assert main(["run", "--model", str(qwen3), "--input", str(src), "--output", str(dst), "--progress", "off"]) == 0
    out = {r["custom_id"]: r["response"] for r in map(json.loads, dst.read_text().splitlines())}
    on, off = (out[k]["body"]["usage"]["prompt_tokens"] for k in ("r0", "r1"))
    assert off > on  # the empty think block
    # a body whose chat_template_kwargs is no object fails its own line, naming the field
    src.write_text("\n".join(lines) + "\n")
    info = ModelInfo.load(qwen3)
    rows = list(OpenAIBatchReader(src, RowContext(info.tokenizer, info.vocab_size, info.max_model_len)).requests())
    assert [r.is_valid for r in rows] == [True, True, False]
    assert rows[1].chat_template_kwargs == {"enable_thinking": False} and rows[0].chat_template_kwargs is None
    assert rows[2].error is not None and rows[2].error.param == "body.chat_template_kwargs"
    assert rows[2].error.message.startswith("line 3: body.chat_template_kwargs='thinking': not valid JSON")


def test_parquet_chat_template_kwargs_column(qwen3: Path, frame_out: pd.DataFrame, tmp_path: Path) -> None:
    src, dst = tmp_path / "in.parquet", tmp_path / "out.parquet"
    messages = pa.array(CONVERSATIONS, type=pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))
    pq.write_table(pa.table({"prompt": messages, "max_tokens": MAX_TOKENS,
                             "tmpl": [json.dumps(k) if k else None for k in KWARGS]}), src)
    assert main(["run", "--model", str(qwen3), "--input", str(src), "--output", str(dst), "--progress", "off",
                 "--param-column", "max_tokens", "--param-column", "chat_template_kwargs=tmpl",
                 "--temperature", "0", "--ignore-eos"]) == 0
    table = pq.read_table(dst).to_pandas()
    assert table["generated_text"].tolist() == frame_out["generated_text"].tolist()
