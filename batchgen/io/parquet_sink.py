"""Resumable Parquet output on any filesystem: part files written as rows finish, then a commit.

Each flush writes one part, whole or not at all: an object store publishes a PUT at once, a
local part is written under a temporary name and renamed into place. Parts carry the input row
number (``ROW_COLUMN``; a JSONL input's line) and ``--resume`` reads the keys of the parts as
done, so after a SIGKILL every row is written exactly once.

Two layouts (``dataset``):

- a dataset (``--output out/``, any name without ``.parquet``): the parts are the output,
  ``<out>/part-NNNNNN.parquet``; the commit only writes ``<out>/_SUCCESS`` (a small JSON
  manifest) last, so memory stays bounded whatever the row count. Readers (pyarrow, Dask,
  Spark) skip ``_`` and ``.`` files; rows are in finishing order, ``ROW_COLUMN`` restores the
  input's.
- one file (``--output out.parquet``, for small jobs): parts go to ``<out>.parts/`` and the
  commit merges them in input order into ``<out>`` (reading every part: memory grows with the job).

The input's pandas metadata (``b"pandas"``) is carried to the output, so ``pd.read_parquet``
gives the output the input's index (see ``output_metadata``). Another kind of job writes its own
columns (``columns``) and says how a stored row's key is read back (``key_columns``, ``keys``)
and where a completed output's rows stand (``row_numbers``).
"""
from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError
from batchgen.io.faults import fault_of
from batchgen.io.logprobs import logprob_cell
from batchgen.io.openai_batch import row_key
from batchgen.io.parquet import output_columns
from batchgen.io.request import Request, RowKey
from batchgen.io.storage import Location, locate, write_atomic

if TYPE_CHECKING:
    from batchgen.outputs import RequestOutput
    from batchgen.tokenizer import Tokenizer

ROW_COLUMN = "__batchgen_row__"
SUCCESS = "_SUCCESS"
# A JSONL input's rows written as Parquet: what identifies each, before the output columns.
JSONL_KEY_COLUMNS = pa.schema([("custom_id", pa.string()), ("line", pa.int64()), ("error_code", pa.string())])
STATUS_COLUMNS = ("status_code", "retryable")  # read back on --resume, where a job writes them


def parts_dir(output: Path) -> Path:
    return output.with_name(output.name + ".parts")


def as_location(path: Path | Location | str) -> Location:
    return path if isinstance(path, Location) else locate(path, flag="--output")


class ParquetSink:
    flush_rows = 1024
    key_columns: tuple[str, ...] = (ROW_COLUMN,)  # what ``keys`` reads of a part

    def __init__(self, path: Path | Location | str, input_schema: pa.Schema, *, resume: bool,
                 columns: pa.Schema | None = None, dataset: bool = False, retry: bool = False,
                 tokenizer: Tokenizer | None = None, jsonl_input: bool = False) -> None:
        """columns: the job's own, written after the input's (text: ``output_columns(...)``).
        retry: rows that ended in a retryable error are dropped from the parts and run again.
        jsonl_input: the rows are an OpenAI batch file's, keyed by custom_id or line."""
        columns = output_columns(False) if columns is None else columns
        self.loc = as_location(path)
        self.fs = self.loc.fs
        self.path = self.loc.local_path() if self.loc.is_local else self.loc.url  # what image sinks write beside
        self.dataset, self.tokenizer, self.jsonl_input = dataset, tokenizer, jsonl_input
        if jsonl_input:
            self.key_columns = tuple(JSONL_KEY_COLUMNS.names)
        head = [*JSONL_KEY_COLUMNS] if jsonl_input else [*input_schema]
        self.schema = pa.schema([*head, *columns, (ROW_COLUMN, pa.int64())],
                                metadata=None if jsonl_input else output_metadata(input_schema))
        self.with_logprobs = "logprobs" in columns.names
        self.parts = self.loc.path.rstrip("/") if dataset else self.loc.path + ".parts"
        self._rows: list[dict[str, Any]] = []
        self.done: set[RowKey] = set()
        self.done_failed = 0  # of ``done``: rows that ended in an error
        if dataset and self.fs.exists(self._success):
            self.fs.rm(self._success)  # no longer complete once anything may change
        if not resume:
            self._remove_parts()
        elif not dataset and not self.fs.exists(self.parts) and self.fs.exists(self.loc.path):
            self._adopt_output()
        self.fs.makedirs(self.parts, exist_ok=True)
        if self.loc.is_local:
            for tmp in Path(self.parts).glob(".*.tmp"):
                tmp.unlink()  # a part the last run was killed while writing
        self._next = 0
        for part in self._part_files():
            self._read_back(part, retry)
            self._next = int(posixpath.basename(part).split("-")[1].split(".")[0]) + 1

    @property
    def _success(self) -> str:
        return self.loc.path.rstrip("/") + "/" + SUCCESS

    def _part_files(self) -> list[str]:
        return sorted(self.fs.glob(self.parts + "/part-*.parquet"))

    def _remove_parts(self) -> None:
        for part in self._part_files():
            self.fs.rm(part)
        if not self.dataset and self.fs.exists(self.parts):
            self.fs.rm(self.parts, recursive=True)

    def _read_back(self, part: str, retry: bool) -> None:
        """Count a part's rows as done; with ``retry`` first rewrite it (in place, atomically)
        without its retryable errors, which then run again."""
        names = [c for c in (*self.key_columns, *STATUS_COLUMNS) if c in self.schema.names]
        if retry and "retryable" in self.schema.names:
            table = pq.read_table(part, filesystem=self.fs)
            again = pc.fill_null(table["retryable"], False)
            if pc.any(again).as_py():
                table = table.filter(pc.invert(again))
                self._write(table, part)
            table = table.select(names)
        else:
            table = pq.read_table(part, columns=names, filesystem=self.fs)
        self.done.update(self.keys(table))
        if "status_code" in table.column_names:
            codes = table["status_code"].to_pylist()
            self.done_failed += sum(1 for c in codes if c is not None and c != 200)

    @property
    def pending(self) -> int:
        return len(self._rows)

    def add_result(self, req: Request, out: RequestOutput) -> None:
        values = {"generated_text": out.text, "finish_reason": out.finish_reason, "error": None,
                  "num_input_tokens": out.num_prompt_tokens, "num_generated_tokens": out.num_generated_tokens,
                  "num_cached_tokens": out.num_cached_tokens, "status_code": 200, "retryable": False}
        if self.with_logprobs:
            values["logprobs"] = logprob_cell(out, self.tokenizer)
        self.add_row(req, values)

    def add_error(self, req: Request) -> None:
        assert req.error is not None
        fault = fault_of(req.error.code)
        self.add_row(req, {"generated_text": None, "finish_reason": "error", "error": req.error.message,
                           "num_input_tokens": 0, "num_generated_tokens": 0, "num_cached_tokens": 0,
                           "status_code": fault.status, "retryable": fault.retryable,
                           "error_code": req.error.code})

    def add_row(self, req: Request, values: dict[str, Any]) -> None:
        """Buffer ``req``'s output row: its input columns (or JSONL keys), then ``values``."""
        head = ({"custom_id": req.custom_id, "line": req.number} if self.jsonl_input else req.columns)
        self._rows.append({**head, **values, ROW_COLUMN: req.number})

    def keys(self, table: pa.Table) -> Iterable[RowKey]:
        """The keys of the input rows that ``table``'s rows (``key_columns`` of them) answer."""
        if self.jsonl_input:
            return [row_key(*row) for row in zip(*(table[c].to_pylist() for c in self.key_columns))]
        return table[ROW_COLUMN].to_pylist()

    def row_numbers(self, table: pa.Table) -> pa.Array:
        """A completed output's row numbers: its positions, as it lists rows in input order."""
        if self.jsonl_input:
            return table["line"].combine_chunks()
        return pa.array(range(table.num_rows), pa.int64())

    def flush(self) -> None:
        if self._rows:
            table = pa.Table.from_pylist(self._rows, schema=self.schema)
            self._write(table, f"{self.parts}/part-{self._next:06d}.parquet")
            self._next += 1
            self._rows.clear()

    def commit(self) -> None:
        """A dataset: write the manifest last. One file: merge the parts in input row order."""
        self.flush()
        files = self._part_files()
        if self.dataset:
            rows = sum(pq.ParquetFile(f, filesystem=self.fs).metadata.num_rows for f in files)
            manifest = {"rows": rows, "parts": [posixpath.basename(f) for f in files], "row_column": ROW_COLUMN}
            write_atomic(self.fs, self._success, (json.dumps(manifest, indent=1) + "\n").encode())
            return
        tables = [pq.read_table(f, schema=self.schema, filesystem=self.fs) for f in files]
        table = pa.concat_tables(tables) if tables else self.schema.empty_table()
        table = table.sort_by(ROW_COLUMN).drop_columns([ROW_COLUMN])
        table = table.replace_schema_metadata(self.schema.metadata)
        self._write(table, self.loc.path)
        self.fs.rm(self.parts, recursive=True)

    def close(self) -> None:
        """Keep what is finished as parts; the output stays resumable."""
        self.flush()

    def _write(self, table: pa.Table, path: str) -> None:
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        write_atomic(self.fs, path, sink.getvalue().to_pybytes())

    def _adopt_output(self) -> None:
        """A completed single-file output becomes part 0, so its rows count as done. The parts
        directory appears only once that part is whole: an adoption that fails leaves no trace."""
        table = pq.read_table(self.loc.path, filesystem=self.fs)
        try:
            table = table.append_column(ROW_COLUMN, self.row_numbers(table))
            table = table.select(self.schema.names).cast(self.schema)
        except (ValueError, KeyError, pa.ArrowInvalid) as exc:
            raise BatchgenError(f"--resume: {self.loc.url} does not have the columns this input produces "
                                f"({exc}); use --overwrite to start over") from None
        if self.loc.is_local:
            import os
            import shutil

            staging = Path(self.parts).with_name(f".{Path(self.parts).name}.tmp")
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            self._write(table, str(staging / "part-000000.parquet"))
            os.replace(staging, self.parts)
        else:
            self._write(table, f"{self.parts}/part-000000.parquet")


def output_metadata(input_schema: pa.Schema) -> dict[bytes, bytes] | None:
    """The schema metadata of the output: the input's pandas metadata, or None.

    It describes the input's columns only; pandas reads the added columns by their Arrow types.
    Its column header description (``column_indexes``) is kept only for the common header, one
    level of string labels: a header that cannot also label the added string-named columns (a
    MultiIndex, integer labels) is dropped. Other schema metadata (e.g. Hugging Face
    ``datasets`` features) lists the input's columns as all there are, so it is not carried."""
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
