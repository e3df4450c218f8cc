"""Per-row sampling fields -> ``SamplingParams``, with the job's defaults underneath.

``SamplingParams.from_mapping`` knows vLLM's names and the OpenAI aliases, and ``validate``
checks types and ranges. What is left for this module is the rest of an OpenAI request body:
fields that change nothing (``model``, ``user``) and fields we accept only when they ask for
nothing we do not do (``stream: false``, ``n: 1``).
"""
from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from typing import Any, get_type_hints

from batchgen.errors import RequestError
from batchgen.io.cells import whole_floats_to_int
from batchgen.io.request import RowError, describe
from batchgen.io.structured import JSON_SCHEMA, StructuredFieldError, from_body, from_response_format, resolve
from batchgen.sampling_params import SamplingParams

# OpenAI fields accepted only with one of these values.
_OPENAI_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "stream": (False,), "echo": (False,), "suffix": ("",), "logit_bias": ({},),
    "tools": ([],), "functions": ([],), "tool_choice": ("none",), "function_call": ("none",),
}
# OpenAI fields that do not change what is generated.
_OPENAI_IGNORED = frozenset({
    "model", "user", "metadata", "store", "service_tier", "stream_options",
    "parallel_tool_calls", "reasoning_effort", "modalities",
})
_PROMPT_FIELDS = frozenset({"prompt", "messages"})
FIELD_NAMES = frozenset(SamplingParams.__dataclass_fields__)
# Template variables of a chat row (vLLM's body field): they shape the prompt, not the sampling
CHAT_TEMPLATE_KWARGS = "chat_template_kwargs"
# Per-row fields that are not SamplingParams fields: a JSON schema column (io/structured.py),
# chat template variables
ROW_FIELDS = FIELD_NAMES | {JSON_SCHEMA, CHAT_TEMPLATE_KWARGS}
_ALIASES = frozenset({"max_completion_tokens", "top_logprobs"})  # see SamplingParams.from_mapping
_HINTS = get_type_hints(SamplingParams)
INT_FIELDS = frozenset({n for n, t in _HINTS.items() if t in (int, int | None)} | _ALIASES)
INT_LIST_FIELDS = frozenset(n for n, t in _HINTS.items() if t == list[int] | None)


class FieldError(RequestError):
    """One sampling field is bad or unsupported; ``error`` says which and why."""

    def __init__(self, error: RowError) -> None:
        super().__init__(error.message)
        self.error = error


def openai_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling fields of a request body, for ``make_params``."""
    out: dict[str, Any] = {}
    if body.get("response_format") is not None and body.get("structured_outputs") is not None:
        raise FieldError(RowError("invalid_value", "body.response_format and body.structured_outputs: "
                                  "give one of them, not both", "body.response_format"))
    for name, value in body.items():
        if name in _PROMPT_FIELDS or name in _OPENAI_IGNORED or value is None:
            continue
        if name in ("response_format", "structured_outputs"):
            try:
                so = (from_response_format(value, "body." + name) if name == "response_format"
                      else from_body(value, "body." + name))
            except StructuredFieldError as exc:
                raise FieldError(exc.error) from None
            if so is not None:
                out["structured_outputs"] = so
            continue
        if name in _OPENAI_NEUTRAL:
            if value not in _OPENAI_NEUTRAL[name]:
                param = "body." + name
                raise FieldError(RowError(
                    "unsupported_value", describe("not supported by batchgen", param, value),
                    param))
            continue
        if name not in FIELD_NAMES and name not in _ALIASES and name != CHAT_TEMPLATE_KWARGS:
            known = sorted(FIELD_NAMES | _ALIASES | _OPENAI_NEUTRAL.keys() | _OPENAI_IGNORED | {CHAT_TEMPLATE_KWARGS})
            close = difflib.get_close_matches(name, known, n=1)
            reason = "unknown field" + (f" (did you mean {close[0]!r}?)" if close else "")
            raise FieldError(RowError("unknown_field", describe(reason, "body." + name, value),
                                      "body." + name))
        out[name] = value
    return out


def make_params(defaults: Mapping[str, Any], fields: Mapping[str, Any],
                vocab_size: int | None, prefix: str = "") -> SamplingParams:
    """``fields`` (a row's own) override ``defaults`` (the job's); both use vLLM's names or
    the OpenAI aliases. Raises ``FieldError`` naming the field and the value."""
    defaults = dict(defaults)
    if "structured_outputs" in fields:  # the row's own constraint replaces the job's
        defaults.pop("structured_outputs", None)
    if "structured_outputs" in fields or JSON_SCHEMA in fields:
        defaults.pop(JSON_SCHEMA, None)
    try:
        merged = resolve({**defaults, **fields}, prefix)
    except StructuredFieldError as exc:
        raise FieldError(exc.error) from None
    try:
        params = SamplingParams.from_mapping(whole_floats_to_int(merged, INT_FIELDS, INT_LIST_FIELDS))
    except TypeError as exc:  # an unknown field name
        raise FieldError(RowError("unknown_field", str(exc))) from None
    problem = params.validate(vocab_size)
    if problem:  # "top_p must be ..., got 7": it names the field and the value
        name = problem.split(" ", 1)[0]
        param = prefix + name if name in FIELD_NAMES else None
        raise FieldError(RowError("invalid_value", prefix + problem, param))
    return params


def chat_template_kwargs(value: Any, prefix: str = "") -> dict[str, Any]:
    """A row's (or the job's) chat template variables: an object, or its JSON text (a Parquet
    string column). Null members are dropped: null means "the template's default", as a null
    cell does everywhere else. Raises ``FieldError`` naming the field and the value."""
    param = prefix + CHAT_TEMPLATE_KWARGS
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise FieldError(RowError("invalid_value", describe(f"not valid JSON ({exc})", param, value),
                                      param)) from None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise FieldError(RowError("invalid_value", describe("must be an object with string keys", param, value),
                                  param))
    return {k: v for k, v in value.items() if v is not None}
