"""Resumable Parquet output: part files, then one atomic commit.

While the job runs, each flush writes ``<output>.parts/part-NNNNNN.parquet`` under a temporary
name and renames it into place, so a part is either whole or absent. Parts carry the input row
number (``ROW_COLUMN``); the commit sorts by it, so the output lists rows in input order, writes
``<output>`` the same atomic way and removes the parts. ``--resume`` reads the row numbers of the
parts (or, after a completed run, of the output itself) as done.

The input's pandas metadata (``b"pandas"``) is carried to the output, so ``pd.read_parquet``
gives the output the input's index: an index stored as columns passes through like any column,
and a ``RangeIndex`` stored as metadata stays right because the output holds every input row
once, in input order. It is fixed when the sink opens, identical in every part, and describes
the input's columns only; pandas reads the added columns by their Arrow types. Its column
header description (``column_indexes``) is kept only for the common header, one level of string
labels: a header that cannot also label the added string-named columns (a MultiIndex, integer
labels) is dropped, and those columns come back labelled by their Parquet names. Other schema
metadata (e.g. Hugging Face ``datasets`` features) lists the input's columns as all there are,
so it is not carried.

Another kind of job writes its own columns (``columns``) and says how a stored row's key is
read back (``key_columns``, ``keys``) and where a completed output's rows stand (``row_numbers``).
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError
from batchgen.io.parquet import OUTPUT_COLUMNS
from batchgen.io.request import Request, RowKey

if TYPE_CHECKING:
    from batchgen.outputs import RequestOutput

ROW_COLUMN = "__batchgen_row__"


def parts_dir(output: Path) -> Path:
    return output.with_name(output.name + ".parts")


class ParquetSink:
    flush_rows = 1024
    key_columns: tuple[str, ...] = (ROW_COLUMN,)  # what ``keys`` reads of a part

    def __init__(self, path: Path, input_schema: pa.Schema, *, resume: bool,
                 columns: pa.Schema = OUTPUT_COLUMNS) -> None:
        """columns: the job's own, written after the input's (text: ``OUTPUT_COLUMNS``)."""
        self.path, self.parts = path, parts_dir(path)
        self.schema = pa.schema([*input_schema, *columns, (ROW_COLUMN, pa.int64())],
                                metadata=output_metadata(input_schema))
        self._rows: list[dict[str, Any]] = []
        self.done: set[RowKey] = set()
        if not resume:
            shutil.rmtree(self.parts, ignore_errors=True)
        elif not self.parts.is_dir() and path.exists():
            self._adopt_output()
        self.parts.mkdir(parents=True, exist_ok=True)
        for tmp in self.parts.glob(".*.tmp"):
            tmp.unlink()  # a part the last run was killed while writing
        self._next = 0
        for part in sorted(self.parts.glob("part-*.parquet")):
            self.done.update(self.keys(pq.read_table(part, columns=list(self.key_columns))))
            self._next = int(part.stem.split("-")[1]) + 1

    @property
    def pending(self) -> int:
        return len(self._rows)

    def add_result(self, req: Request, out: RequestOutput) -> None:
        self.add_row(req, {"generated_text": out.text, "num_generated_tokens": out.num_generated_tokens,
                           "finish_reason": out.finish_reason, "error": None})

    def add_error(self, req: Request) -> None:
        assert req.error is not None
        self.add_row(req, {"generated_text": None, "num_generated_tokens": 0,
                           "finish_reason": "error", "error": req.error.message})

    def add_row(self, req: Request, values: dict[str, Any]) -> None:
        """Buffer ``req``'s output row: its input columns, then ``values`` of the job's columns."""
        self._rows.append({**req.columns, **values, ROW_COLUMN: req.number})

    def keys(self, table: pa.Table) -> Iterable[RowKey]:
        """The keys of the input rows that ``table``'s rows (``key_columns`` of them) answer."""
        return table[ROW_COLUMN].to_pylist()

    def row_numbers(self, table: pa.Table) -> pa.Array:
        """A completed output's row numbers: its positions, as it lists rows in input order."""
        return pa.array(range(table.num_rows), pa.int64())

    def flush(self) -> None:
        if self._rows:
            table = pa.Table.from_pylist(self._rows, schema=self.schema)
            _write_atomic(table, self.parts / f"part-{self._next:06d}.parquet")
            self._next += 1
            self._rows.clear()

    def commit(self) -> None:
        """Merge the parts into the output file, in input row order."""
        self.flush()
        files = sorted(self.parts.glob("part-*.parquet"))
        tables = [pq.read_table(f, schema=self.schema) for f in files]
        table = pa.concat_tables(tables) if tables else self.schema.empty_table()
        table = table.sort_by(ROW_COLUMN).drop_columns([ROW_COLUMN])
        table = table.replace_schema_metadata(self.schema.metadata)
        _write_atomic(table, self.path)
        shutil.rmtree(self.parts)

    def close(self) -> None:
        """Keep what is finished as parts; the output stays resumable."""
        self.flush()

    def _adopt_output(self) -> None:
        """A completed output becomes part 0, so its rows count as done. The parts directory
        appears only once that part is whole: an adoption that fails leaves no trace."""
        table = pq.read_table(self.path)
        try:
            table = table.append_column(ROW_COLUMN, self.row_numbers(table)).cast(self.schema)
        except (ValueError, KeyError, pa.ArrowInvalid) as exc:
            raise BatchgenError(f"--resume: {self.path} does not have the columns this input produces "
                                f"({exc}); use --overwrite to start over") from None
        staging = self.parts.with_name(f".{self.parts.name}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        _write_atomic(table, staging / "part-000000.parquet")
        os.replace(staging, self.parts)


def output_metadata(input_schema: pa.Schema) -> dict[bytes, bytes] | None:
    """The schema metadata of the output: the input's pandas metadata (see the module
    docstring), or None."""
    raw = (input_schema.metadata or {}).get(b"pandas")
    if raw is None:
        return None
    try:
        pandas = json.loads(raw)
    except ValueError:
        return None  # not pandas' own: nothing to keep
    if not isinstance(pandas, dict):
        return None
    header = pandas.get("column_indexes")
    if (isinstance(header, list) and len(header) == 1 and isinstance(header[0], dict)
            and header[0].get("pandas_type") == "unicode"):
        return {b"pandas": raw}
    return {b"pandas": json.dumps({**pandas, "column_indexes": []}).encode()}


def _write_atomic(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
