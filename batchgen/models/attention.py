"""Attention over a paged KV cache, for a flat batch of tokens from many sequences.

Shape legend: T new tokens in the batch, S sequences, Q new tokens of one sequence, L context
length (padded to the longest in a group), Hq query heads, Hk key/value heads, D head dim,
W cached floats per token (K and V for GQA, the latent for MLA).

Decoding sequences (one new token each) go to a paged kernel that reads the cache in place
where the device has one (`cuda_decode.use_paged_kernel`: Triton on CUDA, C++ on CPU), else
attend in padded batches of similar context length (blocks gathered per group). Prefill chunks
attend one sequence at a time, unpadded; a sequence's first chunk attends its fresh K/V with
SDPA's causal mask, later chunks read their blocks back. On CPU, a chunk of short context joins
the decodes instead, one kernel row per token (its causal context through the block table): one
call for all short prompts instead of an SDPA call each (`paged_prefill_context`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batchgen_kernels import rope_kv_write_cpu
from batchgen_kernels.tiled_linear import linear, weight_rows_from

from .cuda_decode import DecodeTables, gqa_decode, use_fused_rope, use_paged_kernel
from .layers import rms_norm
from .rope import RotaryEmbedding
from .spec import GQASpec
from .weights import GQAWeights

# gathered cache rows [..., L, W] -> (k [..., L, Hk, Dk], v [..., L, Hk, Dv])
KVExpander = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first row of this chunk in the flat batch
    num_tokens: int
    block_table: torch.Tensor  # [blocks] the sequence's cache blocks covering its context
    context: int  # L: tokens of context, this chunk's included
    positions: torch.Tensor  # [Q]
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # by window: [1, Q, L]

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            self.masks[window] = _allowed(self.positions.unsqueeze(0), self.context, window)
        return self.masks[window]


@dataclass(slots=True)
class DecodeGroup:
    """Decoding sequences of similar context length, attended as one batch padded to whole blocks."""

    rows: torch.Tensor  # [Sg] rows of their single new tokens in the flat batch
    block_table: torch.Tensor  # [Sg, blocks] cache blocks of their contexts (padding -> block 0)
    positions: torch.Tensor  # [Sg]
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # by window: [Sg, 1, L]

    def mask(self, window: int | None, num_keys: int) -> torch.Tensor:
        if window not in self.masks:
            self.masks[window] = _allowed(self.positions.unsqueeze(-1), num_keys, window)
        return self.masks[window]


@dataclass(slots=True)
class AttentionBatch:
    """Where every token of a flat batch sits in the paged cache; built once per forward."""

    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] cache slot that receives each new token's KV
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    block_size: int
    rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # by id(rotary)
    decode_tables: DecodeTables | None = None  # decodes for the paged kernel (CUDA, CPU), no groups
    # the decodes as (row, context length, block ids), kept where the CPU kernel also takes short
    # prefill chunks (token_tables); None elsewhere
    cpu_decodes: list[tuple[int, int, Sequence[int]]] | None = None
    token_tables_by_limit: dict[int, tuple[DecodeTables | None, list[PrefillChunk]]] = field(default_factory=dict)

    def rope_tables(self, rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of this batch's positions, looked up once per forward, not per layer."""
        key = id(rotary)
        if key not in self.rope:
            self.rope[key] = rotary.tables(self.positions)
        return self.rope[key]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def token_tables(self, max_context: int) -> tuple[DecodeTables | None, list[PrefillChunk]]:
        """-> (tables for the CPU paged kernel: the decodes and every token of the prefill chunks
        whose context is at most max_context, in row order; the prefill chunks left). A chunk's
        token at position p reads positions 0 .. p (the kernel's causal context) through its
        sequence's block table. Built once per forward and limit, not per layer."""
        if self.cpu_decodes is None or max_context < 1:
            return self.decode_tables, self.prefills
        if max_context not in self.token_tables_by_limit:
            short = [c for c in self.prefills if c.context <= max_context]
            rest = [c for c in self.prefills if c.context > max_context]
            tables = self.decode_tables
            if short:
                tables = _token_tables(self.cpu_decodes, short, self.block_size, self.positions.device)
            self.token_tables_by_limit[max_context] = (tables, rest)
        return self.token_tables_by_limit[max_context]

    @staticmethod
    def build(items: Sequence[tuple[int, int, Sequence[int]]], block_size: int,
              device: torch.device, dtype: torch.dtype | None = None) -> AttentionBatch:
        """items: per sequence (num_computed, num_new, block_ids); tokens laid out in that order.
        dtype: the KV pool's; decodes go to a paged kernel where `use_paged_kernel` has one."""
        positions: list[int] = []
        slots: list[int] = []
        decodes: list[tuple[int, int, Sequence[int]]] = []  # (row, context length, block ids)
        prefills: list[PrefillChunk] = []

        def t(x: object) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        for computed, new, blocks in items:
            start, end = len(positions), computed + new
            positions.extend(range(computed, end))
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(computed, end))
            if new == 1:
                decodes.append((start, end, blocks))
            else:
                table = t(list(blocks[:-(-end // block_size)]))
                prefills.append(PrefillChunk(start, new, table, end, t(list(range(computed, end)))))

        kernel = use_paged_kernel(device, dtype)
        tables = DecodeTables.build(decodes, block_size, device) if decodes and kernel else None
        groups = [] if kernel else [_decode_group(g, block_size, device) for g in _by_length(decodes)]
        return AttentionBatch(positions=t(positions), slot_mapping=t(slots), decode_groups=groups,
                              prefills=prefills, block_size=block_size, decode_tables=tables,
                              cpu_decodes=decodes if kernel and device.type == "cpu" else None)


@dataclass(frozen=True, slots=True)
class OutputRows:
    """The rows of an attention batch whose attention output is wanted (the last layer's, where
    only the rows that sample are read on): `index` into the batch's rows (ascending), `others`
    the rest, and `batch` the wanted rows as single-token rows at their positions, attending their
    context through the cache (which the stage writes for every row first)."""

    index: torch.Tensor
    others: torch.Tensor
    batch: AttentionBatch

    @staticmethod
    def build(rows: Sequence[int], num_rows: int, items: Sequence[tuple[int, Sequence[int]]], block_size: int,
              device: torch.device, dtype: torch.dtype | None = None) -> OutputRows:
        """rows: of the batch's num_rows rows; items: per wanted row (its position, block ids)."""
        wanted = set(rows)
        return OutputRows(torch.tensor(rows, dtype=torch.long, device=device),
                          torch.tensor([r for r in range(num_rows) if r not in wanted], dtype=torch.long, device=device),
                          AttentionBatch.build([(p, 1, b) for p, b in items], block_size, device, dtype))


def _token_tables(decodes: list[tuple[int, int, Sequence[int]]], chunks: list[PrefillChunk], block_size: int,
                  device: torch.device) -> DecodeTables:
    """The decodes and every token of `chunks` as paged-kernel rows, in batch row order. The
    decodes become tensors in one go (no tensor per decode row: this runs every forward that
    carries a short prompt), each chunk in a few tensor operations."""
    used = [-(-n // block_size) for _, n, _ in decodes]  # blocks each decode's context covers
    width = max(used + [c.block_table.shape[0] for c in chunks])
    rows = [torch.tensor([r for r, _, _ in decodes], dtype=torch.long)]
    lens = [torch.tensor([n for _, n, _ in decodes], dtype=torch.int32)]
    tables = [torch.tensor([list(b[:k]) + [0] * (width - k) for (_, _, b), k in zip(decodes, used)],
                           dtype=torch.int32).view(len(decodes), width)]
    for c in chunks:
        rows.append(torch.arange(c.start, c.start + c.num_tokens))
        lens.append((c.positions + 1).to(torch.int32))
        tables.append(F.pad(c.block_table.to(torch.int32), (0, width - c.block_table.shape[0]))
                      .expand(c.num_tokens, width))
    row = torch.cat(rows)
    order = torch.argsort(row)
    return DecodeTables(row[order].to(device), torch.cat(tables)[order].to(device), torch.cat(lens)[order].to(device),
                        block_size)


# A decode group closes when the next context is this much longer than its shortest one, once it
# has MIN_DECODE_GROUP sequences: padding stays under ~25% without many tiny attention calls.
DECODE_GROUP_SPREAD = 1.25
MIN_DECODE_GROUP = 16


def _by_length(decodes: list[tuple[int, int, Sequence[int]]]) -> list[list[tuple[int, int, Sequence[int]]]]:
    groups: list[list[tuple[int, int, Sequence[int]]]] = []
    for item in sorted(decodes, key=lambda d: d[1]):
        group = groups[-1] if groups else None
        if group is None or (len(group) >= MIN_DECODE_GROUP and item[1] > DECODE_GROUP_SPREAD * group[0][1]):
            groups.append([item])
        else:
            group.append(item)
    return groups


def _decode_group(group: list[tuple[int, int, Sequence[int]]], block_size: int, device: torch.device) -> DecodeGroup:
    num_blocks = -(-group[-1][1] // block_size)  # sorted by context length
    table = [list(blocks[:num_blocks]) + [0] * (num_blocks - min(len(blocks), num_blocks)) for _, _, blocks in group]
    return DecodeGroup(rows=torch.tensor([r for r, _, _ in group], device=device),
                       block_table=torch.tensor(table, dtype=torch.long, device=device),
                       positions=torch.tensor([n - 1 for _, n, _ in group], device=device))


def read_blocks(cache: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache: [slots, W]; block_table: [..., blocks] -> cache rows [..., blocks * block_size, W].

    Copies whole blocks (contiguous runs of block_size * W values), not one slot at a time: the
    same rows as indexing by slot, at a third of the cost on CPU."""
    w = cache.shape[-1]
    whole = cache.shape[0] - cache.shape[0] % block_size  # (with CUDA graphs a padding slot follows the blocks)
    rows = cache[:whole].view(-1, block_size * w).index_select(0, block_table.reshape(-1))
    return rows.view(*block_table.shape[:-1], block_table.shape[-1] * block_size, w)


def _allowed(q_pos: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """q_pos: [..., Q] -> bool [..., Q, L]: causal, and inside the sliding window if any."""
    k_pos = torch.arange(num_keys, device=q_pos.device)
    ok = k_pos <= q_pos.unsqueeze(-1)
    if window is not None:
        ok &= k_pos > q_pos.unsqueeze(-1) - window
    return ok


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [S, Q, Hq, Dk], k: [S, L, Hk, Dk], v: [S, L, Hk, Dv], allowed: [S, Q, L] -> [S, Q, Hq, Dv].

    Query heads are folded onto their KV head ([S, Hk, G*Q, D], G = Hq / Hk; query head h reads
    KV head h // G) so K and V are never copied per query head.
    """
    S, Q, hq, dk = q.shape
    hk, L = k.shape[2], k.shape[1]
    g = hq // hk
    qg = q.reshape(S, Q, hk, g, dk).permute(0, 2, 3, 1, 4).reshape(S, hk, g * Q, dk)
    mask = allowed.unsqueeze(1).expand(S, g, Q, L).reshape(S, 1, g * Q, L)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return out.reshape(S, hk, g, Q, -1).permute(0, 3, 1, 2, 4).reshape(S, Q, hq, -1)


# (q [Sg, Hq, Dk], cache rows of their blocks [Sg, L, W], allowed [Sg, 1, L]) -> [Sg, Hq, v_dim]
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (q [Sd, Hq, Dk], the whole cache [slots, W], tables) -> [Sd, Hq, v_dim]: the paged kernel
PagedDecode = Callable[[torch.Tensor, torch.Tensor, DecodeTables], torch.Tensor]


def paged_prefill_context(head_dim: int) -> int:
    """Context (tokens) up to which a prefill chunk attends in the CPU paged kernel, a row per
    token, rather than in one SDPA call of its own. Measured on 2 AVX2 cores, 1024 prompt tokens
    in prompts of one length (benchmarks/bench_paged_attention.py, SDPA time / kernel time, three
    runs): head width 32: 1.24-1.31x at 128 tokens, 0.75-1.01x at 256; 64: 1.17-1.44x at 128,
    0.94-1.13x at 256; 128: 1.14-1.35x at 64, 0.93-1.09x at 128. The kernel's work grows with the
    square of the context (each token reads all before it), SDPA's tiles do not."""
    return 128 if head_dim <= 64 else 64


def _attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [Q, Hq, Dk], k: [Q, Hk, Dk], v: [Q, Hk, Dv] of positions 0 .. Q-1 -> [Q, Hq, Dv].

    A prompt's first chunk: SDPA's own causal mask and GQA (no mask tensor, no folded queries).
    Batched 4-D, as transformers calls it: on CPU only 4-D inputs reach SDPA's flash kernel
    (3-D ones take the math path, about 2x slower on prompt-sized chunks)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, batch: AttentionBatch, cache: torch.Tensor, expand: KVExpander,
                    scale: float, window: int | None, v_dim: int,
                    decode: DecodeAttention | None = None, paged: PagedDecode | None = None,
                    fresh: torch.Tensor | None = None, paged_prefill_context: int = 0) -> torch.Tensor:
    """q: [T, Hq, Dk]; cache: [slots, W] already holding this batch's new KV -> [T, Hq, v_dim].

    decode: attends the decoding groups straight from the cached rows instead of expanding them
    to K and V (MLA's absorbed form); prefill chunks always expand. paged: the kernel for
    `batch.decode_tables` (set where `use_paged_kernel` holds), reading the cache in place.
    fresh: [T, W] the rows just written to the cache, in batch order: a chunk that starts its
    sequence attends them directly (its whole context) instead of reading its blocks back.
    paged_prefill_context: on CPU, prefill chunks of at most this many tokens of context go to the
    paged kernel as well, a row per token (0: none)."""
    tables, prefills = batch.token_tables(paged_prefill_context if paged is not None else 0)
    if tables is not None:
        assert paged is not None, "a batch built for the paged kernel needs one"
        if not prefills:
            # every row is a kernel row (row i is entry i, no length groups beside the kernel):
            # no gather of q and no scatter into `out`, two copies of the batch per layer
            return paged(q.contiguous(), cache, tables)
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    bs = batch.block_size
    if tables is not None:
        out[tables.rows] = paged(q[tables.rows], cache, tables)
    for group in batch.decode_groups:
        rows = read_blocks(cache, group.block_table, bs)  # [Sg, L, W], L a whole number of blocks
        allowed = group.mask(window, rows.shape[1])
        if decode is not None:
            out[group.rows] = decode(q[group.rows], rows, allowed)
            continue
        k, v = expand(rows)  # [Sg, L, Hk, *]
        out[group.rows] = _attend(q[group.rows].unsqueeze(1), k, v, allowed, scale).squeeze(1)
    for chunk in prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        if fresh is not None and chunk.context == chunk.num_tokens:
            k, v = expand(fresh[rows])  # [Q, Hk, *]: the chunk is its sequence's whole context
            if window is None or window >= chunk.context:
                out[rows] = _attend_causal(q[rows], k, v, scale)
                continue
            k, v = k.unsqueeze(0), v.unsqueeze(0)
        else:
            k, v = expand(read_blocks(cache, chunk.block_table, bs)[:chunk.context].unsqueeze(0))
        out[rows] = _attend(q[rows].unsqueeze(0), k, v, chunk.mask(window), scale).squeeze(0)
    return out


def _qkv_for_rows(x: torch.Tensor, w: GQAWeights, rows: OutputRows, q_width: int) -> torch.Tensor:
    """linear(x, w.qkv) where only `rows` need their queries: the others get their keys and
    values alone (queries zero), the same floats where computed; every row's query where the
    projection is not cut (a plain weight, or tiles that cannot be cut there)."""
    kv_weight = weight_rows_from(w.qkv, q_width)
    if kv_weight is None:
        return linear(x, w.qkv, w.qkv_bias)
    kv = linear(x[rows.others], kv_weight, None if w.qkv_bias is None else w.qkv_bias[q_width:])
    qkv = x.new_zeros(x.shape[0], q_width + kv.shape[1])
    qkv[rows.index] = linear(x[rows.index], w.qkv, w.qkv_bias)
    qkv[rows.others, q_width:] = kv
    return qkv


def gqa_attention(x: torch.Tensor, w: GQAWeights, a: GQASpec, rotary: RotaryEmbedding, batch: AttentionBatch,
                  cache: torch.Tensor, eps: float, rows: OutputRows | None = None) -> torch.Tensor:
    """x: [T, H] (already normed) -> attention output [T, H], or [R, H] of the R `rows` alone (only
    their queries, attention and output projection are computed); writes every row's K/V into
    cache [slots, W]."""
    T = x.shape[0]
    hq, hk, d = a.num_heads, a.num_kv_heads, a.head_dim
    # [T, (Hq + 2 Hk) D]
    qkv = linear(x, w.qkv, w.qkv_bias) if rows is None else _qkv_for_rows(x, w, rows, hq * d)
    tables = batch.rope_tables(rotary)
    plain = a.qk_norm == "none" and a.clip_qkv is None
    fused = plain and use_fused_rope(qkv, cache)
    if fused:
        # rotate q and k and write K/V into the cache in one compiled pass
        q, new_kv = rope_kv_write_cpu(qkv, tables[0].squeeze(1), tables[1].squeeze(1), batch.slot_mapping, cache,
                                      hq, hk, d, rotary.interleaved)
    elif plain:
        # q and k are adjacent heads of the projection: rotate them in one call
        qk = rotary.apply(qkv[:, :(hq + hk) * d].view(T, hq + hk, d), batch.positions, tables)
        q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, (hq + hk) * d:]
    else:
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        if a.qk_norm == "full":
            q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        q, k = q.reshape(T, hq, d), k.reshape(T, hk, d)
        if a.qk_norm == "head":
            q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
        q, k = rotary.apply(q, batch.positions, tables), rotary.apply(k, batch.positions, tables)
    if not fused:
        new_kv = torch.cat([k.reshape(T, -1), v.reshape(T, -1)], dim=-1).to(cache.dtype)  # [T, W]
        cache.index_copy_(0, batch.slot_mapping, new_kv)

    def expand(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kk, vv = rows.split(hk * d, dim=-1)
        return kk.unflatten(-1, (hk, d)), vv.unflatten(-1, (hk, d))

    def paged(q_rows: torch.Tensor, kv: torch.Tensor, t: DecodeTables) -> torch.Tensor:
        return gqa_decode(q_rows, kv, t, hk, d ** -0.5, a.sliding_window)

    if rows is not None:  # the kept rows attend their context in the cache, written above
        q, batch, new_kv = q[rows.index], rows.batch, None
        if not q.shape[0]:  # none kept: the stage only wrote the KV
            return linear(q.reshape(0, hq * d), w.o, w.o_bias)
    out = paged_attention(q, batch, cache, expand, d ** -0.5, a.sliding_window, d, paged=paged, fresh=new_kv,
                          paged_prefill_context=paged_prefill_context(d))
    return linear(out.reshape(q.shape[0], hq * d), w.o, w.o_bias)
