"""Per-request sampling settings (vLLM's names, defaults and meanings) and stop-string search.

No torch here: sequence state, the scheduling policy and the simulator import this module.
Bad values never raise at construction; ``validate`` reports them so that only the one request
fails. Unknown field names do raise (``TypeError``), as they do in vLLM.
"""
from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from batchgen.structured.params import StructuredOutputsParams

# A check returns a message naming the field and value, or None.
_Check = Callable[["SamplingParams", "int | None"], "str | None"]

# vLLM's _SAMPLING_EPS: a temperature below this is greedy decoding.
GREEDY_EPS = 1e-5
# vLLM's default max_logprobs.
MAX_LOGPROBS = 20


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """How to sample one request. Field names, defaults and meanings follow vLLM.

    ``temperature`` below 1e-5 is greedy (top_k / top_p / min_p are then ignored); ``top_k`` 0 or -1
    is disabled; ``logprobs=k`` returns the sampled token's logprob and the k most likely tokens'.
    ``n`` exists so that OpenAI/vLLM request bodies map onto it: only ``n=1`` is supported.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    # JSON schema / regex / choice / grammar constraint (see batchgen/structured); a mapping of
    # its fields is converted here (unknown keys raise TypeError, as unknown fields do)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, Mapping):
            self.structured_outputs = StructuredOutputsParams.from_mapping(self.structured_outputs)

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate(self, vocab_size: int | None = None) -> str | None:
        """Return a message naming the first bad field and its value, or None when all are good."""
        for check in _CHECKS:
            msg = check(self, vocab_size)
            if msg is not None:
                return msg
        return None

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a request body's sampling keys (vLLM names plus a few OpenAI aliases).

        Aliases: ``max_completion_tokens`` (wins over ``max_tokens``); chat-style boolean
        ``logprobs`` with ``top_logprobs`` (true -> top_logprobs or 0, false -> None). A JSON
        null means the field's default. Unknown keys raise TypeError naming the key; bad values
        are left for ``validate``.
        """
        if not isinstance(d, Mapping):
            raise TypeError(f"sampling parameters must be a mapping, got {type(d).__name__}")
        kw: dict[str, Any] = {}
        for key, value in d.items():
            if key in ("max_completion_tokens", "top_logprobs"):
                continue
            if key not in _FIELD_NAMES:
                raise TypeError(_unknown_field_message(key))
            if value is not None:
                kw[key] = value
        if d.get("max_completion_tokens") is not None:
            kw["max_tokens"] = d["max_completion_tokens"]
        top = d.get("top_logprobs")
        lp = d.get("logprobs")
        if isinstance(lp, bool):
            kw["logprobs"] = (0 if top is None else top) if lp else None
        elif lp is None and top is not None:
            kw["logprobs"] = top
        if kw.get("logprobs") is None:
            kw.pop("logprobs", None)
        return cls(**kw)


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))


def _unknown_field_message(key: object) -> str:
    close = difflib.get_close_matches(str(key), sorted(_FIELD_NAMES), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown sampling parameter {key!r}{hint}"


# --- validation -------------------------------------------------------------------------------
# numbers.Integral / numbers.Real so numpy scalars from a DataFrame pass; bool is excluded
# because True is never a sensible token count or temperature.

def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _show(v: object) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _int_field(name: str, lo: int, hi: int | None = None, optional: bool = False) -> _Check:
    rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"

    def check(p: SamplingParams, vocab_size: int | None) -> str | None:
        v = getattr(p, name)
        if v is None and optional:
            return None
        if not _is_int(v):
            return f"{name} must be an integer {rng}, got {_show(v)}"
        if v < lo or (hi is not None and v > hi):
            return f"{name} must be an integer {rng}, got {_show(v)}"
        return None
    return check


def _real_field(name: str, ok: Callable[[float], bool], rng: str) -> _Check:
    def check(p: SamplingParams, vocab_size: int | None) -> str | None:
        v = getattr(p, name)
        if not _is_real(v):
            return f"{name} must be a number, got {_show(v)}"
        if not math.isfinite(v) or not ok(v):
            return f"{name} must be a finite number {rng}, got {_show(v)}"
        return None
    return check


def _bool_field(name: str) -> _Check:
    def check(p: SamplingParams, vocab_size: int | None) -> str | None:
        v = getattr(p, name)
        return None if isinstance(v, bool) else f"{name} must be true or false, got {_show(v)}"
    return check


def _check_n(p: SamplingParams, vocab_size: int | None) -> str | None:
    if _is_int(p.n) and p.n == 1:
        return None
    return f"n must be 1 (batchgen returns one completion per prompt), got {_show(p.n)}"


def _check_min_tokens_le_max(p: SamplingParams, vocab_size: int | None) -> str | None:
    if p.min_tokens > p.max_tokens:
        return (f"min_tokens must be <= max_tokens={p.max_tokens}, "
                f"got {_show(p.min_tokens)}")
    return None


def _check_top_k(p: SamplingParams, vocab_size: int | None) -> str | None:
    v = p.top_k
    if not _is_int(v) or v < -1:
        return f"top_k must be an integer >= 1, or 0 or -1 to disable, got {_show(v)}"
    return None


def _check_seed(p: SamplingParams, vocab_size: int | None) -> str | None:
    if p.seed is None or _is_int(p.seed):
        return None
    return f"seed must be an integer or null, got {_show(p.seed)}"


def _check_stop(p: SamplingParams, vocab_size: int | None) -> str | None:
    s = p.stop
    if s is None or (isinstance(s, str) and s):
        return None
    if isinstance(s, (list, tuple)) and all(isinstance(x, str) and x for x in s):
        return None
    return f"stop must be a non-empty string or a list of non-empty strings, got {_show(s)}"


def _check_stop_token_ids(p: SamplingParams, vocab_size: int | None) -> str | None:
    ids = p.stop_token_ids
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)):
        return f"stop_token_ids must be a list of token ids, got {_show(ids)}"
    hi = f", vocab_size={vocab_size})" if vocab_size is not None else ", ...)"
    for t in ids:
        if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
            return f"stop_token_ids must hold token ids in [0{hi}, got {_show(t)} in {_show(ids)}"
    return None


def _check_structured_outputs(p: SamplingParams, vocab_size: int | None) -> str | None:
    so = p.structured_outputs
    if so is None:
        return None
    if not isinstance(so, StructuredOutputsParams):
        return f"structured_outputs must be a StructuredOutputsParams, got {_show(so)}"
    return so.validate()


_CHECKS: tuple[_Check, ...] = (
    _check_n,
    _int_field("max_tokens", 1),
    _int_field("min_tokens", 0),
    _check_min_tokens_le_max,
    _real_field("temperature", lambda v: v >= 0, ">= 0"),
    _check_top_k,
    _real_field("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    _real_field("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    _check_seed,
    _check_stop,
    _check_stop_token_ids,
    _bool_field("ignore_eos"),
    _int_field("logprobs", 0, MAX_LOGPROBS, optional=True),
    _real_field("repetition_penalty", lambda v: v > 0, "> 0"),
    # [-2, 2] as in vLLM and the OpenAI API.
    _real_field("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    _real_field("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    _bool_field("include_stop_str_in_output"),
    _check_structured_outputs,
)


# --- stop strings -----------------------------------------------------------------------------

def find_stop_span(text: str, stops: Sequence[str], start: int) -> tuple[int, int] | None:
    """(begin, end) of the earliest stop string in ``text`` that ends after ``start``.

    ``start`` is the length of the text already searched (before the newest tokens); only a stop
    that ends past it can be new, so each stop is searched from ``start - len(stop) + 1``. Among
    stops that begin at the same place the shortest wins, since it completed first.
    """
    best: tuple[int, int] | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or (i, i + len(s)) < best):
            best = (i, i + len(s))
    return best


def find_stop_string(text: str, stops: Sequence[str], start: int) -> int | None:
    """Index where the earliest newly completed stop string begins, or None (see find_stop_span).

    Truncate the output to ``text[:index]``; with include_stop_str_in_output use
    ``find_stop_span``'s end instead.
    """
    span = find_stop_span(text, stops, start)
    return None if span is None else span[0]
