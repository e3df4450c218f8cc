"""Engine: one model on one device running many sequence coroutines.

    engine = Engine("path/to/model_dir", dtype="float32")
    outs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0))

Lower level (the runtime's own face; the Dask layer uses it): add_request / step / stream,
suspend / resume (coroutine state to bytes and back), stats. The work is done by role objects
(intake, step loop, output processing, host KV, migration, reports) that this facade composes.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from ..config import EngineConfig
from ..malloc import restore_heap_reuse
from ..models.hub import model_dir
from ..models.info import ModelInfo
from ..models.model import Model
from ..offload import StoreOptions
from ..outputs import RequestOutput
from ..runtime.executor import Executor
from ..runtime.kv_cache import BlockAllocator
from ..runtime.policy import Scheduler, SchedulerConfig
from ..runtime.prefix_cache import PrefixCache
from ..runtime.sequence import SeqId, Sequence
from ..runtime.stats import RuntimeStats
from ..runtime.suspend import CoroutineCodec
from ..sampling_params import SamplingParams
from ..structured.rows import RowGrammars
from ..tokenizer import ChatPrompt
from . import report
from .core import Pace, StepLoop
from .device import device_class, kv_budget
from .intake import Intake, Prompt, broadcast_params
from .migration import Migration
from .outputs import OutputProcessor
from .protocol import LoadReport
from .swap import HostKV


class Engine:
    def __init__(self, model: str | Path, *, dtype: str | None = None, device: str | None = None,
                 **config_overrides: Any) -> None:
        """model: a model directory or a Hugging Face Hub id (`org/name`, `org/name@revision`).
        dtype/device None: dask.config `batchgen.dtype`/`batchgen.device`, else "auto" (the
        checkpoint's dtype on CUDA, float32 on CPU) / cuda when available."""
        self.config = c = EngineConfig.from_kwargs(dtype=dtype, device=device, **config_overrides)
        if c.restore_heap_reuse:
            restore_heap_reuse()  # process-wide, once: see malloc.py (Dask workers ran 1.34x slower without)
        path = model_dir(model)  # a Hugging Face id becomes its cached snapshot (downloaded once per host)
        self.model = Model.load(path, c.dtype, c.device, c.expert_memory_bytes, c.expert_host_memory_bytes,
                                StoreOptions(c.expert_eviction, c.expert_prefetch, c.expert_io_threads,
                                             c.expert_overlap_reads))
        c.resolve_batch_defaults(self.model.experts is not None)
        self.device_class = device_class(self.model.device, self.model.dtype, c)
        info = ModelInfo.for_spec(path, self.model.spec, c.max_model_len)
        self.model_dir, self.tokenizer, self.eos_token_ids = path, info.tokenizer, info.eos_token_ids
        self.vocab_size, self.max_model_len = info.vocab_size, info.max_model_len
        bs, kv_per_token = c.block_size, self.model.kv_bytes_per_token()
        most_bytes = c.max_num_seqs * -(-self.max_model_len // bs) * bs * kv_per_token  # every seat full
        num_blocks = c.num_kv_blocks or max(1, kv_budget(c, self.model.device, most_bytes) // (bs * kv_per_token))
        self.allocator = BlockAllocator(num_blocks, bs)
        # Exact for every supported model: KV depends on the token prefix alone, and sliding-window
        # layers keep every position's KV (masked, never freed), so a cached block is what the row
        # would compute itself. A pool that dropped out-of-window blocks would have to turn it off.
        self.prefix_cache = PrefixCache(self.allocator) if c.enable_prefix_caching else None
        self.scheduler = Scheduler(SchedulerConfig(c.max_num_seqs, c.max_num_batched_tokens,
                                                   c.eviction, c.admission_order),  # type: ignore[arg-type]
                                   self.allocator, self.prefix_cache)
        self.stats = RuntimeStats()
        kv_device = self.model.attention_on_host() if c.kv_cache_on_host else None
        graphs = None if c.enforce_eager else (self.max_model_len, c.max_num_seqs)
        self.executor = Executor(self.model, num_blocks, bs, self.stats, c.attention_kv_tokens, kv_device, graphs)
        self.codec = CoroutineCodec(self.model, c.kv_link_bytes_per_s)
        self.grammars = RowGrammars(self.tokenizer, self.vocab_size, self.eos_token_ids)  # structured outputs
        self._seqs: dict[SeqId, Sequence] = {}  # every request here, until its output is handed out
        self._ids = itertools.count()  # one id space for added and resumed requests
        pool_tokens = self.allocator.capacity_tokens
        self.pace = Pace(self.stats)
        self.intake = Intake(self.vocab_size, self.tokenizer, self.max_model_len, pool_tokens, self.grammars, c.seed)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len,
                                                self.grammars, self.stats)
        self.host_kv = HostKV(self.executor, kv_per_token, c.swap_space_bytes, c.host_link_bytes_per_s,
                              self.pace.recompute_tokens_per_s)
        self.loop = StepLoop(self.scheduler, self.executor, self.host_kv, self.output_processor, self.grammars,
                             self.eos_token_ids, self.vocab_size, pool_tokens, self.stats, self.pace)
        self.migration = Migration(self.codec, self.executor, self.allocator, self.scheduler, self.host_kv,
                                   self.intake, self.loop.release, c.max_num_seqs, self.pace.recompute_tokens_per_s)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, index: int = 0) -> SeqId:
        """Queue one request; a bad one finishes at once with finish_reason 'error'."""
        seq = self.intake.admit(SeqId(next(self._ids)), prompt, params, index)
        self._seqs[seq.seq_id] = seq
        if not seq.is_finished:
            self.scheduler.add(seq)
        return seq.seq_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[Sequence]:
        """Run one forward over the next plan; -> sequences that finished in it."""
        return self.loop.step()

    def output(self, seq: Sequence) -> RequestOutput:
        return self.output_processor.output(seq)

    # -- batch API --------------------------------------------------------------------------------
    def stream(self, prompts: Seq[Prompt], sampling: SamplingParams | Seq[SamplingParams] | None = None
               ) -> Iterator[tuple[int, RequestOutput]]:
        """Yield (input index, output) as each request finishes."""
        return self.run_requests(zip(prompts, broadcast_params(prompts, sampling)), max_in_flight=None)

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

    def chat(self, conversations: Seq[Any] | Seq[Seq[Any]],
             sampling: SamplingParams | Seq[SamplingParams] | None = None, *,
             chat_template_kwargs: Mapping[str, Any] | None = None, add_generation_prompt: bool = True
             ) -> list[RequestOutput]:
        """As vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a
        list of them, rendered by the model's chat template with `chat_template_kwargs` (e.g.
        {"enable_thinking": False}); outputs in input order. A malformed conversation fails
        alone (finish_reason 'error', the message naming the field)."""
        one = bool(conversations) and isinstance(conversations[0], Mapping)
        batch = [conversations] if one else list(conversations)
        prompts = [ChatPrompt(list(c) if isinstance(c, (list, tuple)) else c, add_generation_prompt,
                              chat_template_kwargs) for c in batch]
        return self.generate(prompts, sampling)

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
        return self.migration.suspend(seq, with_kv)

    def snapshot(self, seq_id: SeqId) -> bytes:
        """The coroutine's state as `suspend(seq_id, with_kv=False)` would give it, without removing
        it here: a checkpoint another engine can resume from (it recomputes the KV)."""
        return self.migration.snapshot(self.get(seq_id))

    def resume(self, state: bytes) -> SeqId:
        """Adopt a suspended coroutine; it continues exactly where it stopped."""
        seq_id = SeqId(next(self._ids))
        seq, kv = self.codec.decode(state, seq_id)
        self._seqs[seq_id] = seq
        self.migration.adopt(seq, kv)
        return seq_id

    # -- CoroutineEngine: the cluster runtime's face (cluster/runner.py) -----------------------------
    def run_step(self) -> list[int]:
        return [int(seq.seq_id) for seq in self.step()]

    def is_finished(self, cid: int) -> bool:
        return self.get(SeqId(cid)).is_finished

    def error_output(self, index: int, message: str) -> RequestOutput:
        return RequestOutput(index, [], [], "", "error", message)

    def progress(self, cid: int) -> int:
        return len(self.get(SeqId(cid)).output_ids)

    def work_done(self) -> int:
        return self.stats.generated_tokens

    # -- reports ----------------------------------------------------------------------------------
    def recompute_tokens_per_s(self) -> float:
        return self.pace.recompute_tokens_per_s()

    def load_report(self) -> LoadReport:
        """What the cluster layer needs to balance work: queue, running, KV use, tokens left."""
        return report.load_report(self.scheduler, self.allocator, self.config.max_num_seqs, self.device_class,
                                  self.model.experts)

    def load(self) -> dict[str, Any]:
        """load_report() as a dict, under its older name (it loads nothing, unlike Model.load)."""
        return report.load_dict(self.load_report())

    def stats_summary(self) -> dict[str, float]:
        return report.stats_summary(self.stats, self.model.experts, self.prefix_cache, self.pace.busy_s)

    def progress_status(self) -> str:
        """The progress line's engine figures: prefix-cache hit rate, expert tiers."""
        return report.progress_status(self.prefix_cache, self.expert_status())

    def expert_status(self) -> str:
        """The progress line's expert figures: hit rate per tier ('' with every expert resident)."""
        return report.expert_status(self.model.experts, self.stats.generated_tokens)

    def close(self) -> None:
        """Stop the expert reader threads and close the checkpoint files they read."""
        if self.model.experts is not None:
            self.model.experts.close()
