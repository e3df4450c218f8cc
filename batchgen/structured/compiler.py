"""Specs -> llguidance grammars, compiled once per engine and spec, and matchers made from them.

Why llguidance (benchmarks/bench_grammar_libraries.py, this 2-core CPU, one thread, a nested
JSON schema, byte-level BPE tokenizers of 1,000 and 9,198 ids): llguidance compiles a schema in
1.0-1.6 ms (it builds masks lazily, per step) and computes a mask in 49-147 us; xgrammar 37-287 ms
and 43-119 us; outlines-core 27-227 ms and 1.1-3.5 us (a precomputed DFA index over the whole
vocabulary, which grows with vocabulary x states and has no context-free grammars). By weight:
llguidance and outlines-core are single wheels with no dependencies; xgrammar requires torch,
transformers and triton. llguidance is the one with no dependencies, Lark/GBNF grammars, regexes and
the broadest JSON schema coverage, and it does not pay a per-schema precompute, which matters for
per-row schemas; its mask cost is the price, paid only by rows that have a constraint.
"""
from __future__ import annotations

import functools
import hashlib
import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ..errors import RequestError
from .params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

    from ..tokenizer import Tokenizer

_MAX_CACHED = 1024  # distinct compiled specs kept per engine (least recently used dropped)


class GrammarError(RequestError):
    """A spec the library cannot compile, or a token its grammar rejects; names the field."""


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for a (validated) spec. Raises GrammarError naming the field."""
    import llguidance
    from llguidance import LLMatcher

    kind = spec.kind
    where = f"structured_outputs.{kind}"
    try:
        if kind in ("json", "json_object"):
            schema = spec.schema()
            if spec.disable_additional_properties:
                schema = _no_additional_properties(schema)
            options: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
            if spec.whitespace_pattern is not None:
                options = {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern}
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec.regex)  # type: ignore[arg-type]
        if kind == "choice":
            # Lark string literals; JSON's escapes are Lark's
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice or ()))
        return llguidance.grammar_from("grammar", spec.grammar)  # type: ignore[arg-type]  # Lark or GBNF
    except ValueError as exc:
        raise GrammarError(f"{where}: cannot compile: {exc}") from None


def _no_additional_properties(schema: Any) -> Any:
    """vLLM's disable_additional_properties: objects that do not say get additionalProperties false."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer_json: str, digest: str, n_vocab: int, eos: tuple[int, ...]) -> llguidance.LLTokenizer:
    del digest  # part of the cache key only
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=list(eos))


class GrammarCompiler:
    """One per engine: the tokenizer as llguidance sees it, and a cache of compiled specs keyed
    by the spec's canonical text (the tokenizer is the engine's own)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width
        # the mask's width: ids of either (a padded vocabulary, or a tokenizer larger than the model)
        self.n_vocab = max(vocab_size, tokenizer.vocab_size if tokenizer is not None else 0)
        self.eos_token_ids = list(eos_token_ids)
        self._ll: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, Any] = OrderedDict()  # key -> template LLMatcher | GrammarError
        self.num_compiled = 0

    def _tokenizer(self, where: str) -> llguidance.LLTokenizer:
        if self._ll is None:
            if self.tokenizer is None:
                raise GrammarError(f"{where}: this model directory has no tokenizer.json, which "
                                   "structured outputs need")
            try:
                import llguidance  # noqa: F401
            except ImportError:
                raise GrammarError(f"{where}: structured outputs need the llguidance package "
                                   "(pip install llguidance)") from None
            text = self.tokenizer.to_json()
            self._ll = _ll_tokenizer(text, hashlib.sha1(text.encode()).hexdigest(), self.n_vocab,
                                     tuple(self.eos_token_ids))
        return self._ll

    def template(self, spec: StructuredOutputsParams) -> Any:
        """The compiled spec as a fresh matcher to copy from; raises GrammarError."""
        key = spec.cache_key()
        hit = self._cache.get(key)
        if hit is None:
            hit = self._compile(spec)
            self._cache[key] = hit
            if len(self._cache) > _MAX_CACHED:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if isinstance(hit, GrammarError):
            raise hit
        return hit

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        from llguidance import LLMatcher

        where = f"structured_outputs.{spec.kind}"
        try:
            tok = self._tokenizer(where)
            grammar = grammar_text(spec)
            failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, tok)
            if failed:
                raise GrammarError(f"{where}: cannot compile: {_first_line(messages)}")
            matcher = LLMatcher(tok, grammar, log_level=0)
            if matcher.is_error():
                raise GrammarError(f"{where}: cannot compile: {_first_line([matcher.get_error()])}")
        except GrammarError as exc:
            return exc  # cached too: a bad schema shared by many rows is judged once
        self.num_compiled += 1
        return matcher

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A new matcher at the start of spec's grammar."""
        return self.template(spec).deep_copy()


def _first_line(messages: list[str]) -> str:
    text = " ".join(m.strip() for m in messages if m.strip()) or "the library gave no reason"
    return " ".join(text.split())[:400]


_CHECKED: OrderedDict[str, str | None] = OrderedDict()


def check_spec(spec: StructuredOutputsParams) -> str | None:
    """Whether the library can compile spec at all (no tokenizer needed): a message naming the
    field, or None. For drivers that judge rows before any engine sees them; cached."""
    key = spec.cache_key()
    if key not in _CHECKED:
        try:
            from llguidance import LLMatcher
        except ImportError:
            return None  # the engine reports it, where the work runs
        try:
            failed, messages = LLMatcher.validate_grammar_with_warnings(grammar_text(spec))
            _CHECKED[key] = (f"structured_outputs.{spec.kind}: cannot compile: {_first_line(messages)}"
                             if failed else None)
        except GrammarError as exc:
            _CHECKED[key] = str(exc)
        if len(_CHECKED) > _MAX_CACHED:
            _CHECKED.popitem(last=False)
    return _CHECKED[key]
