"""File job inputs and outputs beyond one local file: compressed JSONL, a glob of JSONL parts, a
hive-partitioned Parquet dataset, Parquet dataset output with its manifest, memory:// paths,
and the Parquet columns equal to the JSONL records (token counts, logprobs)."""
from __future__ import annotations

import bz2
import gzip
import json
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from demo_builder import build_demo_model

from batchgen.cli import main
from batchgen.io.parquet import LOGPROBS_TYPE, OUTPUT_COLUMNS

TINY: dict[str, Any] = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2,
                            intermediate_size=64, vocab_size=320, max_position_embeddings=128, dtype="float32")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
GREEDY = ["--temperature", "0", "--max-tokens", "3", "--progress", "off"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.getbasetemp() / "file-inputs-model", **TINY)


def _prompt(i: int) -> str:
    return " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(1 + i % 4))


def _lines(n: int) -> list[str]:
    return [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": _prompt(i)}}) + "\n" for i in range(n)]


def _jsonl_texts(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        out[r["custom_id"]] = r["response"]["body"]["choices"][0]["text"]
    return out


def _run(model: Path, src: str | Path, out: str | Path, *extra: str) -> int:
    return main(["run", "--model", str(model), "--input", str(src), "--output", str(out), *GREEDY, *extra])


def test_compressed_and_globbed_jsonl_match_the_single_file(model: Path, tmp_path: Path) -> None:
    lines = _lines(12)
    single = tmp_path / "in.jsonl"
    single.write_text("".join(lines))
    assert _run(model, single, tmp_path / "ref.jsonl") == 0
    want = _jsonl_texts(tmp_path / "ref.jsonl")

    (tmp_path / "in.jsonl.gz").write_bytes(gzip.compress("".join(lines).encode()))
    assert _run(model, tmp_path / "in.jsonl.gz", tmp_path / "gz.jsonl") == 0
    assert _jsonl_texts(tmp_path / "gz.jsonl") == want

    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "a-0.jsonl").write_text("".join(lines[:5]))
    (parts / "a-1.jsonl.bz2").write_bytes(bz2.compress("".join(lines[5:9]).encode()))
    (parts / "a-2.jsonl").write_text("".join(lines[9:]).rstrip("\n"))  # a last line without newline
    assert _run(model, f"{parts}/a-*", tmp_path / "glob.jsonl") == 0
    assert _jsonl_texts(tmp_path / "glob.jsonl") == want
    assert _run(model, parts, tmp_path / "dir.jsonl") == 0  # a directory of parts: the same rows
    assert _jsonl_texts(tmp_path / "dir.jsonl") == want


def test_hive_partitioned_parquet_dataset_matches_the_single_file(model: Path, tmp_path: Path) -> None:
    n = 15
    frame = pd.DataFrame({"prompt": [_prompt(i) for i in range(n)], "k": list(range(n)),
                          "part": [i * 3 // n for i in range(n)]})  # 3 partitions, in row order
    frame.to_parquet(tmp_path / "in.parquet", index=False)
    assert _run(model, tmp_path / "in.parquet", tmp_path / "ref.parquet") == 0
    ref = pd.read_parquet(tmp_path / "ref.parquet")

    pq.write_to_dataset(pa.Table.from_pandas(frame, preserve_index=False), tmp_path / "hive",
                        partition_cols=["part"])
    assert sorted(p.name for p in (tmp_path / "hive").iterdir()) == ["part=0", "part=1", "part=2"]
    out = tmp_path / "out"  # no .parquet: a dataset directory
    assert _run(model, tmp_path / "hive", out) == 0
    assert (out / "_SUCCESS").is_file() and json.loads((out / "_SUCCESS").read_text())["rows"] == n
    got = ds.dataset(out, format="parquet").to_table().to_pandas().sort_values("__batchgen_row__")
    got = got.reset_index(drop=True)
    assert got["k"].tolist() == list(range(n))  # row order recovered from the row column
    assert got["part"].astype(int).tolist() == frame["part"].tolist()  # hive columns pass through
    for column in OUTPUT_COLUMNS.names:
        assert got[column].tolist() == ref[column].tolist(), column


def test_parquet_output_columns_equal_the_jsonl_records(model: Path, tmp_path: Path) -> None:
    lines = _lines(6)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(lines))
    assert _run(model, src, tmp_path / "ref.jsonl", "--logprobs", "2") == 0
    assert _run(model, src, tmp_path / "out.parquet", "--logprobs", "2") == 0
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("logprobs").type == LOGPROBS_TYPE
    assert table.column_names[:3] == ["custom_id", "line", "error_code"]
    rows = {r["custom_id"]: r for r in table.to_pylist()}
    for line in (tmp_path / "ref.jsonl").read_text().splitlines():
        rec = json.loads(line)
        body, row = rec["response"]["body"], rows[rec["custom_id"]]
        assert row["generated_text"] == body["choices"][0]["text"]
        assert row["num_input_tokens"] == body["usage"]["prompt_tokens"]
        assert row["num_generated_tokens"] == body["usage"]["completion_tokens"]
        assert row["num_cached_tokens"] == body["usage"]["prompt_tokens_details"]["cached_tokens"]
        lp = body["choices"][0]["logprobs"]
        assert [e["token"] for e in row["logprobs"]] == lp["tokens"]
        assert [e["logprob"] for e in row["logprobs"]] == lp["token_logprobs"]
        assert [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in row["logprobs"]] == lp["top_logprobs"]


def test_memory_filesystem_in_and_out(model: Path, tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    with fs.open("/jobs/in.jsonl", "wb") as f:
        f.write("".join(_lines(4)).encode())
    assert _run(model, "memory://jobs/in.jsonl", "memory://jobs/out.jsonl") == 0
    assert not fs.exists("/jobs/out.jsonl.parts")  # committed: the parts are gone
    got = [json.loads(x)["custom_id"] for x in fs.cat("/jobs/out.jsonl").decode().splitlines()]
    assert sorted(got) == [f"r{i}" for i in range(4)]


def test_parquet_output_columns_are_the_dataframe_paths() -> None:
    from batchgen.cluster import output_columns

    assert tuple(OUTPUT_COLUMNS.names) == output_columns.BASE_COLUMNS
    assert LOGPROBS_TYPE == output_columns.LOGPROBS_TYPE
