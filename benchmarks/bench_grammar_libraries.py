"""Which grammar library batchgen's structured outputs use: llguidance, xgrammar or outlines-core.

For each library that is importable: the time to compile a JSON schema against a tokenizer, and
the time to compute one row's next-token mask, averaged over generations that follow the mask
with seeded random choices (a random model: every allowed token as likely as another, EOS as
soon as the grammar accepts). Two byte-level BPE tokenizers trained on CPython's help text: the
demo's 1,000 ids and a larger one (as large as the corpus allows, up to 32,000 ids).

    pip install llguidance outlines-core            # zero dependencies each
    pip install --no-deps xgrammar apache-tvm-ffi   # xgrammar itself wants torch, transformers, triton
    python benchmarks/bench_grammar_libraries.py [--tokens 400]

Ratios are what to read (2 shared cores); each figure is the best of --repeat runs.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from batchgen.demo import EOS_ID

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # the checkpoint builders
from demo_builder import train_tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "vip"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city"]},
    },
    "required": ["name", "age"],
}


def byte_vocab(tokenizer_json: dict[str, Any], size: int) -> list[bytes]:
    """Each id's bytes (the byte-level alphabet undone); special tokens as their text."""
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+
    table: dict[str, int] = {}
    n = 0
    for b in range(256):
        c = chr(b)
        if (33 <= b <= 126) or (161 <= b <= 172) or (174 <= b <= 255):
            table[c] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    assert set(table) == set(alphabet)
    out = [b""] * size
    for tok, i in tokenizer_json["model"]["vocab"].items():
        out[i] = bytes(table[c] for c in tok)
    for added in tokenizer_json.get("added_tokens", []):
        out[added["id"]] = added["content"].encode()
    return out


class Lib:
    name: str

    def compile(self) -> Any: ...
    def run(self, compiled: Any, rng: random.Random, max_tokens: int) -> tuple[int, float]: ...


class LLGuidance(Lib):
    name = "llguidance"

    def __init__(self, tok_json: str, vocab: int) -> None:
        import llguidance
        import llguidance.torch as lt

        self.ll, self.lt, self.vocab = llguidance, lt, vocab
        self.tok = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=EOS_ID)

    def compile(self) -> Any:
        g = self.ll.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
        m = self.ll.LLMatcher(self.tok, g)
        assert not m.is_error(), m.get_error()
        return m

    def run(self, m: Any, rng: random.Random, max_tokens: int) -> tuple[int, float]:
        mask = self.lt.allocate_token_bitmask(1, self.vocab)
        spent, n = 0.0, 0
        m.reset()
        while n < max_tokens:
            t0 = time.perf_counter()
            self.lt.fill_next_token_bitmask(m, mask, 0)
            spent += time.perf_counter() - t0
            n += 1
            allowed = unpack(mask[0], self.vocab)
            tok = EOS_ID if m.is_accepting() else rng.choice(allowed)
            if tok == EOS_ID:
                break
            assert m.consume_token(tok), m.get_error()
        return n, spent


class XGrammar(Lib):
    name = "xgrammar"

    def __init__(self, vocab_bytes: list[bytes], vocab: int) -> None:
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        info = xgr.TokenizerInfo(vocab_bytes, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[EOS_ID])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile(self) -> Any:
        return self.compiler.compile_json_schema(SCHEMA, any_whitespace=False)

    def run(self, cg: Any, rng: random.Random, max_tokens: int) -> tuple[int, float]:
        m = self.xgr.GrammarMatcher(cg)
        mask = self.xgr.allocate_token_bitmask(1, self.vocab)
        spent, n = 0.0, 0
        while n < max_tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            spent += time.perf_counter() - t0
            n += 1
            allowed = unpack(mask[0], self.vocab)
            tok = EOS_ID if m.is_terminated() or (EOS_ID in allowed) else rng.choice(allowed)
            if tok == EOS_ID:
                break
            assert m.accept_token(tok)
        return n, spent


class OutlinesCore(Lib):
    name = "outlines-core"

    def __init__(self, vocab_bytes: list[bytes], vocab: int) -> None:
        import outlines_core as oc

        self.oc, self.vocab = oc, vocab
        groups: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab_bytes):
            if i != EOS_ID and b and i >= 5:
                groups.setdefault(b, []).append(i)
        self.v = oc.Vocabulary(EOS_ID, groups)

    def compile(self) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern="")
        return self.oc.Index(regex, self.v)

    def run(self, index: Any, rng: random.Random, max_tokens: int) -> tuple[int, float]:
        g = self.oc.Guide(index)
        mask = torch.zeros(1, (self.vocab + 31) // 32, dtype=torch.int32)
        spent, n = 0.0, 0
        while n < max_tokens:
            t0 = time.perf_counter()
            g.write_mask_into(mask.data_ptr(), mask.numel(), 4)
            spent += time.perf_counter() - t0
            n += 1
            allowed = unpack(mask[0], self.vocab)
            tok = EOS_ID if g.is_finished() or EOS_ID in allowed else rng.choice(allowed)
            if tok == EOS_ID:
                break
            g.advance(tok)
        return n, spent


def unpack(words: torch.Tensor, vocab: int) -> list[int]:
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.flatten()[:vocab]).flatten().tolist()


def measure(make: Callable[[], Lib], tokens: int, repeat: int) -> dict[str, float]:
    lib = make()
    compile_s = min(_timed(lib.compile)[1] for _ in range(repeat))
    compiled = lib.compile()
    best = float("inf")
    for _ in range(repeat):
        rng, done, spent = random.Random(0), 0, 0.0
        while done < tokens:
            n, s = lib.run(compiled, rng, 64)
            done, spent = done + n, spent + s
        best = min(best, spent / done)
    return {"compile_ms": 1e3 * compile_s, "mask_us_per_token": 1e6 * best}


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--vocab", type=int, nargs="*", default=[1000, 32000])
    args = ap.parse_args()
    torch.set_num_threads(1)
    for size in args.vocab:
        with tempfile.TemporaryDirectory() as tmp:
            train_tokenizer(tmp, vocab_size=size)
            text = (Path(tmp) / "tokenizer.json").read_text()
        obj = json.loads(text)
        vocab = max(obj["model"]["vocab"].values()) + 1
        vb = byte_vocab(obj, vocab)
        print(f"vocabulary: {vocab} ids")
        makers: list[tuple[str, Callable[[], Lib]]] = [
            ("llguidance", lambda text=text, vocab=vocab: LLGuidance(text, vocab)),
            ("xgrammar", lambda vb=vb, vocab=vocab: XGrammar(vb, vocab)),
            ("outlines-core", lambda vb=vb, vocab=vocab: OutlinesCore(vb, vocab)),
        ]
        for name, make in makers:
            try:
                r = measure(make, args.tokens, args.repeat)
            except ImportError as exc:
                print(f"  {name:14s} not installed ({exc})")
                continue
            print(f"  {name:14s} compile {r['compile_ms']:9.1f} ms   mask {r['mask_us_per_token']:8.1f} us/token")


if __name__ == "__main__":
    main()
