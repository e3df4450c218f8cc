"""Engine: one model on one device running many sequence coroutines.

    engine = Engine("path/to/model_dir", dtype="float32")
    outs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0))

Lower level (the runtime's own face; the Dask layer uses it): add_request / step / stream,
suspend / resume (coroutine state to bytes and back), stats.
"""
from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterable, Iterator, Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from .config import EngineConfig
from .errors import RequestError
from .malloc import restore_heap_reuse
from .models.info import ModelInfo
from .models.model import Model
from .offload import ExpertReadError, StoreOptions
from .outputs import RequestOutput
from .runtime.executor import Executor
from .runtime.kv_cache import BlockAllocator
from .runtime.policy import Plan, ScheduledSeq, Scheduler, SchedulerConfig, prefer_transfer
from .runtime.prefix_cache import PrefixCache
from .runtime.requests import check_length, check_params, prompt_to_ids
from .runtime.sequence import SeqId, SeqStatus, Sequence
from .runtime.stats import RuntimeStats
from .runtime.suspend import CoroutineCodec
from .sampler import sample
from .sampling_params import SamplingParams, find_stop_span
from .structured.rows import RowGrammars

Prompt = str | list[int]


class Engine:
    def __init__(self, model: str | Path, *, dtype: str | None = None, device: str | None = None,
                 **config_overrides: Any) -> None:
        """dtype/device None: dask.config `batchgen.dtype`/`batchgen.device`, else "auto" (the
        checkpoint's dtype on CUDA, float32 on CPU) / cuda when available."""
        self.config = EngineConfig.from_kwargs(dtype=dtype, device=device, **config_overrides)
        if self.config.restore_heap_reuse:
            restore_heap_reuse()  # process-wide, once: see malloc.py (Dask workers run 1.34x slower without)
        path = Path(model).expanduser()
        c = self.config
        self.model = Model.load(path, c.dtype, c.device, c.expert_memory_bytes, c.expert_host_memory_bytes,
                                StoreOptions(c.expert_eviction, c.expert_prefetch, c.expert_io_threads,
                                             c.expert_overlap_reads))
        self.config.resolve_batch_defaults(self.model.experts is not None)
        self.device_class = device_class(self.model.device, self.model.dtype, c)
        info = ModelInfo.for_spec(path, self.model.spec, self.config.max_model_len)
        self.model_dir, self.tokenizer, self.eos_token_ids = path, info.tokenizer, info.eos_token_ids
        self.vocab_size, self.max_model_len = info.vocab_size, info.max_model_len
        bs = self.config.block_size
        num_blocks = self.config.num_kv_blocks or max(1, self._kv_budget() // (bs * self.model.kv_bytes_per_token()))
        self.allocator = BlockAllocator(num_blocks, bs)
        # Exact for every supported model: KV depends on the token prefix alone, and sliding-window
        # layers keep every position's KV (masked, never freed), so a cached block is what the row
        # would compute itself. A pool that dropped out-of-window blocks would have to turn it off.
        self.prefix_cache = PrefixCache(self.allocator) if self.config.enable_prefix_caching else None
        self.scheduler = Scheduler(SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                                   self.config.eviction, self.config.admission_order),  # type: ignore[arg-type]
                                   self.allocator, self.prefix_cache)
        self.stats = RuntimeStats()
        kv_device = self.model.attention_on_host() if self.config.kv_cache_on_host else None
        graphs = None if self.config.enforce_eager else (self.max_model_len, self.config.max_num_seqs)
        self.executor = Executor(self.model, num_blocks, bs, self.stats, self.config.attention_kv_tokens, kv_device,
                                 graphs)
        self.codec = CoroutineCodec(self.model, self.config.kv_link_bytes_per_s)
        self._seqs: dict[SeqId, Sequence] = {}
        self._ids = itertools.count()
        self._rng = random.Random(self.config.seed)
        self._busy_s = 0.0
        self._host_kv: dict[SeqId, Any] = {}  # swapped-out KV [layers, tokens, W] on the host
        self.grammars = RowGrammars(self.tokenizer, self.vocab_size, self.eos_token_ids)  # structured outputs

    def _kv_budget(self) -> int:
        """Bytes for the KV pool: as configured; else on CUDA what the utilization target leaves
        after the weights (and whatever else holds the device), in host memory 1 GiB."""
        if self.config.kv_cache_bytes is not None:
            return self.config.kv_cache_bytes
        dev = self.model.device
        if dev.type == "cuda" and not self.config.kv_cache_on_host:
            free, total = torch.cuda.mem_get_info(dev)
            return max(0, int(free - (1 - self.config.gpu_memory_utilization) * total))
        return 1 << 30

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, index: int = 0) -> SeqId:
        """Queue one request; a bad one finishes at once with finish_reason 'error'."""
        params = SamplingParams() if params is None else params
        seq_id = SeqId(next(self._ids))
        seed = getattr(params, "seed", None)
        seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else self._rng.getrandbits(63)
        try:
            params = check_params(params, self.vocab_size)
            ids = prompt_to_ids(prompt, self.tokenizer, self.vocab_size)
            check_length(len(ids), params, self.max_model_len, self.allocator.capacity_tokens)
            self.grammars.check(params)  # compiled once per distinct spec
        except RequestError as exc:
            seq = Sequence(seq_id, index, [], params, seed)
            seq.finish("error", str(exc))
            self._seqs[seq_id] = seq
            return seq_id
        seq = Sequence(seq_id, index, ids, params, seed, logprobs=[] if params.logprobs is not None else None)
        self._seqs[seq_id] = seq
        self.scheduler.add(seq)
        return seq_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[Sequence]:
        """Run one forward over the next plan; -> sequences that finished in it."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.evicted)
        for ev in plan.evicted:
            self._maybe_swap_out(ev.seq, ev.blocks, ev.num_computed)
        for seq in plan.swapped_in:
            self.executor.write_kv(seq.block_ids, self._host_kv.pop(seq.seq_id))
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
            self._release(seq)
            seq.finish("error", why)
            finished.append(seq)
        if samplers:
            seqs = [item.seq for item in samplers]
            result = sample(logits, [s.params for s in seqs], [s.seed for s in seqs],
                            [len(s.output_ids) for s in seqs], [s.prompt_ids for s in seqs],
                            [s.output_ids for s in seqs], self.eos_token_ids, self.grammars.bitmask(seqs))
            for seq, tok, lp in zip(seqs, result.token_ids, result.logprobs):
                if self._append_token(seq, tok, lp):
                    self._release(seq)
                    finished.append(seq)
        self._busy_s += time.perf_counter() - t0
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

    def _advance_grammar(self, seq: Sequence, tok: int) -> None:
        """Structured outputs: a grammar that is complete ends its row ("stop", also on the row's
        last allowed token); one whose state failed or that rejects the token fails the row alone."""
        try:
            if self.grammars.accept(seq, tok):
                seq.finish("stop", why="grammar")
        except RequestError as exc:
            seq.finish("error", str(exc))

    def _maybe_swap_out(self, seq: Sequence, blocks: list[int], num_computed: int) -> None:
        """Keep an evicted coroutine's KV in host memory when that beats recomputing it."""
        nbytes = num_computed * self.model.kv_bytes_per_token()
        if self._host_kv_bytes + nbytes > self.config.swap_space_bytes or not prefer_transfer(
                num_computed, nbytes, self.config.host_link_bytes_per_s, self.recompute_tokens_per_s()):
            return
        self._host_kv[seq.seq_id] = self.executor.read_kv(blocks, num_computed)
        seq.num_swapped = num_computed
        seq.transition(SeqStatus.SWAPPED, "evict:swap-out")

    def _release(self, seq: Sequence) -> None:
        self.scheduler.release(seq)
        self.grammars.drop(seq.seq_id)
        self._host_kv.pop(seq.seq_id, None)
        seq.num_swapped = 0

    @property
    def _host_kv_bytes(self) -> int:
        return sum(kv.numel() * kv.element_size() for kv in self._host_kv.values())

    def _unblock(self) -> list[Sequence]:
        """Nothing could be scheduled: the head of the queue can never fit the pool alone."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        self._release(seq)
        seq.finish("error", f"sequence of {seq.num_tokens} tokens does not fit the KV pool "
                            f"({self.allocator.capacity_tokens} tokens)")
        return [seq]

    def _append_token(self, seq: Sequence, tok: int, lp: dict[int, float] | None) -> bool:
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

    # -- batch API --------------------------------------------------------------------------------
    def stream(self, prompts: Seq[Prompt], sampling: SamplingParams | Seq[SamplingParams] | None = None
               ) -> Iterator[tuple[int, RequestOutput]]:
        """Yield (input index, output) as each request finishes."""
        return self.run_requests(zip(prompts, self._broadcast(prompts, sampling)), max_in_flight=None)

    def run_requests(self, requests: Iterable[tuple[Prompt, SamplingParams]], max_in_flight: int | None = 1024
                     ) -> Iterator[tuple[int, RequestOutput]]:
        """Yield (position in `requests`, output) as each finishes, pulling requests lazily.

        At most max_in_flight of them are in the engine at once (None: all), and the engine is
        topped up as rows finish, so a file of millions of rows streams through in bounded
        memory without the batch draining between chunks.
        """
        source = enumerate(requests)
        mine: set[SeqId] = set()
        exhausted = False
        while True:
            while not exhausted and (max_in_flight is None or len(mine) < max_in_flight):
                nxt = next(source, None)
                if nxt is None:
                    exhausted = True
                    break
                index, (prompt, params) = nxt
                seq_id = self.add_request(prompt, params, index=index)
                if self._seqs[seq_id].is_finished:  # rejected at the door
                    yield index, self.output(self._seqs.pop(seq_id))
                else:
                    mine.add(seq_id)
            if not mine:
                return
            if not self.scheduler.has_work:
                raise RuntimeError(f"{len(mine)} requests left this engine unfinished (suspended elsewhere?)")
            for seq in self.step():
                if seq.seq_id in mine:
                    mine.discard(seq.seq_id)
                    yield seq.request_index, self.output(self._seqs.pop(seq.seq_id))

    def generate(self, prompts: Seq[Prompt], sampling: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Outputs in input order."""
        outs: list[RequestOutput | None] = [None] * len(prompts)
        for i, out in self.stream(prompts, sampling):
            outs[i] = out
        return outs  # type: ignore[return-value]

    @staticmethod
    def _broadcast(prompts: Seq[Prompt], sampling: Any) -> list[Any]:
        if isinstance(prompts, (str, bytes)):
            raise TypeError("prompts must be a list of prompts (strings or token-id lists), not one string")
        if sampling is None or isinstance(sampling, SamplingParams):
            return [sampling or SamplingParams()] * len(prompts)
        sampling = list(sampling)
        if len(sampling) != len(prompts):
            raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts")
        return sampling

    # -- coroutine API ----------------------------------------------------------------------------
    def get(self, seq_id: SeqId) -> Sequence:
        if seq_id not in self._seqs:
            raise KeyError(f"no sequence {seq_id} in this engine (finished and handed out, or suspended)")
        return self._seqs[seq_id]

    def pop_output(self, seq_id: SeqId) -> RequestOutput:
        """Hand back a finished request's output and forget it."""
        seq = self.get(seq_id)
        if not seq.is_finished:
            raise ValueError(f"sequence {seq_id} is not finished")
        return self.output(self._seqs.pop(seq_id))

    def suspend(self, seq_id: SeqId, with_kv: bool | None = None) -> bytes:
        """Park a coroutine at its inter-forward yield point, remove it here, return its state.

        with_kv: True sends the KV cache along, False recomputes it on resume, None picks the
        cheaper by the codec's cost model (bytes to send vs tokens to recompute).
        """
        seq = self.get(seq_id)
        del self._seqs[seq_id]
        kv = None
        if with_kv is None:
            with_kv = self.codec.prefer_kv(seq.num_computed or seq.num_swapped, self.recompute_tokens_per_s())
        if with_kv and seq.num_computed and seq.block_ids:
            kv = self.executor.read_kv(seq.block_ids, seq.num_computed)
        elif with_kv and seq.num_swapped:
            kv = self._host_kv[seq_id]
        if not seq.is_finished:
            self._release(seq)
        return self.codec.encode(seq, kv)

    def snapshot(self, seq_id: SeqId) -> bytes:
        """The coroutine's state as `suspend(seq_id, with_kv=False)` would give it, without removing
        it here: a checkpoint another engine can resume from (it recomputes the KV)."""
        return self.codec.encode(self.get(seq_id), None)

    def resume(self, state: bytes) -> SeqId:
        """Adopt a suspended coroutine; it continues exactly where it stopped."""
        seq_id = SeqId(next(self._ids))
        seq, kv = self.codec.decode(state, seq_id)
        self._seqs[seq_id] = seq
        if seq.is_finished:
            return seq_id
        try:  # this engine's context and pool may be smaller than the one it came from
            check_params(seq.params, self.vocab_size)
            check_length(len(seq.prompt_ids), seq.params, self.max_model_len, self.allocator.capacity_tokens)
            self.grammars.check(seq.params)
        except RequestError as exc:
            seq.finish("error", f"cannot resume here: {exc}")
            return seq_id
        n = kv.shape[1] if kv is not None else 0
        if n and self.allocator.can_allocate(self.allocator.extra_blocks(0, n + 1)) \
                and len(self.scheduler.running) < self.config.max_num_seqs:
            seq.block_ids = self.allocator.allocate(self.allocator.extra_blocks(0, n))
            self.executor.write_kv(seq.block_ids, kv)
            seq.num_computed = n
            seq.transition(SeqStatus.RUNNING, "resume:with-kv")
            self.scheduler.running.append(seq)
            return seq_id
        nbytes = n * self.model.kv_bytes_per_token()
        if n and self._host_kv_bytes + nbytes <= self.config.swap_space_bytes:
            self._host_kv[seq_id] = kv  # no room in the pool now: wait in host memory
            seq.num_swapped = n
            seq.transition(SeqStatus.SWAPPED, "resume:kv-to-host")
        else:
            seq.transition(SeqStatus.WAITING, "resume:recompute")
        seq.num_computed = 0
        self.scheduler.add(seq)
        return seq_id

    def recompute_tokens_per_s(self) -> float:
        done = self.stats.prompt_tokens - self.stats.cached_prompt_tokens + self.stats.generated_tokens
        return done / self._busy_s if self._busy_s > 0 else 0.0

    def load(self) -> dict[str, Any]:
        """What the cluster layer needs to balance work: queue, running, KV use, tokens left."""
        unfinished = list(self.scheduler.waiting) + self.scheduler.running
        return {
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "kv_used_fraction": 1 - self.allocator.num_free / self.allocator.num_blocks,
            "kv_capacity_tokens": self.allocator.capacity_tokens, "max_num_seqs": self.config.max_num_seqs,
            "device_class": self.device_class,
            "remaining_tokens": sum(s.remaining_tokens for s in unfinished),
            "remaining_by_seq": {int(s.seq_id): s.remaining_tokens for s in unfinished},
        }

    def stats_summary(self) -> dict[str, float]:
        summary = self.stats.summary()
        if self.model.experts is not None:  # experts tiered over device / host / disk
            summary.update(self.model.experts.summary(self.stats.generated_tokens))
            busy = self._busy_s
            summary["expert_fetch_wait_fraction"] = summary["expert_fetch_wait_s"] / busy if busy > 0 else 0.0
        if self.prefix_cache is not None:
            summary.update(self.prefix_cache.summary())
        return summary

    def progress_status(self) -> str:
        """The progress line's engine figures: prefix-cache hit rate, expert tiers."""
        parts = [self.prefix_cache.status() if self.prefix_cache is not None else "", self.expert_status()]
        return ", ".join(p for p in parts if p)

    def expert_status(self) -> str:
        """The progress line's expert figures: hit rate per tier ('' with every expert resident)."""
        store = self.model.experts
        if store is None or not store.stats.experts_needed:
            return ""
        s = store.summary(self.stats.generated_tokens)
        text = f"experts: {100 * s['expert_hit_rate_device']:.0f}% in pool"
        if store.plan.from_disk and not store.plan.shared:
            text += f", {100 * s['expert_hit_rate_host']:.0f}% of misses in host memory"
        per_token = s["expert_bytes_from_disk"] + s["expert_bytes_from_host"]
        return text + f", {per_token / 2**20:,.1f} MiB/token moved"

    def close(self) -> None:
        """Stop the expert reader threads and close the checkpoint files they read."""
        if self.model.experts is not None:
            self.model.experts.close()


def device_class(device: torch.device, dtype: torch.dtype, config: EngineConfig) -> str:
    """What sets an engine's pace besides the rows it runs: the device model, the dtype, CPU
    threads, and where experts and KV live. The balancer counts engines of one class as equally
    fast (cluster/balance.py relative_speeds)."""
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{torch.get_num_threads()} threads"
    tiers = ""
    if config.expert_memory_bytes is not None or config.expert_host_memory_bytes is not None:
        tiers = f" experts {config.expert_memory_bytes}/{config.expert_host_memory_bytes} B"
    return f"{device.type} {where} {str(dtype).removeprefix('torch.')}{tiers}{' kv-on-host' if config.kv_cache_on_host else ''}"
