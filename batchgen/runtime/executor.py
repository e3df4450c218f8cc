"""Runs one Plan on the device: the only runtime module that touches torch.

Within a forward, attention runs per micro-batch (bounded by KV tokens); the tokens of all
micro-batches then park at the MoE yield point of the layer and run the FFN/MoE stage combined,
so each expert GEMM sees the whole forward's tokens.
"""
from __future__ import annotations

import bisect

import torch

from batchgen_kernels.huge_pages import zeros_on_huge_pages

from ..models.attention import AttentionBatch, OutputRows
from ..models.cuda_decode import use_paged_kernel
from ..models.model import Model
from .policy import Plan, ScheduledSeq, split_micro_batches
from .stats import RuntimeStats


class Executor:
    def __init__(self, model: Model, num_blocks: int, block_size: int, stats: RuntimeStats,
                 attention_kv_tokens: int | None = None, kv_device: torch.device | None = None,
                 graphs: tuple[int, int] | None = None) -> None:
        """kv_device: where the KV pool lives (and so where attention runs); default the model's.
        graphs: (max_model_len, max_num_seqs) to replay decode steps from CUDA graphs where the
        device allows it (CUDA, KV pool on it, experts resident, triton); None: always eager."""
        self.model, self.block_size, self.stats = model, block_size, stats
        self.attention_kv_tokens = attention_kv_tokens
        self.kv_device = kv_device or model.device
        use_graphs = graphs is not None and self.kv_device == model.device and model.experts is None \
            and self.kv_device.type == "cuda" and use_paged_kernel(self.kv_device)
        # [layers, slots, W]: W = K and V of every kv head (GQA) or the latent (MLA); with graphs
        # one more slot, where padding rows write
        shape = (model.num_layers, num_blocks * block_size + int(use_graphs), model.spec.kv_width)
        # on the CPU on huge pages where they can be had: decode attention reads its blocks
        # scattered through the pool (1.03-1.22x, batchgen_kernels.huge_pages)
        self.cache = zeros_on_huge_pages(shape, model.dtype) if self.kv_device.type == "cpu" \
            else torch.zeros(shape, dtype=model.dtype, device=self.kv_device)
        self.graphs = None
        if use_graphs:
            from .cuda_graphs import DecodeGraphs

            assert graphs is not None
            self.graphs = DecodeGraphs(model, self.cache, block_size, *graphs)

    def execute(self, plan: Plan) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """-> (the scheduled sequences that sample, in row order; their logits [N, V] fp32)."""
        if self.graphs is not None and all(i.num_new == 1 and i.samples for i in plan.scheduled) \
                and self.graphs.bucket_for(len(plan.scheduled)) is not None:
            return self._execute_graph(plan.scheduled)
        groups = split_micro_batches(plan.scheduled, self.attention_kv_tokens)
        ordered = [item for g in groups for item in g]
        dev = self.model.device
        tokens: list[int] = []
        for item in ordered:
            tokens.extend(_slice_tokens(item.seq.prompt_ids, item.seq.output_ids, item.seq.num_computed, item.num_new))
        batches: list[tuple[slice, AttentionBatch]] = []
        row = 0
        for g in groups:
            n = sum(i.num_new for i in g)
            items = [(i.seq.num_computed, i.num_new, i.seq.block_ids) for i in g]
            batches.append((slice(row, row + n), AttentionBatch.build(items, self.block_size, self.kv_device,
                                                                      self.cache.dtype)))
            row += n
        sample_rows, samplers, row = [], [], 0
        for item in ordered:
            row += item.num_new
            if item.samples:
                sample_rows.append(row - 1)
                samplers.append(item)
        # Past the last layer's KV write only the sampling rows' hidden state is ever read (by the
        # logits): that layer's attention, output projection and FFN (and its queries, where the
        # projection is in tiles) run on those rows alone; llama.cpp cuts its residual and FFN
        # the same way. The rest of a prompt chunk's rows are about 1/L of its work. One
        # OutputRows per attention batch, in its rows.
        keeps: list[OutputRows] | None = None
        if len(sample_rows) < len(tokens):
            keeps, first = [], 0
            for rows, _ in batches:  # (sample_rows ascending: each batch's are a run of them)
                end = bisect.bisect_left(sample_rows, rows.stop, first)
                kept = [(sample_rows[k] - rows.start, samplers[k]) for k in range(first, end)]
                keeps.append(OutputRows.build([r for r, _ in kept], rows.stop - rows.start,
                                              [(i.seq.num_computed + i.num_new - 1, i.seq.block_ids) for _, i in kept],
                                              self.block_size, self.kv_device, self.cache.dtype))
                first = end
        hidden = self.model.embed(torch.tensor(tokens, dtype=torch.long, device=dev))
        routed: list[torch.Tensor] = []  # per MoE layer: topk_ids [T, A], read back once per forward
        record = routed.append
        last = self.model.num_layers - 1
        # the MoE layer whose next MoE stage is the last layer's (-1: none)
        before_last = max((i for i in range(last) if self.model.is_moe_layer(i)), default=-1) \
            if self.model.is_moe_layer(last) else -1
        for layer in range(self.model.num_layers):
            cache = self.cache[layer]
            if layer == last and keeps is not None:  # [sampling rows, H], in row order
                parts = [self.model.attention_stage(layer, hidden[rows] if len(batches) > 1 else hidden, batch, cache,
                                                    keep) for (rows, batch), keep in zip(batches, keeps)]
                hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
                if not sample_rows:  # a prompt chunk that samples nothing: no FFN to run
                    break
            elif len(batches) == 1:  # one attention batch: no slice to write back into (a [T, H] copy)
                hidden = self.model.attention_stage(layer, hidden, batches[0][1], cache)
            else:
                for rows, batch in batches:
                    hidden[rows] = self.model.attention_stage(layer, hidden[rows], batch, cache)
            moe = self.model.is_moe_layer(layer)
            if moe:
                self.stats.moe_batches.append(hidden.shape[0])
            # the expert store guesses the next MoE stage's experts from these rows' routing: the
            # last layer's stage runs the sampling rows only
            ahead = torch.tensor(sample_rows, dtype=torch.long, device=dev) \
                if keeps is not None and layer == before_last else None
            hidden = self.model.ffn_stage(layer, hidden, record if moe else None, ahead)
        if routed:
            counts = torch.cat([torch.bincount(ids.flatten()) for ids in routed]).tolist()
            self.stats.expert_call_tokens.extend(c for c in counts if c > 0)
        self.stats.forwards += 1
        self.stats.attention_batches.extend(rows.stop - rows.start for rows, _ in batches)
        for item in ordered:
            item.seq.num_computed += item.num_new
        if not sample_rows:
            return [], torch.empty(0, self.model.spec.vocab_size)
        return samplers, self.model.logits(hidden)

    def _execute_graph(self, items: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """A decode-only step replayed from the CUDA graph of its batch-size bucket."""
        assert self.graphs is not None
        rows = [(_slice_tokens(i.seq.prompt_ids, i.seq.output_ids, i.seq.num_computed, 1)[0], i.seq.num_computed,
                 i.seq.block_ids) for i in items]
        logits, routed = self.graphs.run(rows)
        n = len(items)
        self.stats.forwards += 1
        self.stats.graph_steps += 1
        self.stats.attention_batches.append(n)
        self.stats.moe_batches.extend([n] * len(routed))
        if routed:
            counts = torch.cat([torch.bincount(ids.flatten()) for ids in routed]).cpu()
            self.stats.expert_call_tokens.extend(int(c) for c in counts if c > 0)
        for item in items:
            item.seq.num_computed += 1
        return items, logits

    # -- KV travelling with a suspended / migrated coroutine --------------------------------------
    def read_kv(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """-> host copy [layers, num_tokens, W] of a sequence's cached KV, position order."""
        slots = self._slots(block_ids, num_tokens)
        return self.cache[:, slots].cpu()

    def write_kv(self, block_ids: list[int], kv: torch.Tensor) -> None:
        slots = self._slots(block_ids, kv.shape[1])
        self.cache[:, slots] = kv.to(device=self.cache.device, dtype=self.cache.dtype)

    def _slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        blocks = torch.tensor(block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size)).flatten()
        return slots[:num_tokens].to(self.cache.device)


def _slice_tokens(prompt: list[int], output: list[int], start: int, n: int) -> list[int]:
    """(prompt + output)[start:start+n] without building the concatenation (decode is the hot path)."""
    p = len(prompt)
    if start >= p:
        return output[start - p:start - p + n]
    return prompt[start:start + n] + output[:max(0, start + n - p)]
