"""pandas in, pandas out: rows -> (prompt, SamplingParams), outputs -> added columns; meta calls.

Dask infers a mapped function's output schema by calling it once on fake rows unless `meta=` is
given. `is_meta_partition` recognises that call by what Dask documents: a real partition task
of `map_partitions` is handed `partition_info` (a function with that keyword gets it), the
inference call is not, and its rows are `dask.dataframe.utils.meta_nonempty` of the frame's
schema. A user's own call with such placeholder rows reads the same; pass `partition_info` (any
dict) to have it run, or give Dask `meta=batchgen.output_meta(ddf, ...)` and no inference call
is made. See docs/guides/chat-dataframe.md.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import pandas as pd

from ..errors import RequestError
from ..io.cells import plain, whole_floats_to_int
from ..io.params import CHAT_TEMPLATE_KWARGS, INT_FIELDS, INT_LIST_FIELDS, FieldError, chat_template_kwargs
from ..io.rows import messages_from_cell
from ..sampling_params import SamplingParams
from ..structured.params import StructuredOutputsParams
from ..tokenizer import ChatPrompt
from .output_columns import BASE_COLUMNS

OUTPUT_COLUMNS = BASE_COLUMNS  # the columns every generate call adds (logprobs only when asked for)

_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
JSON_SCHEMA = "json_schema"  # per_row key: a column of JSON schemas (objects or JSON text)
ROW_KEYS = _SAMPLING_FIELDS | {JSON_SCHEMA, CHAT_TEMPLATE_KWARGS}


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How a messages column becomes prompts: the template's variables and whether the
    assistant turn is opened (as vLLM's and transformers' `add_generation_prompt`)."""

    column: str
    chat_template_kwargs: Mapping[str, Any] | None = None
    add_generation_prompt: bool = True


def text_dtype() -> Any:
    """pandas' own dtype for a column of strings: `str` in pandas 3, object before."""
    return pd.Series(["x"]).dtype


def is_meta_partition(pdf: pd.DataFrame, partition_info: Mapping[str, Any] | None) -> bool:
    """Whether `pdf` is Dask's meta inference call (see the module docstring); no model is needed."""
    if partition_info is not None or len(pdf) == 0 or _in_dask_task():
        return False
    from dask.dataframe.utils import meta_nonempty

    fake = meta_nonempty(pdf.iloc[:0])  # cheap: a few rows from the schema alone
    return bool(len(fake) == len(pdf) and fake.index.equals(pdf.index) and (fake.dtypes == pdf.dtypes).all()
                and fake.equals(pdf))


def _in_dask_task() -> bool:
    """A distributed worker's task thread: never the client's inference call."""
    distributed = sys.modules.get("distributed.worker")
    return distributed is not None and getattr(distributed.thread_state, "key", None) is not None


def check_columns(pdf: pd.DataFrame, prompt_column: str, per_row: Mapping[str, str],
                  chat: ChatOptions | None = None) -> None:
    """Raise (before any work) when a named column is missing or a per_row key is unknown."""
    if chat is not None:
        if chat.column not in pdf.columns:
            raise KeyError(f"messages_column {chat.column!r} is not a column of the partition; "
                           f"columns: {list(pdf.columns)}")
        if not isinstance(chat.add_generation_prompt, bool):
            raise TypeError(f"add_generation_prompt must be True or False, got {chat.add_generation_prompt!r}")
        if chat.chat_template_kwargs is not None:
            try:
                chat_template_kwargs(chat.chat_template_kwargs)
            except FieldError as exc:
                raise TypeError(str(exc)) from None
    elif prompt_column not in pdf.columns:
        raise KeyError(f"prompt_column {prompt_column!r} is not a column of the partition; "
                       f"columns: {list(pdf.columns)}")
    for name, column in per_row.items():
        if name not in ROW_KEYS:
            raise TypeError(f"per_row key {name!r} is not a SamplingParams field, {JSON_SCHEMA!r} or "
                            f"{CHAT_TEMPLATE_KWARGS!r}; known: {sorted(_SAMPLING_FIELDS)}")
        if name == CHAT_TEMPLATE_KWARGS and chat is None:
            raise TypeError(f"per_row key {CHAT_TEMPLATE_KWARGS!r} needs messages_column (it shapes chat prompts)")
        if column not in pdf.columns:
            raise KeyError(f"per_row maps {name!r} to column {column!r}, which the partition does not have; "
                           f"columns: {list(pdf.columns)}")


def read_requests(pdf: pd.DataFrame, prompt_column: str, per_row: Mapping[str, str], base: SamplingParams,
                  chat: ChatOptions | None = None) -> list[tuple[Any, SamplingParams]]:
    """One (prompt, params) per row, in row order. Missing per-row values (NA) keep `base`'s.

    Values are made plain Python by the one cell conversion file rows use too (io/cells.py):
    numpy scalars, arrays -> lists, a whole-number float for an integer field (a column with NA
    is float) -> an int. Anything else is left for the engine to reject, so only that row fails.
    With `chat`, a row's prompt is a ChatPrompt; a cell that holds no messages at all is a
    RequestError in the prompt's place (see `split_failed`).
    """
    if chat is None:  # NA -> None: the engine fails that row
        prompts = [v if isinstance(v, str) else plain(v) for v in pdf[prompt_column].tolist()]
    else:
        prompts = [_chat_prompt(cell, kwargs, chat) for cell, kwargs in
                   zip(pdf[chat.column].tolist(), _row_kwargs(pdf, per_row))]
    columns = {name: pdf[col].tolist() for name, col in per_row.items() if name != CHAT_TEMPLATE_KWARGS}
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


def _row_kwargs(pdf: pd.DataFrame, per_row: Mapping[str, str]) -> list[Any]:
    column = per_row.get(CHAT_TEMPLATE_KWARGS)
    return [None] * len(pdf) if column is None else pdf[column].tolist()


def _chat_prompt(cell: Any, row_kwargs: Any, chat: ChatOptions) -> ChatPrompt | RequestError:
    """The row's conversation with the job's template variables under its own (a null cell
    keeps the job's)."""
    try:
        messages = messages_from_cell(cell)
        kwargs = dict(chat.chat_template_kwargs or {})
        row_kwargs = plain(row_kwargs)
        if row_kwargs is not None:
            kwargs.update(chat_template_kwargs(row_kwargs))
    except (RequestError, FieldError) as exc:
        return RequestError(str(exc))
    return ChatPrompt(messages, chat.add_generation_prompt, kwargs or None)


def split_failed(requests: list[tuple[Any, SamplingParams]]
                 ) -> tuple[list[int], list[tuple[Any, SamplingParams]], dict[int, str]]:
    """(positions that run, their requests, position -> error of those that cannot)."""
    failed = {i: str(p) for i, (p, _) in enumerate(requests) if isinstance(p, RequestError)}
    keep = [i for i in range(len(requests)) if i not in failed]
    return keep, [requests[i] for i in keep], failed


def with_schema(job: StructuredOutputsParams | None, schema: Any) -> StructuredOutputsParams:
    """A row's json_schema cell as its constraint, keeping the job's structured_outputs options.
    A bad schema (not JSON, not compilable) is judged by the engine, so only that row fails."""
    if isinstance(schema, bytes):
        schema = schema.decode("utf-8", "replace")
    if job is None:
        return StructuredOutputsParams(json=schema)
    return replace(job, json=schema, regex=None, choice=None, grammar=None, json_object=None)
