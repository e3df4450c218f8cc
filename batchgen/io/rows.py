"""Turn one row's prompt and sampling fields into token ids and ``SamplingParams``.

Prompts are tokenized here, in the driver, so every row reaches the backend as token ids: chat
rows need it anyway (template, then ``add_special_tokens=False``), and it lets a prompt that
does not fit the context fail with its line number before any generation is spent on it.
"""
from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from batchgen.errors import RequestError
from batchgen.io.cells import plain
from batchgen.io.params import CHAT_TEMPLATE_KWARGS, FieldError, chat_template_kwargs, make_params
from batchgen.io.request import Request, RowError, show
from batchgen.runtime.requests import check_length, prompt_to_ids
from batchgen.tokenizer import ChatPrompt, Tokenizer, check_chat


@dataclass(slots=True)
class RowContext:
    """What parsing a row needs from the model, plus the job-wide sampling defaults."""

    tokenizer: Tokenizer | None  # None: the model ships none; only token-id prompts work
    vocab_size: int
    max_model_len: int
    defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs


def set_params(req: Request, fields: Mapping[str, Any], ctx: RowContext,
               prefix: str = "") -> None:
    """``chat_template_kwargs`` (the row's, else the job's in ``ctx.defaults``) is kept on the
    row for ``set_prompt``: it shapes the prompt, not the sampling."""
    fields, defaults = dict(fields), dict(ctx.defaults)
    job_kwargs = defaults.pop(CHAT_TEMPLATE_KWARGS, None)
    row_kwargs = fields.pop(CHAT_TEMPLATE_KWARGS, None)
    try:
        kwargs = chat_template_kwargs(row_kwargs, prefix) if row_kwargs is not None else None
        if job_kwargs is not None:
            kwargs = {**chat_template_kwargs(job_kwargs, ""), **(kwargs or {})}
        req.chat_template_kwargs = kwargs
        req.params = make_params(defaults, fields, ctx.vocab_size, prefix)
    except FieldError as exc:
        req.fail_with(exc.error)


def set_prompt(req: Request, value: Any, param: str, ctx: RowContext) -> None:
    """A prompt is a string, a list of token ids, or (``req.chat``) a list of messages.
    Call after ``set_params``: whether the prompt fits depends on them."""
    assert req.params is not None
    try:
        ids = (_chat_ids(value, req, ctx) if req.chat
               else prompt_to_ids(value, ctx.tokenizer, ctx.vocab_size))
    except RequestError as exc:
        req.fail_with(RowError("invalid_prompt", _renamed(str(exc), param), param))
        return
    except Exception as exc:  # noqa: BLE001 - the tokenizer rejects text it cannot encode (lone surrogates)
        req.fail_with(RowError("invalid_prompt", f"{param} cannot be tokenized: {exc}", param))
        return
    try:
        # The engine's own check, short of the KV pool, which only the engine can judge.
        check_length(len(ids), req.params, ctx.max_model_len)
    except RequestError as exc:
        req.fail_with(RowError("prompt_too_long", _renamed(str(exc), param), param))
        return
    req.prompt_token_ids = ids


def _renamed(message: str, param: str) -> str:
    """The engine's messages start with "prompt" or "messages": name the field as the user
    did (``body.prompt``, a Parquet column)."""
    for name in ("prompt", "messages"):
        if message.startswith(name):
            return param + message[len(name):]
    return f"{param}: {message}"


def is_messages(value: Any) -> bool:
    """Whether a prompt value looks like chat messages rather than text or token ids."""
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], Mapping)


def _chat_ids(messages: Any, req: Request, ctx: RowContext) -> list[int]:
    chat = ChatPrompt(messages, True, req.chat_template_kwargs)
    check_chat(chat)  # before the tokenizer: a malformed row is named even where none ships
    if ctx.tokenizer is None:
        raise RequestError("messages: this model directory has no tokenizer.json")
    return ctx.tokenizer.chat_ids(chat)


def messages_from_cell(value: Any) -> Any:
    """A DataFrame or file cell of chat messages as Python: a list (pandas objects, a pyarrow
    list<struct<role, content>>), or its JSON text. Raises RequestError for a null or for text
    that is no JSON; the shape itself is judged where the conversation is rendered."""
    value = plain(value)
    if value is None:
        raise RequestError("messages: missing (null)")
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, list):
        return [dict(m) if isinstance(m, Mapping) else plain(m) for m in value]
    if not isinstance(value, str):
        return value  # judged (and named) where the conversation is rendered
    try:
        return json.loads(value)
    except ValueError as exc:
        # Dask's dataframe.convert-string turns an object column of Python lists into their
        # repr; literal_eval reads that back (it evaluates literals only, never code)
        if value.lstrip().startswith("["):
            try:
                return ast.literal_eval(value)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                pass
        raise RequestError(f"messages: not valid JSON ({exc}): {show(value)}") from None
