"""Output processing: what one sampled token does to its row (eos, stop token ids, stop strings,
grammar, length), the incremental detokenizing that stop strings need, and the RequestOutput
(batchgen/outputs.py) handed back for a finished row.
"""
from __future__ import annotations

from ..errors import RequestError
from ..outputs import RequestOutput
from ..runtime.sequence import Sequence
from ..runtime.stats import RuntimeStats
from ..sampling_params import SamplingParams, find_stop_span
from ..structured.rows import RowGrammars
from ..tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: list[int], max_model_len: int,
                 grammars: RowGrammars, stats: RuntimeStats) -> None:
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, eos_token_ids, max_model_len
        self.grammars, self.stats = grammars, stats

    def append_token(self, seq: Sequence, tok: int, lp: dict[int, float] | None) -> bool:
        """Add a sampled token to its row; -> whether the row finished with it."""
        p: SamplingParams = seq.params
        seq.output_ids.append(tok)
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(lp)
        self.stats.generated_tokens += 1
        n = len(seq.output_ids)
        if not p.ignore_eos and tok in self.eos_token_ids:
            seq.finish("stop")
        elif p.stop_token_ids and tok in p.stop_token_ids:
            seq.finish("stop")
        elif p.stop_list and self.tokenizer is not None and self._hit_stop_string(seq, n >= p.min_tokens):
            seq.finish("stop", why="stop-string")
        if not seq.is_finished and p.structured_outputs is not None:
            self._advance_grammar(seq, tok)
        if not seq.is_finished and (n >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            seq.finish("length")
        return seq.is_finished

    def _advance_grammar(self, seq: Sequence, tok: int) -> None:
        """Structured outputs: a grammar that is complete ends its row ("stop", also on the row's
        last allowed token); one whose state failed or that rejects the token fails the row alone."""
        try:
            if self.grammars.accept(seq, tok):
                seq.finish("stop", why="grammar")
        except RequestError as exc:
            seq.finish("error", str(exc))

    def _hit_stop_string(self, seq: Sequence, may_stop: bool) -> bool:
        """Only text new since the last token is searched, so a stop string produced before
        min_tokens never stops the request later (as vLLM)."""
        assert self.tokenizer is not None
        before = len(seq.text)
        new, prefix, read = self.tokenizer.decode_new(seq.output_ids, *seq.decode_offsets)
        # keep ~6 tokens of context behind the read offset, as vLLM's incremental detokenizer does
        seq.decode_offsets = (max(prefix, read - 6), read)
        seq.text += new
        span = find_stop_span(seq.text, seq.params.stop_list, before) if may_stop else None
        if span is None:
            return False
        seq.text = seq.text[:span[1] if seq.params.include_stop_str_in_output else span[0]]
        seq.text_is_final = True
        return True

    def output(self, seq: Sequence) -> RequestOutput:
        if seq.finish_reason == "error" or self.tokenizer is None:
            text = ""
        elif seq.text_is_final:
            text = seq.text  # already cut at the stop string
        else:
            text = self.tokenizer.decode(seq.output_ids)
        return RequestOutput(index=seq.request_index, prompt_token_ids=seq.prompt_ids,
                             token_ids=list(seq.output_ids), text=text, finish_reason=seq.finish_reason or "error",
                             error=seq.error, logprobs=seq.logprobs, num_preemptions=seq.num_preemptions,
                             num_cached_tokens=seq.num_cached_tokens or 0)
