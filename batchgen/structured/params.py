"""StructuredOutputsParams: what shape a request's output must take (vLLM's names and meanings).

Torch-free and library-free: SamplingParams, the scheduling policy and the simulator import it.
Exactly one constraint is set: ``json`` (a JSON schema, dict or JSON text), ``json_object=True``
(any JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (Lark, or
llama.cpp's GBNF, as llguidance reads them). Setting none or several raises ``ValueError`` at
construction, as vLLM does; wrongly typed values are reported by ``validate`` so only the one
request fails.

Whitespace: ``disable_any_whitespace`` defaults to True here (vLLM's default is False): JSON is
generated compact (``{"a":1,"b":[2,3]}``), since a weak model allowed free whitespace between
tokens can emit it until max_tokens without ever closing the object. Pass
``disable_any_whitespace=False`` to allow any JSON whitespace, or ``whitespace_pattern`` (a regex)
to allow exactly that between tokens.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True, kw_only=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        chosen = self.constraints()
        if len(chosen) > 1:
            raise ValueError("structured_outputs: only one kind of constraint may be given, got "
                             + ", ".join(chosen))
        if not chosen:
            raise ValueError("structured_outputs: give one of " + ", ".join(CONSTRAINTS)
                             + " (all are unset)")

    def constraints(self) -> list[str]:
        """The constraint fields that are set (json_object=False counts as unset)."""
        return [n for n in CONSTRAINTS
                if getattr(self, n) is not None and not (n == "json_object" and getattr(self, n) is False)]

    @property
    def kind(self) -> str:
        return self.constraints()[0]

    def validate(self) -> str | None:
        """A message naming the bad field and value (``structured_outputs.regex=...``), or None.
        Only types and shapes: whether the library can compile it is known at the engine."""
        kind = self.kind
        value = getattr(self, kind)
        where = f"structured_outputs.{kind}"
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    return f"{where}: not valid JSON ({exc}): {_show(value)}"
            if not isinstance(value, (dict, bool)):
                return f"{where} must be a JSON schema (an object), got {_show(value)}"
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                return f"{where} must be a non-empty string, got {_show(value)}"
        elif kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                return f"{where} must be a non-empty list of non-empty strings, got {_show(value)}"
        elif value is not True:
            return f"{where} must be true, got {_show(value)}"
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                return f"structured_outputs.{name} must be true or false, got {_show(getattr(self, name))}"
        wp = self.whitespace_pattern
        if wp is not None and not isinstance(wp, str):
            return f"structured_outputs.whitespace_pattern must be a string, got {_show(wp)}"
        return None

    def schema(self) -> dict[str, Any] | bool:
        """The JSON schema of a json / json_object constraint (parsed; call validate first)."""
        if self.kind == "json_object":
            return {"type": "object"}
        return json.loads(self.json) if isinstance(self.json, str) else self.json  # type: ignore[return-value]

    def cache_key(self) -> str:
        """Canonical text of the spec: equal keys compile to the same grammar. Schema key order
        is kept (it is the order properties are generated in)."""
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.kind in ("json", "json_object"):
            try:
                state["json"] = self.schema()
            except ValueError:
                pass
        return json.dumps(state, separators=(",", ":"), ensure_ascii=False, default=repr)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> StructuredOutputsParams:
        """From a request body's ``structured_outputs`` object. Unknown keys raise TypeError,
        no or several constraints ValueError; nulls mean the default."""
        if isinstance(d, StructuredOutputsParams):
            return d
        if not isinstance(d, Mapping):
            raise TypeError(f"structured_outputs must be an object, got {_show(d)}")
        unknown = sorted(set(d) - _FIELDS)
        if unknown:
            raise TypeError(f"structured_outputs: unknown field {unknown[0]!r} (known: {', '.join(sorted(_FIELDS))})")
        return cls(**{k: v for k, v in d.items() if v is not None})


_FIELDS = frozenset(f.name for f in fields(StructuredOutputsParams))


def _show(v: object) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."
