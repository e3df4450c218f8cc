"""Decode steps replayed from CUDA graphs, one per batch-size bucket (graph_buckets.py), with
the Triton paged-attention and fused-MoE kernels inside: a decode step of a small MoE is
hundreds of kernel launches, and a graph launches them all at once.

A bucket's graph is captured the first time a decode step of that size runs (warmed up once
eagerly first, so Triton compiles outside the capture); all graphs share one memory pool and
one set of input buffers (each bucket reads the first rows). Only decode-only steps whose rows
all fit one attention micro-batch run here; everything else (prefill, chunks, batches above the
largest bucket) runs eagerly in the executor.

Never run on a GPU yet: the capture path is tested only under the `cuda` marker.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..models.attention import AttentionBatch
from ..models.cuda_decode import DecodeTables
from ..models.model import Model
from .graph_buckets import DecodeStep, capture_sizes, pad_decode, pick_bucket


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor, routed: list[torch.Tensor]) -> None:
        self.graph, self.logits, self.routed = graph, logits, routed  # outputs: [B, V], per MoE layer [B, A]


class DecodeGraphs:
    def __init__(self, model: Model, cache: torch.Tensor, block_size: int, max_model_len: int,
                 max_num_seqs: int) -> None:
        """cache: the pool [layers, slots + 1, W]; its last slot takes the padding rows' KV."""
        self.model, self.cache, self.block_size = model, cache, block_size
        self.pad_slot = cache.shape[1] - 1
        self.sizes = capture_sizes(max_num_seqs)
        dev, top = model.device, self.sizes[-1]
        width = -(-max_model_len // block_size)
        self.tokens = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.slots = torch.full((top,), self.pad_slot, dtype=torch.long, device=dev)
        self.lens = torch.ones(top, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(top, width, dtype=torch.int32, device=dev)
        self.rows = torch.arange(top, device=dev)
        self._graphs: dict[int, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def bucket_for(self, n: int) -> int | None:
        return pick_bucket(n, self.sizes)

    def run(self, rows: Sequence[tuple[int, int, Sequence[int]]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """rows: per decoding sequence (new token, tokens computed, block ids), n <= the largest
        bucket -> (logits [n, V] fp32, per MoE layer topk_ids [n, A])."""
        n = len(rows)
        bucket = self.bucket_for(n)
        assert bucket is not None, f"{n} rows exceed the largest graph ({self.sizes[-1]})"
        step = pad_decode(rows, bucket, self.block_size, self.pad_slot)
        self._load(step)
        graph = self._graphs.get(bucket) or self._capture(bucket)
        graph.graph.replay()
        return graph.logits[:n].clone(), [ids[:n] for ids in graph.routed]

    def _load(self, step: DecodeStep) -> None:
        b, width = step.bucket, len(step.tables[0])
        host = torch.tensor([step.tokens, step.positions, step.slots, step.context_lens], dtype=torch.long)
        self.tokens[:b].copy_(host[0], non_blocking=True)
        self.positions[:b].copy_(host[1], non_blocking=True)
        self.slots[:b].copy_(host[2], non_blocking=True)
        self.lens[:b].copy_(host[3], non_blocking=True)
        # columns past `width` keep stale ids: the kernel never reads past a row's context
        self.tables[:b, :width].copy_(torch.tensor(step.tables, dtype=torch.int32), non_blocking=True)

    def _forward(self, b: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        m = self.model
        batch = AttentionBatch(self.positions[:b], self.slots[:b], [], [], block_size=self.block_size,
                               decode_tables=DecodeTables(self.rows[:b], self.tables[:b], self.lens[:b],
                                                          self.block_size))
        routed: list[torch.Tensor] = []
        hidden = m.embed(self.tokens[:b])
        for layer in range(m.num_layers):
            hidden = m.attention_stage(layer, hidden, batch, self.cache[layer])
            hidden = m.ffn_stage(layer, hidden, routed.append if m.is_moe_layer(layer) else None)
        return m.logits(hidden), routed

    def _capture(self, b: int) -> _Graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(b)  # warm-up: Triton compiles, caches allocate, outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, routed = self._forward(b)
        self._graphs[b] = _Graph(graph, logits, routed)
        return self._graphs[b]
