"""Structured outputs in request bodies and per-row columns -> ``StructuredOutputsParams``.

OpenAI's ``response_format`` (``{"type": "json_schema", "json_schema": {"name", "schema",
"strict"}}``, ``{"type": "json_object"}``, ``{"type": "text"}``), vLLM's ``structured_outputs``
body field, and the ``json_schema`` per-row field (a column of schemas, objects or JSON text).
Each failure is a ``FieldError`` naming the field as the user wrote it, and a spec the grammar
library cannot compile fails here, in the driver, before any engine sees the row.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from batchgen.io.request import RowError, describe
from batchgen.structured.compiler import check_spec
from batchgen.structured.params import StructuredOutputsParams

JSON_SCHEMA = "json_schema"  # per-row pseudo field: structured_outputs.json from a column
_JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})


class StructuredFieldError(ValueError):
    """Carries the RowError; io/params.py turns it into its FieldError."""

    def __init__(self, error: RowError) -> None:
        super().__init__(error.message)
        self.error = error


def _fail(param: str, reason: str, value: Any = None, code: str = "invalid_value") -> StructuredFieldError:
    return StructuredFieldError(RowError(code, describe(reason, param, value) if value is not None
                                         else describe(reason, param), param))


def from_response_format(value: Any, param: str) -> StructuredOutputsParams | None:
    """OpenAI's response_format -> a spec (None for type "text"). strict is accepted and changes
    nothing: the schema is always enforced (as vLLM)."""
    if not isinstance(value, Mapping):
        raise _fail(param, "must be an object", value)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return checked(StructuredOutputsParams(json_object=True), param)
    if kind != "json_schema":
        raise _fail(param + ".type", "must be 'text', 'json_object' or 'json_schema'", kind)
    js = value.get("json_schema")
    where = param + ".json_schema"
    if not isinstance(js, Mapping):
        raise _fail(where, "must be an object with name, schema and strict", js)
    unknown = sorted(set(js) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise _fail(f"{where}.{unknown[0]}", "unknown field", code="unknown_field")
    if js.get("name") is not None and not isinstance(js["name"], str):
        raise _fail(where + ".name", "must be a string", js["name"])
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise _fail(where + ".strict", "must be true or false", js["strict"])
    if "schema" not in js or js["schema"] is None:
        raise _fail(where + ".schema", "missing")
    return checked(_spec(lambda: StructuredOutputsParams(json=js["schema"]), where + ".schema"), where + ".schema")


def from_body(value: Any, param: str) -> StructuredOutputsParams:
    """vLLM's structured_outputs body field (or a Parquet cell of it: an object or JSON text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _fail(param, f"not valid JSON ({exc})", value) from None
    return checked(_spec(lambda: StructuredOutputsParams.from_mapping(value), param), param)


def resolve(fields: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A row's merged sampling fields with ``json_schema`` and a ``structured_outputs`` mapping
    made into a checked spec. A json_schema keeps the other options of a structured_outputs
    given beside it (or as a job default)."""
    out = dict(fields)
    so = out.get("structured_outputs")
    if so is not None and not isinstance(so, StructuredOutputsParams):
        so = out["structured_outputs"] = from_body(so, prefix + "structured_outputs")
    schema = out.pop(JSON_SCHEMA, None)
    if schema is not None:
        param = prefix + JSON_SCHEMA
        if isinstance(schema, (bytes, bytearray)):
            schema = schema.decode("utf-8", "replace")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise _fail(param, f"not valid JSON ({exc})", schema) from None
        if so is None:
            spec = _spec(lambda: StructuredOutputsParams(json=schema), param)
        else:
            spec = replace(so, json=schema, regex=None, choice=None, grammar=None, json_object=None)
        out["structured_outputs"] = checked(spec, param)
    return out


def checked(spec: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    problem = spec.validate() or check_spec(spec)
    if problem:
        # "structured_outputs.json: cannot compile: ..." -> named as the user wrote the field
        raise _fail(param, problem.removeprefix(f"structured_outputs.{spec.kind}: "))
    return spec


def _spec(make: Any, param: str) -> StructuredOutputsParams:
    try:
        return make()
    except (TypeError, ValueError) as exc:
        text = str(exc).removeprefix("structured_outputs: ")
        raise _fail(param, text) from None
