"""OpenAI batch JSONL: input lines -> ``Request``, results -> output lines.

Input, one request per line (blank lines are skipped)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "Hello", "max_tokens": 16}}

Output, one line per input line, in finishing order: a ``text_completion`` or
``chat.completion`` object under ``response.body``. A line that fails (malformed JSON, a bad
field, a prompt too long, a generation the engine rejects) is answered the way OpenAI's batch
output answers a request the API rejected with an HTTP 400: ``response.status_code`` 400 and
``response.body.error = {message, type, param, code, line}`` (``line`` is ours: the input line,
which is how ``--resume`` recognises a row that has no usable custom_id), the message naming the
line, the field and the value; a row the engine or the cluster failed is answered with a 500
``server_error`` whose ``retryable`` is true (io/faults.py). The top-level ``error`` is null on
every line: OpenAI fills it (with ``response`` null) only for a request that never got a
response, such as one that expired, and batchgen writes no such line (a row it did not finish
stays unwritten, for ``--resume``). The input may be several parts or compressed (io/source.py).
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from batchgen.io.faults import fault_of
from batchgen.io.logprobs import chat_logprobs, completion_logprobs
from batchgen.io.params import FieldError, openai_fields
from batchgen.io.request import NO_VALUE, Request, RowKey
from batchgen.io.rows import RowContext, set_params, set_prompt
from batchgen.io.source import Source

if TYPE_CHECKING:
    from batchgen.outputs import RequestOutput
    from batchgen.tokenizer import Tokenizer

ENDPOINTS = {"/v1/completions": False, "/v1/chat/completions": True}  # url -> is chat
# Rows that have no custom_id of their own to be recognised by on --resume.
_LINE_KEYED_CODES = frozenset({"invalid_json", "missing_custom_id", "duplicate_custom_id"})
R = TypeVar("R", bound=Request)  # the row type a reader makes (an image job's adds its images)


class OpenAIBatchReader:
    """Parses an input file lazily; ``requests(skip)`` yields the rows whose key is not in skip."""

    def __init__(self, path: Source | Path, ctx: RowContext, contexts: Mapping[str, RowContext] | None = None) -> None:
        """contexts: a multi-model job's models by name; each line's ``body.model`` picks one."""
        self.path, self.ctx, self.contexts = as_source(path), ctx, contexts

    def count(self) -> int:
        return count_lines(self.path)

    def requests(self, skip: set[RowKey] | frozenset[RowKey] = frozenset()) -> Iterator[Request]:
        for req, obj in read_lines(self.path, skip, Request):
            if req.is_valid:
                ctx = self.ctx if self.contexts is None else pick_model(req, obj, self.contexts)
                if ctx is not None:
                    complete(req, obj, ctx)
            yield req


def as_source(path: Source | Path | str) -> Source:
    return path if isinstance(path, Source) else Source.open(path)


def count_lines(path: Source | Path) -> int:
    return sum(1 for raw in as_source(path).lines() if raw.strip())


def read_lines(path: Source | Path, skip: set[RowKey] | frozenset[RowKey],
               row: type[R]) -> Iterator[tuple[R, dict[str, Any]]]:
    """Each non-blank line whose key is not in ``skip``: its row (a ``row``, identified) and JSON.
    Line numbers run on across the parts of a multi-file input."""
    seen: dict[str, int] = {}  # custom_id -> first line; duplicates depend on the input only
    for number, raw in enumerate(as_source(path).lines(), start=1):
        if raw.strip():
            req, obj = identify(raw, number, seen, row)
            if req.key not in skip:
                yield req, obj


def identify(raw: bytes, number: int, seen: dict[str, int], row: type[R]) -> tuple[R, dict[str, Any]]:
    """Parse the JSON and the custom_id: enough to know the row's key."""
    req = row(key=("line", number), where=f"line {number}", number=number)
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        req.fail("invalid_json", f"not valid JSON ({exc}): {text[:60]!r}")
        return req, {}
    if not isinstance(obj, dict):
        req.fail("invalid_json", "must be a JSON object", None, obj)
        return req, {}
    cid = obj.get("custom_id", NO_VALUE)
    if cid is NO_VALUE or cid is None:
        req.fail("missing_custom_id", "missing", "custom_id")
    elif not isinstance(cid, str) or not cid:
        req.fail("missing_custom_id", "must be a non-empty string", "custom_id", cid)
    elif cid in seen:
        req.custom_id = cid
        req.fail("duplicate_custom_id", f"already used on line {seen[cid]}", "custom_id", cid)
    else:
        seen[cid] = number
        req.key, req.custom_id = ("id", cid), cid
    return req, obj


def pick_model(req: Request, obj: dict[str, Any], contexts: Mapping[str, RowContext]) -> RowContext | None:
    """The context of the model ``body.model`` names (set as ``req.model``); None: the row failed."""
    body = obj.get("body")
    name = body.get("model", NO_VALUE) if isinstance(body, dict) else NO_VALUE
    if name is NO_VALUE:
        req.fail("model_not_found", f"missing; this job runs the models {sorted(contexts)}", "body.model")
        return None
    if not isinstance(name, str) or name not in contexts:
        req.fail("model_not_found", f"unknown model; this job runs {sorted(contexts)}", "body.model", name)
        return None
    req.model = name
    return contexts[name]


def complete(req: Request, obj: dict[str, Any], ctx: RowContext) -> None:
    """Check method, url and body; tokenize the prompt; build the SamplingParams."""
    method, url, body = obj.get("method", NO_VALUE), obj.get("url", NO_VALUE), obj.get("body")
    if method is NO_VALUE or url is NO_VALUE or body is None:
        param = "method" if method is NO_VALUE else "url" if url is NO_VALUE else "body"
        req.fail("missing_" + param, "missing", param)
        return
    if method != "POST":
        req.fail("invalid_method", "must be 'POST'", "method", method)
        return
    if url not in ENDPOINTS:
        req.fail("invalid_url", f"must be one of {sorted(ENDPOINTS)}", "url", url)
        return
    if not isinstance(body, dict):
        req.fail("invalid_body", "must be a JSON object", "body", body)
        return
    req.chat = ENDPOINTS[url]
    try:
        fields = openai_fields(body)
    except FieldError as exc:
        req.fail_with(exc.error)
        return
    set_params(req, fields, ctx, prefix="body.")
    if req.is_valid:
        name = "messages" if req.chat else "prompt"
        if name not in body:
            req.fail("invalid_prompt", "missing", "body." + name)
        else:
            set_prompt(req, body[name], "body." + name, ctx)


def success_record(req: Request, out: RequestOutput, model: str,
                   tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """``tokenizer`` decodes the tokens of requested logprobs."""
    with_lp = out.logprobs is not None and tokenizer is not None
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "finish_reason": out.finish_reason,
                  "logprobs": chat_logprobs(out, tokenizer) if with_lp else None}
        obj, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": out.text, "finish_reason": out.finish_reason,
                  "logprobs": completion_logprobs(out, tokenizer) if with_lp else None}
        obj, prefix = "text_completion", "cmpl-"
    body = {
        "id": prefix + uuid.uuid4().hex, "object": obj, "created": int(time.time()),
        "model": model, "choices": [choice],
        "usage": {"prompt_tokens": out.num_prompt_tokens,
                  "completion_tokens": out.num_generated_tokens,
                  "total_tokens": out.num_prompt_tokens + out.num_generated_tokens,
                  # OpenAI's field: prompt tokens whose KV the prefix cache supplied
                  "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}},
    }
    return response_record(req, 200, body)


def error_record(req: Request) -> dict[str, Any]:
    """A failed row: the error under ``response.body.error``, as OpenAI writes a request its API
    answered with an error; the top-level ``error`` stays null (see the module docstring).
    Status 400 (``invalid_request_error``) for the request's own fault, 500 (``server_error``,
    ``retryable``: true) for the engine's or cluster's (io/faults.py)."""
    assert req.error is not None
    fault = fault_of(req.error.code)
    error = {"message": req.error.message, "type": fault.type, "param": req.error.param,
             "code": req.error.code, "line": req.number, "retryable": fault.retryable}
    return response_record(req, fault.status, {"error": error})


def is_retryable(record: dict[str, Any]) -> bool:
    """Whether an output line is an error that ``--retry-errors`` runs again."""
    error = record_error(record) or {}
    return bool(error.get("retryable"))


def record_error(record: dict[str, Any]) -> dict[str, Any] | None:
    """The error of an output line, or None for a success: ``response.body.error``, or the
    top-level ``error`` of a line that has no response."""
    response = record.get("response")
    if response is None:
        return record.get("error")
    return (response.get("body") or {}).get("error")


def record_key(record: dict[str, Any]) -> RowKey:
    """The key of the input row an output line answers (see ``identify``)."""
    error = record_error(record) or {}
    return row_key(record.get("custom_id"), error.get("code"), error.get("line"))


def row_key(custom_id: str | None, error_code: str | None, line: int | None) -> RowKey:
    """The key of the input row that an output row (JSONL record, or an image job's Parquet
    row) answers, from its custom_id, error code and input line (see ``identify``)."""
    if custom_id is not None and error_code not in _LINE_KEYED_CODES:
        return ("id", custom_id)
    if line is None:
        raise KeyError("line")  # keyed by its line, yet names none: not a batchgen record
    return ("line", line)


def response_record(req: Request, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """One output line: ``body`` answers ``req`` with HTTP ``status``, in OpenAI's batch shape."""
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": req.custom_id,
            "response": {"status_code": status, "request_id": uuid.uuid4().hex, "body": body},
            "error": None}
