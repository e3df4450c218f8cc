"""Each row's grammar state, kept by the engine beside (never inside) the coroutine state.

A matcher is native llguidance state and is not pickled: when a row arrives without one (new,
resumed on another engine, migrated) or with one that does not match its tokens, it is rebuilt by
replaying the row's generated tokens into a fresh matcher of its (cached) grammar. Preemption
keeps the tokens, so it keeps the matcher; suspend drops it, and resume rebuilds it.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .bitmask import TokenBitmask
from .compiler import GrammarCompiler, GrammarError

if TYPE_CHECKING:
    from ..runtime.sequence import SeqId, Sequence
    from ..tokenizer import Tokenizer


@dataclass(slots=True)
class _Row:
    matcher: Any       # llguidance.LLMatcher
    num_tokens: int    # generated tokens consumed so far


@dataclass(slots=True)
class GrammarStats:
    mask_s: float = 0.0          # computing masks
    masked_rows: int = 0         # row-steps that computed a mask
    accept_s: float = 0.0        # advancing matchers by the sampled tokens
    rebuilt: int = 0             # matchers rebuilt from a row's tokens (resume, migration)


class RowGrammars:
    """seq_id -> matcher, and the batched mask for a step's sampling rows."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self._rows: dict[SeqId, _Row] = {}
        self._executor: Any = None
        self.stats = GrammarStats()

    def check(self, params: Any) -> None:
        """Compile (or find cached) the request's spec; raises GrammarError naming the field."""
        if params.structured_outputs is not None:
            self.compiler.template(params.structured_outputs)

    def _row(self, seq: Sequence) -> _Row:
        row = self._rows.get(seq.seq_id)
        if row is not None and row.num_tokens == len(seq.output_ids):
            return row
        matcher = self.compiler.matcher(seq.params.structured_outputs)
        if seq.output_ids and not matcher.consume_tokens(list(seq.output_ids)):
            raise GrammarError(f"structured_outputs: the row's tokens do not follow its grammar: "
                               f"{matcher.get_error()}")
        self.stats.rebuilt += bool(seq.output_ids)
        row = self._rows[seq.seq_id] = _Row(matcher, len(seq.output_ids))
        return row

    def bitmask(self, seqs: list[Sequence]) -> TokenBitmask | None:
        """Masks of the rows that have a constraint (None when none has): [G, W] int32."""
        t0 = time.perf_counter()
        idx: list[int] = []
        matchers: list[tuple[Any, int]] = []
        for i, seq in enumerate(seqs):
            if seq.params.structured_outputs is None:
                continue
            try:
                row = self._row(seq)
            except GrammarError:  # sampled unmasked; accept() then fails the row alone
                self._rows.pop(seq.seq_id, None)
                continue
            matchers.append((row.matcher, len(idx)))
            idx.append(i)
        if not idx:
            return None
        import llguidance  # not llguidance.torch: its import starts torch.compile (seconds)

        bits = torch.empty(len(idx), (self.compiler.n_vocab + 31) // 32, dtype=torch.int32)
        one = bits.shape[1] * 4
        if len(matchers) == 1:
            matchers[0][0].unsafe_compute_mask_ptr(bits.data_ptr(), one)
        else:
            if self._executor is None:  # native threads: masks of many rows at once, GIL released
                self._executor = llguidance.LLExecutor(max(1, min(8, os.cpu_count() or 1)))
            self._executor.unsafe_compute_mask_ptr(matchers, bits.data_ptr(), one, len(idx))
        self.stats.mask_s += time.perf_counter() - t0
        self.stats.masked_rows += len(idx)
        return TokenBitmask(idx, bits)

    def accept(self, seq: Sequence, token: int) -> bool:
        """Advance seq's matcher by its newest token (already appended to output_ids); True when
        the grammar is complete and admits nothing more. Raises GrammarError on a rejected token."""
        t0 = time.perf_counter()
        try:
            row = self._rows.get(seq.seq_id)
            if row is None or row.num_tokens != len(seq.output_ids) - 1:
                self._rows.pop(seq.seq_id, None)
                row = self._row(seq)  # replays every token, the newest included
            else:
                if not row.matcher.consume_token(token):
                    raise GrammarError(f"structured_outputs: token {token} is not allowed by the grammar "
                                       f"here: {row.matcher.get_error()}")
                row.num_tokens += 1
            return bool(row.matcher.is_stopped())
        finally:
            self.stats.accept_s += time.perf_counter() - t0

    def drop(self, seq_id: SeqId) -> None:
        self._rows.pop(seq_id, None)

    def summary(self, generated_tokens: int) -> dict[str, float]:
        s = self.stats
        return {"structured_mask_s": s.mask_s, "structured_accept_s": s.accept_s,
                "structured_masked_rows": float(s.masked_rows),
                "structured_mask_us_per_row": 1e6 * s.mask_s / s.masked_rows if s.masked_rows else 0.0,
                "structured_compiled": float(self.compiler.num_compiled),
                "structured_rebuilt": float(s.rebuilt)}
