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
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError
from batchgen.io.params import FIELD_NAMES, ROW_FIELDS
from batchgen.io.request import Request, RowKey
from batchgen.io.rows import RowContext, is_messages, set_params, set_prompt

OUTPUT_COLUMNS = pa.schema([
    ("generated_text", pa.string()), ("num_generated_tokens", pa.int64()),
    ("finish_reason", pa.string()), ("error", pa.string()),
])
_PARAM_ALIASES = frozenset({"max_completion_tokens"})


class ParquetReader:
    """Rows of ``path`` as ``Request``s; the key of a row is its 0-based number."""

    def __init__(self, path: Path, ctx: RowContext, *, prompt_column: str = "prompt",
                 id_column: str | None = None, param_columns: Mapping[str, str] | None = None,
                 per_row_params: bool = False, batch_rows: int = 1024) -> None:
        self.path, self.ctx, self.batch_rows = path, ctx, batch_rows
        self.prompt_column, self.id_column = prompt_column, id_column
        self.schema = read_schema(path)
        names = self.schema.names
        params = dict(param_columns or {})
        if per_row_params:
            params.update({n: n for n in names if n in FIELD_NAMES and n not in params.values()})
        self.param_columns = params
        check_columns(path, names, prompt_column, id_column, params)

    def count(self) -> int:
        return pq.ParquetFile(self.path).metadata.num_rows

    def requests(self, skip: set[RowKey] | frozenset[RowKey] = frozenset()) -> Iterator[Request]:
        seen: dict[Any, int] = {}  # id -> first row
        number = 0
        for batch in pq.ParquetFile(self.path).iter_batches(batch_size=self.batch_rows):
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


def read_schema(path: Path) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except (OSError, pa.ArrowException) as exc:
        raise BatchgenError(f"cannot read {path} as Parquet: {exc}") from None


def check_columns(path: Path, names: list[str], prompt_column: str, id_column: str | None,
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
            raise BatchgenError(f"{flag}: {path} has no column {column!r} "
                                f"(columns: {', '.join(names)})")
    clash = [n for n in OUTPUT_COLUMNS.names if n in names]
    if clash:
        raise BatchgenError(f"{path} already has output column(s) {clash}; rename them first")
