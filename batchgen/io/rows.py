"""Turn one row's prompt and sampling fields into token ids and ``SamplingParams``.

Prompts are tokenized here, in the driver, so every row reaches the backend as token ids: chat
rows need it anyway (template, then ``add_special_tokens=False``), and it lets a prompt that
does not fit the context fail with its line number before any generation is spent on it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchgen.errors import RequestError
from batchgen.io.params import FieldError, make_params
from batchgen.io.request import Request, RowError, show
from batchgen.runtime.requests import check_length, prompt_to_ids

if TYPE_CHECKING:
    from batchgen.tokenizer import Tokenizer


@dataclass(slots=True)
class RowContext:
    """What parsing a row needs from the model, plus the job-wide sampling defaults."""

    tokenizer: Tokenizer | None  # None: the model ships none; only token-id prompts work
    vocab_size: int
    max_model_len: int
    defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs


def set_params(req: Request, fields: Mapping[str, Any], ctx: RowContext,
               prefix: str = "") -> None:
    try:
        req.params = make_params(ctx.defaults, fields, ctx.vocab_size, prefix)
    except FieldError as exc:
        req.fail_with(exc.error)


def set_prompt(req: Request, value: Any, param: str, ctx: RowContext) -> None:
    """A prompt is a string, a list of token ids, or (``req.chat``) a list of messages.
    Call after ``set_params``: whether the prompt fits depends on them."""
    assert req.params is not None
    try:
        ids = (_chat_ids(value, ctx) if req.chat
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


def _chat_ids(messages: Any, ctx: RowContext) -> list[int]:
    problem = _message_problem(messages)
    if problem:
        raise RequestError(problem)
    if ctx.tokenizer is None:
        raise RequestError("messages: this model directory has no tokenizer.json")
    flat = [{**m, "content": _flatten(m.get("content"))} for m in messages]
    try:
        text = ctx.tokenizer.apply_chat_template(flat)
    except RequestError:
        raise
    except Exception as exc:  # user data through the model's template: any failure is this row's
        raise RequestError(f"messages: chat template failed: {exc}") from exc
    return ctx.tokenizer.encode(text, add_special_tokens=False)


def _message_problem(messages: Any) -> str | None:
    if not isinstance(messages, (list, tuple)) or not messages:
        return f"messages must be a non-empty list of messages, got {show(messages)}"
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            return f"messages[{i}] must be an object with a string 'role', got {show(m)}"
        content = m.get("content")
        if content is None and m["role"] != "assistant":  # only an assistant turn (tool calls) may omit it
            return f"messages[{i}].content must be a string or a list of text parts, got null"
        if not (content is None or isinstance(content, str) or _is_text_parts(content)):
            return (f"messages[{i}].content must be a string or a list of text parts, "
                    f"got {show(content)}")
    return None


def _flatten(content: Any) -> Any:
    # Text parts become one string, as vLLM does for templates that expect a string.
    return "".join(p["text"] for p in content) if isinstance(content, (list, tuple)) else content


def _is_text_parts(content: Any) -> bool:
    return isinstance(content, (list, tuple)) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content)
