"""Resumable writers: JSONL append/fsync/torn-line recovery; Parquet parts and atomic commit."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.errors import BatchgenError
from batchgen.io.jsonl_sink import JsonlSink, recover
from batchgen.io.parquet_sink import ROW_COLUMN, ParquetSink, parts_dir
from batchgen.io.request import Request
from batchgen.outputs import RequestOutput


def _out(text: str, n: int = 2) -> RequestOutput:
    return RequestOutput(index=0, prompt_token_ids=[1, 2], token_ids=list(range(n)), text=text,
                         finish_reason="length")


def _jreq(cid: str, number: int) -> Request:
    return Request(key=("id", cid), where=f"line {number}", number=number, custom_id=cid)


def test_jsonl_sink_appends_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    sink = JsonlSink(path, model="m", resume=False)
    sink.add_result(_jreq("a", 1), _out("x"))
    assert sink.pending == 1 and path.read_bytes() == b""  # buffered until flush
    sink.flush()
    bad = Request(key=("line", 2), where="line 2", number=2).fail("invalid_json", "nope")
    sink.add_error(bad)
    sink.commit()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["custom_id"] for r in lines] == ["a", None]
    again = JsonlSink(path, model="m", resume=True)
    assert again.done == {("id", "a"), ("line", 2)}
    again.add_result(_jreq("b", 3), _out("y"))
    again.commit()
    assert len(path.read_text().splitlines()) == 3


@pytest.mark.parametrize("cut", [1, 10, -1])
def test_torn_last_line_is_truncated(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "out.jsonl"
    sink = JsonlSink(path, model="m", resume=False)
    for i, cid in enumerate("abc", start=1):
        sink.add_result(_jreq(cid, i), _out(cid))
    sink.commit()
    data = path.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[: last_start + cut] if cut > 0 else data[:-1])  # SIGKILL mid-write
    assert recover(path) == {("id", "a"), ("id", "b")}
    assert path.read_bytes() == data[:last_start]


def test_corrupt_middle_line_refuses(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text('{"custom_id": "a", "error": null}\nnot json\n{"custom_id": "b", "error": null}\n')
    with pytest.raises(BatchgenError, match="line 2"):
        recover(path)


SCHEMA = pa.schema([("prompt", pa.string()), ("tag", pa.int64())])


def _preq(row: int) -> Request:
    return Request(key=row, where=f"row {row}", number=row,
                   columns={"prompt": f"p{row}", "tag": row * 10})


def test_parquet_parts_commit_in_input_order(tmp_path: Path) -> None:
    path = tmp_path / "out.parquet"
    sink = ParquetSink(path, SCHEMA, resume=False)
    for row in (2, 0):
        sink.add_result(_preq(row), _out(f"t{row}"))
    sink.flush()
    sink.add_error(_preq(1).fail("invalid_prompt", "empty", "prompt", ""))
    sink.flush()
    parts = sorted(p.name for p in parts_dir(path).iterdir())
    assert parts == ["part-000000.parquet", "part-000001.parquet"]
    assert not path.exists()
    sink.commit()
    assert not parts_dir(path).exists()
    table = pq.read_table(path)
    assert table.column_names == ["prompt", "tag", "generated_text", "finish_reason", "error",
                                  "num_input_tokens", "num_generated_tokens", "num_cached_tokens",
                                  "status_code", "retryable"]
    rows = table.to_pylist()
    assert [r["tag"] for r in rows] == [0, 10, 20]
    assert rows[1]["finish_reason"] == "error" and rows[1]["error"].startswith("row 1: prompt=''")
    assert rows[2]["generated_text"] == "t2" and rows[2]["num_generated_tokens"] == 2


def test_parquet_resume_reads_parts_and_drops_torn_tmp(tmp_path: Path) -> None:
    path = tmp_path / "out.parquet"
    sink = ParquetSink(path, SCHEMA, resume=False)
    sink.add_result(_preq(1), _out("t1"))
    sink.close()  # interrupted: parts stay
    (parts_dir(path) / ".part-000001.parquet.tmp").write_bytes(b"torn")
    again = ParquetSink(path, SCHEMA, resume=True)
    assert again.done == {1}
    assert not list(parts_dir(path).glob(".*.tmp"))
    again.add_result(_preq(0), _out("t0"))
    again.commit()
    assert pq.read_table(path).column("generated_text").to_pylist() == ["t0", "t1"]


def test_parquet_resume_of_completed_output(tmp_path: Path) -> None:
    path = tmp_path / "out.parquet"
    sink = ParquetSink(path, SCHEMA, resume=False)
    for row in range(3):
        sink.add_result(_preq(row), _out(f"t{row}"))
    sink.commit()
    before = pq.read_table(path)
    again = ParquetSink(path, SCHEMA, resume=True)
    assert again.done == {0, 1, 2}
    again.commit()
    assert pq.read_table(path).equals(before)
    assert ROW_COLUMN not in pq.read_table(path).column_names
