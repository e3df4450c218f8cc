"""Parquet input: one request per row, read a record batch at a time.

The prompt column holds text, token ids, or chat messages (a list of {role, content} structs).
Sampling fields can come from columns: ``param_columns`` maps a SamplingParams field to the
column that holds it (``--param-column max_tokens=max_tok``; ``--per-row-params`` maps every
column named like a field). A null cell means "the job default". Every input column is passed
through to the output, followed by ``OUTPUT_COLUMNS``.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.errors import BatchgenError
from batchgen.io.params import FIELD_NAMES, ROW_FIELDS
from batchgen.io.request import Request, RowKey
from batchgen.io.rows import RowContext, is_messages, set_params, set_prompt
from batchgen.io.source import Source

# The DataFrame path's names and types (batchgen.generate), so both write the same columns;
# the token counts are the JSONL ``usage`` numbers.
OUTPUT_COLUMNS = pa.schema([
    ("generated_text", pa.string()), ("finish_reason", pa.string()), ("error", pa.string()),
    ("num_input_tokens", pa.int64()), ("num_generated_tokens", pa.int64()), ("num_cached_tokens", pa.int64()),
])
_TOP = pa.struct([("token", pa.string()), ("logprob", pa.float64())])
LOGPROBS_TYPE = pa.list_(pa.struct([("token", pa.string()), ("logprob", pa.float64()),
                                    ("top_logprobs", pa.list_(_TOP))]))


# whose fault a failed row is (io/faults.py): 200, 400 or 500, and whether --retry-errors reruns it
STATUS_COLUMNS = pa.schema([("status_code", pa.int64()), ("retryable", pa.bool_())])


def output_columns(logprobs: bool) -> pa.Schema:
    """The columns a text job adds; ``logprobs`` only where a row may ask for them."""
    lp = [pa.field("logprobs", LOGPROBS_TYPE)] if logprobs else []
    return pa.schema([*OUTPUT_COLUMNS, *lp, *STATUS_COLUMNS])
_PARAM_ALIASES = frozenset({"max_completion_tokens"})


class ParquetReader:
    """Rows of ``path`` (a file, or a dataset of parts read in name order, hive partition
    columns included) as ``Request``s; the key of a row is its 0-based number across parts."""

    def __init__(self, path: Source | Path, ctx: RowContext, *, prompt_column: str = "prompt",
                 id_column: str | None = None, param_columns: Mapping[str, str] | None = None,
                 per_row_params: bool = False, batch_rows: int = 1024) -> None:
        self.path = path if isinstance(path, Source) else Source.open(path)
        self.ctx, self.batch_rows = ctx, batch_rows
        self.prompt_column, self.id_column = prompt_column, id_column
        self.schema = read_schema(self.path)
        names = self.schema.names
        params = dict(param_columns or {})
        if per_row_params:
            params.update({n: n for n in names if n in FIELD_NAMES and n not in params.values()})
        self.param_columns = params
        check_columns(path, names, prompt_column, id_column, params)

    def count(self) -> int:
        return self.path.arrow_dataset().count_rows()

    def requests(self, skip: set[RowKey] | frozenset[RowKey] = frozenset()) -> Iterator[Request]:
        seen: dict[Any, int] = {}  # id -> first row
        number = 0
        # in file order (fragments as listed), each file's rows in order: row numbers are stable
        for batch in self.path.arrow_dataset().to_batches(batch_size=self.batch_rows, use_threads=False):
            for columns in batch.to_pylist():
                req = self._identify(number, columns, seen)
                if number not in skip:
                    if req.is_valid:
                        self._complete(req)
                    yield req
                number += 1

    def _identify(self, number: int, columns: dict[str, Any], seen: dict[Any, int]) -> Request:
        req = Request(key=number, where=f"row {number}", number=number, columns=columns)
        if self.id_column is None:
            return req
        rid = columns[self.id_column]
        req.where = f"row {number} ({self.id_column}={rid!r})"
        if rid is None:
            req.fail("missing_id", "missing", self.id_column)
        elif rid in seen:
            req.fail("duplicate_id", f"already used on row {seen[rid]}", self.id_column, rid)
        else:
            seen[rid] = number
        return req

    def _complete(self, req: Request) -> None:
        fields = {f: req.columns[c] for f, c in self.param_columns.items()
                  if req.columns[c] is not None}
        set_params(req, fields, self.ctx)
        if req.is_valid:
            prompt = req.columns[self.prompt_column]
            req.chat = is_messages(prompt)
            set_prompt(req, prompt, self.prompt_column, self.ctx)


def read_schema(path: Source | Path) -> pa.Schema:
    source = path if isinstance(path, Source) else Source.open(path)
    try:
        return source.arrow_dataset().schema
    except (OSError, pa.ArrowException) as exc:
        raise BatchgenError(f"cannot read {source.loc.url} as Parquet: {exc}") from None


def check_columns(path: Any, names: list[str], prompt_column: str, id_column: str | None,
                  param_columns: Mapping[str, str]) -> None:
    """Fail fast, before any work, on a column that is missing or would be overwritten."""
    wanted = {prompt_column: "--prompt-column"}
    if id_column is not None:
        wanted[id_column] = "--id-column"
    for field, column in param_columns.items():
        if field not in ROW_FIELDS and field not in _PARAM_ALIASES:
            raise BatchgenError(f"--param-column {field}={column}: {field!r} is not a "
                                "sampling parameter")
        wanted[column] = "--param-column"
    for column, flag in wanted.items():
        if column not in names:
            raise BatchgenError(f"{flag}: {_name(path)} has no column {column!r} "
                                f"(columns: {', '.join(names)})")
    clash = [n for n in OUTPUT_COLUMNS.names if n in names]
    if clash:
        raise BatchgenError(f"{_name(path)} already has output column(s) {clash}; rename them first")


def _name(path: Any) -> str:
    return path.loc.url if isinstance(path, Source) else str(path)
