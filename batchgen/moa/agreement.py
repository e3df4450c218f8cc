"""Answers out of text, and agreement between proposers. Pure: no torch, no Dask.

`extract` (a spec or a function text -> answer | None) turns each proposer's text into an
answer; `vote` counts equal normalized answers: confidence = the largest count / k (the
experts the row asked), the majority the most common answer (ties: the earliest proposer's).
A failed or answerless proposer counts against agreement, never for it.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Extract = Callable[[str], "str | None"]
SPECS = ("choice", "boxed", "number", "json:FIELD", "regex:PATTERN", "text")

_CHOICE = re.compile(r"(?<![A-Za-z])\(?([A-J])\)?(?![A-Za-z])")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def choice(text: str) -> str | None:
    """The last standalone capital letter A-J ("(B)", "answer: C")."""
    found = _CHOICE.findall(text)
    return found[-1] if found else None


def boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...}, nested braces included."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def number(text: str) -> str | None:
    """The last number, canonical: "1,000.50" and "1000.5" agree."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    raw = found[-1].replace(",", "")
    try:
        value = float(raw)
    except ValueError:
        return None
    return str(int(value)) if value.is_integer() else repr(value)


def json_field(name: str) -> Extract:
    def get(text: str) -> str | None:
        for start in [m.start() for m in re.finditer(r"\{", text)][::-1]:
            try:
                obj, _ = json.JSONDecoder().raw_decode(text[start:])
            except ValueError:
                continue
            if isinstance(obj, dict) and name in obj:
                value = obj[name]
                return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return None
    return get


def regex(pattern: str) -> Extract:
    compiled = re.compile(pattern)

    def get(text: str) -> str | None:
        found = list(compiled.finditer(text))
        if not found:
            return None
        m = found[-1]
        return m.group(1) if compiled.groups else m.group(0)
    return get


def text(value: str) -> str | None:
    return value if value.strip() else None


def make_extract(spec: str | Extract | None) -> Extract:
    """"choice" | "boxed" | "number" | "json:FIELD" | "regex:PATTERN" | "text" (None) | a function."""
    if spec is None:
        return text
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"extract must be one of {SPECS} or a function, got {type(spec).__name__}")
    if spec.startswith("json:") and len(spec) > 5:
        return json_field(spec[5:])
    if spec.startswith("regex:") and len(spec) > 6:
        try:
            return regex(spec[6:])
        except re.error as exc:
            raise ValueError(f"extract={spec!r}: bad regular expression: {exc}") from None
    named = {"choice": choice, "boxed": boxed, "number": number, "text": text}
    if spec not in named:
        raise ValueError(f"extract={spec!r} unknown; use one of {', '.join(SPECS)} or a function")
    return named[spec]


def normalize(answer: str) -> str:
    return " ".join(answer.split()).strip().rstrip(".").lower()


@dataclass(frozen=True, slots=True)
class Vote:
    majority: str | None  # the winning answer as extracted (first spelling seen)
    count: int
    k: int

    @property
    def confidence(self) -> float:
        return self.count / self.k if self.k else 0.0


def vote(answers: Sequence[str | None], k: int | None = None) -> Vote:
    """answers: one per expert the row asked (None: failed or no answer); k defaults to their number."""
    k = len(answers) if k is None else k
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    for a in answers:
        if a is None:
            continue
        key = normalize(a)
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, a)
    if not counts:
        return Vote(None, 0, k)
    best = max(counts, key=lambda key: counts[key])  # dicts keep insertion order: ties go to the earliest
    return Vote(first[best], counts[best], k)
