"""pandas in, pandas out: rows -> (prompt, SamplingParams), outputs -> added columns; meta calls.

Dask infers a mapped function's output schema by calling it once on fake rows unless `meta=`
is given: `map_partitions` runs `emulate(func, meta_nonempty(ddf._meta), ...)`
(dask/dataframe/dask_expr/_expr.py; `_emulate` in older releases), where `meta_nonempty` makes
two rows of placeholder values ("a"/<NA> for strings, 1 for ints) on an index like [1, 2].
`is_meta_call` recognises that call without loading a model: the call stack holds a frame of
a function named `emulate` or `_emulate` from a `dask` module (a task on a worker or a plain
call never runs inside it). Rows are never judged by their values: a user's frame that happens
to look like dask's fake rows is real data. Should a future dask rename `emulate`, pass `meta=`
(or use `batchgen.cluster.generate_dataframe`, which does).

The answer to a meta call is the input rows plus the output columns with their final dtypes.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

import pandas as pd

from ..io.cells import plain, whole_floats_to_int
from ..io.params import INT_FIELDS, INT_LIST_FIELDS
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..structured.params import StructuredOutputsParams

OUTPUT_COLUMNS = ("generated_text", "num_generated_tokens", "finish_reason", "error")
_EMULATE = frozenset({"emulate", "_emulate"})
_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
JSON_SCHEMA = "json_schema"  # per_row key: a column of JSON schemas (objects or JSON text)


def text_dtype() -> Any:
    """pandas' own dtype for a column of strings: `str` in pandas 3, object before."""
    return pd.Series(["x"]).dtype


def is_meta_call(max_depth: int = 64) -> bool:
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            break
        if frame.f_code.co_name in _EMULATE and str(frame.f_globals.get("__name__", "")).startswith("dask"):
            return True
        frame = frame.f_back
    return False


def check_columns(pdf: pd.DataFrame, prompt_column: str, per_row: Mapping[str, str]) -> None:
    """Raise (before any work) when a named column is missing or a per_row key is no sampling field."""
    if prompt_column not in pdf.columns:
        raise KeyError(f"prompt_column {prompt_column!r} is not a column of the partition; "
                       f"columns: {list(pdf.columns)}")
    for name, column in per_row.items():
        if name not in _SAMPLING_FIELDS and name != JSON_SCHEMA:
            raise TypeError(f"per_row key {name!r} is not a SamplingParams field or {JSON_SCHEMA!r}; "
                            f"known: {sorted(_SAMPLING_FIELDS)}")
        if column not in pdf.columns:
            raise KeyError(f"per_row maps {name!r} to column {column!r}, which the partition does not have; "
                           f"columns: {list(pdf.columns)}")


def read_requests(pdf: pd.DataFrame, prompt_column: str, per_row: Mapping[str, str],
                  base: SamplingParams) -> list[tuple[Any, SamplingParams]]:
    """One (prompt, params) per row, in row order. Missing per-row values (NA) keep `base`'s.

    Values are made plain Python by the one cell conversion file rows use too (io/cells.py):
    numpy scalars, arrays -> lists, a whole-number float for an integer field (a column with NA
    is float) -> an int. Anything else is left for the engine to reject, so only that row fails.
    """
    prompts = [v if isinstance(v, str) else plain(v) for v in pdf[prompt_column].tolist()]  # NA -> None:
    columns = {name: pdf[col].tolist() for name, col in per_row.items()}  # the engine fails that row
    requests: list[tuple[Any, SamplingParams]] = []
    for i, prompt in enumerate(prompts):
        overrides = {}
        for name, values in columns.items():
            value = plain(values[i])
            if value is None:
                continue
            if name == JSON_SCHEMA:
                name, value = "structured_outputs", with_schema(base.structured_outputs, value)
            overrides[name] = value
        overrides = whole_floats_to_int(overrides, INT_FIELDS, INT_LIST_FIELDS)
        requests.append((prompt, replace(base, **overrides) if overrides else base))
    return requests


def with_schema(job: StructuredOutputsParams | None, schema: Any) -> StructuredOutputsParams:
    """A row's json_schema cell as its constraint, keeping the job's structured_outputs options.
    A bad schema (not JSON, not compilable) is judged by the engine, so only that row fails."""
    if isinstance(schema, bytes):
        schema = schema.decode("utf-8", "replace")
    if job is None:
        return StructuredOutputsParams(json=schema)
    return replace(job, json=schema, regex=None, choice=None, grammar=None, json_object=None)


def output_frame(pdf: pd.DataFrame, outputs: list[RequestOutput]) -> pd.DataFrame:
    """The input rows (same index, same order) with the four output columns added."""
    errors = [None if o.error is None else f"row {idx}: {o.error}" for idx, o in zip(pdf.index, outputs)]
    return _with_columns(pdf, [o.text for o in outputs], [o.num_generated_tokens for o in outputs],
                         [o.finish_reason for o in outputs], errors)


def placeholder_output(pdf: pd.DataFrame) -> pd.DataFrame:
    """Schema answer for a meta call or an empty partition: no model is touched."""
    n = len(pdf)
    return _with_columns(pdf, [""] * n, [0] * n, ["length"] * n, [None] * n)


def _with_columns(pdf: pd.DataFrame, text: list[str], num: list[int], reason: list[str],
                  error: list[str | None]) -> pd.DataFrame:
    dtype = text_dtype()
    return pdf.assign(
        generated_text=pd.Series(text, index=pdf.index, dtype=dtype),
        num_generated_tokens=pd.Series(num, index=pdf.index, dtype="int64"),
        finish_reason=pd.Series(reason, index=pdf.index, dtype=dtype),
        error=pd.Series(error, index=pdf.index, dtype=dtype),
    )
