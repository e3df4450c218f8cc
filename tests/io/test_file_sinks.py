"""The sinks on their own: a Parquet dataset's parts and manifest, --retry-errors rewriting a part
without its retryable rows, and JSONL parts on a filesystem that cannot append (memory://)."""
from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.dataset as ds

from batchgen.io.faults import SERVER_CODE
from batchgen.io.jsonl_sink import JsonlPartsSink
from batchgen.io.parquet_sink import ROW_COLUMN, SUCCESS, ParquetSink
from batchgen.io.request import Request, RowError
from batchgen.io.storage import locate
from batchgen.outputs import RequestOutput

SCHEMA = pa.schema([("prompt", pa.string())])


def _row(n: int) -> Request:
    return Request(key=n, where=f"row {n}", number=n, columns={"prompt": f"p{n}"})


def _out(n: int) -> RequestOutput:
    return RequestOutput(n, [1, 2, 3], [4, 5], f"t{n}", "length", num_cached_tokens=1)


def test_dataset_parts_manifest_and_retry(tmp_path: Path) -> None:
    out = tmp_path / "out"
    sink = ParquetSink(out, SCHEMA, resume=False, dataset=True)
    sink.add_result(_row(0), _out(0))
    sink.add_error(_row(1).fail_with(RowError(SERVER_CODE, "model weights unreadable: x")))
    sink.flush()
    sink.add_error(_row(2).fail("invalid_prompt", "empty", "prompt", ""))
    sink.close()  # killed before the commit: no manifest
    assert not (out / SUCCESS).exists()

    assert ParquetSink(out, SCHEMA, resume=True, dataset=True).done == {0, 1, 2}
    again = ParquetSink(out, SCHEMA, resume=True, dataset=True, retry=True)
    assert again.done == {0, 2} and again.done_failed == 1  # the 400 row stays, the 500 row runs again
    again.add_result(_row(1), _out(1))
    again.commit()
    manifest = json.loads((out / SUCCESS).read_text())
    assert manifest["rows"] == 3 and manifest["parts"] == ["part-000000.parquet", "part-000001.parquet",
                                                           "part-000002.parquet"]
    rows = sorted(ds.dataset(out, format="parquet").to_table().to_pylist(), key=lambda r: r[ROW_COLUMN])
    assert [(r["prompt"], r["status_code"], r["generated_text"]) for r in rows] == [
        ("p0", 200, "t0"), ("p1", 200, "t1"), ("p2", 400, None)]
    assert rows[0]["num_input_tokens"] == 3 and rows[0]["num_generated_tokens"] == 2
    assert rows[0]["num_cached_tokens"] == 1


def test_jsonl_parts_on_a_filesystem_without_append() -> None:
    fs = fsspec.filesystem("memory")
    loc = locate("memory://sinks/out.jsonl", flag="--output")
    reqs = [Request(key=("id", f"r{i}"), where=f"line {i + 1}", number=i + 1, custom_id=f"r{i}") for i in range(3)]
    sink = JsonlPartsSink(loc, model="m", resume=False)
    sink.add_result(reqs[0], _out(0))
    sink.flush()
    sink.add_error(reqs[1].fail_with(RowError(SERVER_CODE, "cannot resume here: lost")))
    sink.close()
    assert not fs.exists("/sinks/out.jsonl") and len(fs.glob("/sinks/out.jsonl.parts/part-*")) == 2

    again = JsonlPartsSink(loc, model="m", resume=True, retry=True)
    assert again.done == {("id", "r0")}
    again.add_result(reqs[1], _out(1))
    again.add_result(reqs[2], _out(2))
    again.commit()
    lines = [json.loads(x) for x in fs.cat("/sinks/out.jsonl").decode().splitlines()]
    assert sorted(r["custom_id"] for r in lines) == ["r0", "r1", "r2"]
    assert all(r["response"]["status_code"] == 200 for r in lines)
    assert not fs.exists("/sinks/out.jsonl.parts")
