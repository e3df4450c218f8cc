"""The step loop: schedule, move evicted and returning KV, run one forward (failing only the rows
an unreadable expert touches), sample, and hand each token to output processing.
"""
from __future__ import annotations

import time

import torch

from ..offload import ExpertReadError
from ..runtime.executor import Executor
from ..runtime.policy import Plan, ScheduledSeq, Scheduler
from ..runtime.sequence import Sequence
from ..runtime.stats import RuntimeStats
from ..sampler import sample
from ..structured.rows import RowGrammars
from .outputs import OutputProcessor
from .swap import HostKV


class Pace:
    """Seconds spent in steps and the recompute rate they give, which prices moving KV against
    recomputing it (swap-out, suspend)."""

    def __init__(self, stats: RuntimeStats) -> None:
        self.stats = stats
        self.busy_s = 0.0

    def recompute_tokens_per_s(self) -> float:
        done = self.stats.prompt_tokens - self.stats.cached_prompt_tokens + self.stats.generated_tokens
        return done / self.busy_s if self.busy_s > 0 else 0.0


class StepLoop:
    def __init__(self, scheduler: Scheduler, executor: Executor, host_kv: HostKV, outputs: OutputProcessor,
                 grammars: RowGrammars, eos_token_ids: list[int], vocab_size: int, pool_tokens: int,
                 stats: RuntimeStats, pace: Pace) -> None:
        self.scheduler, self.executor, self.host_kv, self.outputs = scheduler, executor, host_kv, outputs
        self.grammars, self.eos_token_ids, self.vocab_size = grammars, eos_token_ids, vocab_size
        self.pool_tokens, self.stats, self.pace = pool_tokens, stats, pace

    def step(self) -> list[Sequence]:
        """Run one forward over the next plan; -> sequences that finished in it."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.evicted)
        for ev in plan.evicted:
            self.host_kv.swap_out(ev.seq, ev.blocks, ev.num_computed)
        for seq in plan.swapped_in:
            self.host_kv.swap_in(seq)
        if not plan:
            return self._unblock()
        for item in plan.scheduled:
            seq, cached = item.seq, item.seq.num_cached_tokens or 0
            if seq.num_computed == cached and seq.num_preemptions == 0 and not seq.output_ids:
                self.stats.prompt_tokens += len(seq.prompt_ids)
                self.stats.cached_prompt_tokens += cached
        samplers, logits, failed = self._execute(plan.scheduled)
        finished: list[Sequence] = []
        for seq, why in failed:
            self.release(seq)
            seq.finish("error", why)
            finished.append(seq)
        if samplers:
            seqs = [item.seq for item in samplers]
            result = sample(logits, [s.params for s in seqs], [s.seed for s in seqs],
                            [len(s.output_ids) for s in seqs], [s.prompt_ids for s in seqs],
                            [s.output_ids for s in seqs], self.eos_token_ids, self.grammars.bitmask(seqs))
            for seq, tok, lp in zip(seqs, result.token_ids, result.logprobs):
                if self.outputs.append_token(seq, tok, lp):
                    self.release(seq)
                    finished.append(seq)
        self.pace.busy_s += time.perf_counter() - t0
        return finished

    def _execute(self, scheduled: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], torch.Tensor, list[tuple[Sequence, str]]]:
        """Run a forward; -> (samplers, their logits, rows failed with why). An expert that
        cannot be read from disk fails only the rows that route to it: rows are independent,
        so the forward is split in halves and rerun until each failing row stands alone (the
        halves recompute exactly what the whole would have; nothing is advanced on failure)."""
        try:
            samplers, logits = self.executor.execute(Plan(scheduled=scheduled))
            return samplers, logits, []
        except ExpertReadError as exc:
            if len(scheduled) == 1:
                return [], torch.empty(0, self.vocab_size), [(scheduled[0].seq, f"model weights unreadable: {exc}")]
        half = len(scheduled) // 2
        a, b = self._execute(scheduled[:half]), self._execute(scheduled[half:])
        logits = torch.cat([a[1], b[1]]) if a[0] and b[0] else (a[1] if a[0] else b[1])
        return a[0] + b[0], logits, a[2] + b[2]

    def release(self, seq: Sequence) -> None:
        """Give back everything a row holds here: pool blocks, grammar state, host KV."""
        self.scheduler.release(seq)
        self.grammars.drop(seq.seq_id)
        self.host_kv.drop(seq.seq_id)
        seq.num_swapped = 0

    def _unblock(self) -> list[Sequence]:
        """Nothing could be scheduled: the head of the queue can never fit the pool alone."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        self.release(seq)
        seq.finish("error", f"sequence of {seq.num_tokens} tokens does not fit the KV pool "
                            f"({self.pool_tokens} tokens)")
        return [seq]
