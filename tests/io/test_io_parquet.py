"""Parquet jobs without a model: a backend that answers each row with its prompt's ids, in an
order other than the input's, so parts and the commit's sort are exercised.

The output keeps the input's pandas metadata: ``pd.read_parquet(output)`` has the index of
``pd.read_parquet(input)``, whatever finished when, across parts and a resume.
"""
from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io.job import run_job
from batchgen.io.parquet import ParquetReader
from batchgen.io.parquet_sink import ParquetSink, output_metadata, parts_dir
from batchgen.io.rows import RowContext
from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams

# the columns a text job adds (the DataFrame path's), then whose fault a failed row is
OUTPUT_NAMES = ["generated_text", "finish_reason", "error", "num_input_tokens", "num_generated_tokens",
                "num_cached_tokens", "status_code", "retryable"]

CTX = RowContext(None, 320, 128, {"max_tokens": 4})  # token-id prompts need no tokenizer


class _Echo:
    """Answers each chunk of rows last-first; ``stop_after`` results, then Ctrl-C."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.left = stop_after
        self.seen: list[SamplingParams] = []

    def run(self, requests: Iterable[tuple[list[int], SamplingParams]],
            max_in_flight: int) -> Iterator[tuple[int, RequestOutput]]:
        chunk: list[tuple[int, list[int]]] = []
        for position, (ids, params) in enumerate(requests):
            self.seen.append(params)
            chunk.append((position, ids))
            if len(chunk) == max_in_flight:
                yield from self._answer(chunk)
        yield from self._answer(chunk)

    def _answer(self, chunk: list[tuple[int, list[int]]]) -> Iterator[tuple[int, RequestOutput]]:
        while chunk:
            position, ids = chunk.pop()
            if self.left is not None:
                if self.left == 0:
                    raise KeyboardInterrupt
                self.left -= 1
            yield position, RequestOutput(position, ids, ids[:2], f"t{ids[0]}", "length")


def _run(src: Path, out: Path, backend: _Echo | None = None, resume: bool = False,
         **reader_kw: object) -> None:
    reader = ParquetReader(src, CTX, **reader_kw)  # type: ignore[arg-type]
    sink = ParquetSink(out, reader.schema, resume=resume)
    sink.flush_rows = 2
    run_job(reader.requests(sink.done), sink, backend or _Echo(), chunk_size=3, flush_seconds=1e9)


def _frame(n: int = 7) -> pd.DataFrame:
    return pd.DataFrame({"prompt": [[i + 1, i + 2] for i in range(n)],
                         "tag": [f"x{i}" for i in range(n)]})


INDEXES: dict[str, Callable[[int], pd.Index]] = {
    "default_range": lambda n: pd.RangeIndex(n),
    "range_5_step_2": lambda n: pd.RangeIndex(5, 5 + 2 * n, 2),
    "named_range": lambda n: pd.RangeIndex(n, name="row"),
    "named_strings": lambda n: pd.Index([f"doc{i}" for i in range(n)][::-1], name="doc"),
    "unnamed_ints": lambda n: pd.Index([3 * i * i for i in range(n)]),
    "datetimes": lambda n: pd.date_range("2024-01-01", periods=n, freq="h", tz="UTC", name="at"),
    "multi": lambda n: pd.MultiIndex.from_arrays([[i // 3 for i in range(n)],
                                                  [f"k{i}" for i in range(n)]], names=["g", "k"]),
}


@pytest.mark.parametrize("make_index", INDEXES.values(), ids=INDEXES.keys())
def test_output_keeps_the_pandas_index(tmp_path: Path,
                                       make_index: Callable[[int], pd.Index]) -> None:
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    df = _frame()
    df.index = make_index(len(df))
    df.to_parquet(src)
    _run(src, out)
    want, got = pd.read_parquet(src), pd.read_parquet(out)
    pd.testing.assert_index_equal(got.index, want.index, exact=True)
    pd.testing.assert_frame_equal(got[want.columns], want)
    assert got["generated_text"].tolist() == [f"t{i + 1}" for i in range(len(df))]
    assert list(got.columns) == [*want.columns, *OUTPUT_NAMES]


def test_index_survives_interrupt_and_resume(tmp_path: Path) -> None:
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    df = _frame(9).set_index(pd.RangeIndex(100, 109, name="n"))
    df.to_parquet(src)
    with pytest.raises(KeyboardInterrupt):
        _run(src, out, _Echo(stop_after=4))
    parts = sorted(parts_dir(out).glob("part-*.parquet"))
    assert len(parts) == 2 and not out.exists()
    sink_metadata = ParquetSink(tmp_path / "other.parquet", pq.read_schema(src),
                                resume=False).schema.metadata
    assert all(pq.read_schema(p).metadata == sink_metadata for p in parts)  # fixed at open
    _run(src, out, resume=True)
    pd.testing.assert_index_equal(pd.read_parquet(out).index, pd.read_parquet(src).index)
    _run(src, out, resume=True)  # resuming a completed output keeps it too
    pd.testing.assert_index_equal(pd.read_parquet(out).index, pd.read_parquet(src).index)


@pytest.mark.parametrize("labels", [[("a", "prompt"), ("b", "tag")], [0, 1]],
                         ids=["multiindex_columns", "integer_columns"])
def test_column_header_that_cannot_label_the_new_columns_is_dropped(tmp_path: Path,
                                                                    labels: list[Any]) -> None:
    """Only the header goes: the index is still the input's, the columns are named as in the
    Parquet file (a MultiIndex or integer header cannot also hold "generated_text")."""
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    df = _frame(4)
    df.columns = pd.MultiIndex.from_tuples(labels) if isinstance(labels[0], tuple) else labels
    df.index = pd.Index(list("wxyz"), name="doc")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pandas: non-string column names do not round-trip
        df.to_parquet(src)
    names = pq.read_schema(src).names
    _run(src, out, prompt_column=names[0])
    got = pd.read_parquet(out)
    pd.testing.assert_index_equal(got.index, pd.read_parquet(src).index)
    assert list(got.columns) == [*names[:2], *OUTPUT_NAMES]
    assert got[names[1]].tolist() == df.iloc[:, 1].tolist()


def test_only_pandas_metadata_is_carried(tmp_path: Path) -> None:
    """Other metadata (here Hugging Face datasets' features) lists the input's columns as all
    there are; a file with no pandas metadata gives an output with none."""
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    table = pa.Table.from_pandas(_frame(3).set_index(pd.Index([9, 8, 7], name="doc")))
    features = {b"huggingface": json.dumps({"info": {"features": {"prompt": {}}}}).encode()}
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, **features}), src)
    _run(src, out)
    assert set(pq.read_schema(out).metadata) == {b"pandas"}
    assert pd.read_parquet(out).index.tolist() == [9, 8, 7]
    pq.write_table(pa.table({"prompt": [[1], [2]]}), src)
    _run(src, tmp_path / "plain.parquet")
    assert pq.read_schema(tmp_path / "plain.parquet").metadata is None
    assert output_metadata(pa.schema([("prompt", pa.string())], metadata={b"pandas": b"{oops"})) is None


def test_integer_param_column_with_nulls_from_pandas(tmp_path: Path) -> None:
    """pandas stores an int column with nulls as float64: 3.0 is max_tokens 3; 2.5 fails its row."""
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    df = _frame(4).assign(max_tok=[3, None, 2.5, 5])
    assert df["max_tok"].dtype == "float64"
    df.to_parquet(src)
    backend = _Echo()
    _run(src, out, backend, param_columns={"max_tokens": "max_tok"})
    assert [p.max_tokens for p in backend.seen] == [3, 4, 5]  # row 1: null -> the job default
    assert all(type(p.max_tokens) is int for p in backend.seen)
    errors = pd.read_parquet(out)["error"].tolist()
    assert errors[2].startswith("row 2: max_tokens must be an integer >= 1, got 2.5")
    assert [pd.isna(e) for e in errors] == [True, True, False, True]
