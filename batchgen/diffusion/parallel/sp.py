"""Ulysses sequence parallelism over a group-free Group: image tokens sharded across the members,
all-to-all over heads around self-attention (each member attends all tokens for H/k heads).
`ulysses_joint` is that attention, optionally joined with text tokens every member holds
(the MMDiT families: sp_mmdit.py).

Shapes: B batch, N tokens (member i holds n_i, torch.tensor_split order), H heads, D head dim.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .groups import Group, all_gather, all_to_all

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class UlyssesShard:
    def __init__(self, group: Group) -> None:
        self.group = group
        self.me = group.index()
        self.sizes: list[int] = []

    def scatter_tokens(self, hs: torch.Tensor) -> torch.Tensor:
        """[B, N, D] (every member holds it) -> this member's [B, n_me, D]."""
        parts = torch.tensor_split(hs, self.group.size, dim=1)
        self.sizes = [p.shape[1] for p in parts]
        return parts[self.me].contiguous()

    def gather_tokens(self, local: torch.Tensor) -> torch.Tensor:
        """[B, n_me, X] -> [B, N, X] on every member."""
        shapes = [(local.shape[0], n, *local.shape[2:]) for n in self.sizes]
        return torch.cat(all_gather(self.group, local.contiguous(), shapes), dim=1)

    def heads_to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[B, n_me, H, D] -> [B, N, H/k, D]: send member j its head chunk, get my chunk of everyone's tokens."""
        k = self.group.size
        b, _, h, d = x.shape
        if h % k:
            raise ValueError(f"Ulysses degree {k} does not divide the {h} attention heads")
        sends = list(x.chunk(k, dim=2))
        recvs = all_to_all(self.group, [s.contiguous() for s in sends], [(b, n, h // k, d) for n in self.sizes])
        return torch.cat(recvs, dim=1)

    def tokens_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, H/k, D] -> [B, n_me, H, D] (the inverse)."""
        b, _, hk, d = x.shape
        sends = list(torch.split(x, self.sizes, dim=1))
        recvs = all_to_all(self.group, [s.contiguous() for s in sends],
                           [(b, self.sizes[self.me], hk, d)] * self.group.size)
        return torch.cat(recvs, dim=2)

    def attention(self, model: Any) -> contextlib.AbstractContextManager[None]:
        """Self-attention (attn1) of every block runs the Ulysses processor inside the block."""
        return self_attention_processors(model.transformer_blocks, _UlyssesProcessor(self))


def ulysses_joint(shard: UlyssesShard, image: QKV, text: QKV | None, text_first: bool,
                  rotate: Callable[[torch.Tensor], torch.Tensor] | None = None, text_out: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """image q/k/v [B, n_me, H, hd] (this member's tokens, all heads), text q/k/v [B, L, H, hd]
    (every member's, all heads) or None -> attention output for this member's image tokens
    [B, n_me, H hd] and for the text tokens [B, L, H hd] (all heads, on every member; None
    without text, or with text_out False: a last block that drops it skips the gather)."""
    q, k, v = (shard.heads_to_tokens(z) for z in image)                  # [B, N, H/k, hd]
    n = q.shape[1]
    length = 0
    if text is not None:
        per = q.shape[2]
        mine = slice(shard.me * per, (shard.me + 1) * per)
        length = text[0].shape[1]
        q, k, v = (torch.cat([t[:, :, mine], z] if text_first else [z, t[:, :, mine]], dim=1)
                   for t, z in zip(text, (q, k, v)))
    if rotate is not None:  # (Flux: the whole sequence's rotary table)
        q, k = rotate(q), rotate(k)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         dropout_p=0.0, is_causal=False).transpose(1, 2).to(q.dtype)  # [B, S, H/k, hd]
    image_out = out[:, length:] if text_first else out[:, :n]
    image_out = shard.tokens_to_heads(image_out.contiguous()).flatten(2, 3)
    if text is None or not text_out:
        return image_out, None
    mine_out = out[:, :length] if text_first else out[:, n:]
    shapes = [tuple(mine_out.shape)] * shard.group.size
    return image_out, torch.cat(all_gather(shard.group, mine_out.contiguous(), shapes), dim=2).flatten(2, 3)


@contextlib.contextmanager
def self_attention_processors(blocks: Iterable[Any], processor: Any) -> Iterator[None]:
    """Every block's self-attention (attn1) runs `processor` inside the `with`, and its own
    processor again after it (cross-attention and the feed-forward work per token: unchanged)."""
    blocks = list(blocks)
    saved = [block.attn1.processor for block in blocks]
    for block in blocks:
        block.attn1.set_processor(processor)
    try:
        yield
    finally:
        for block, proc in zip(blocks, saved):
            block.attn1.set_processor(proc)


class _UlyssesProcessor:
    """diffusers' AttnProcessor2_0 for self-attention on a token shard."""

    def __init__(self, shard: UlyssesShard) -> None:
        self.shard = shard

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None,
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None or attn.spatial_norm is not None \
                or attn.group_norm is not None or hidden_states.ndim != 3:
            raise NotImplementedError("Ulysses processor: plain self-attention on [B, N, D] only")
        residual = hidden_states
        b, n, _ = hidden_states.shape
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        d = k.shape[-1] // attn.heads
        q, k, v = (t.view(b, n, attn.heads, d) for t in (q, k, v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        out, _ = ulysses_joint(self.shard, (q, k, v), None, text_first=False)
        out = attn.to_out[1](attn.to_out[0](out))
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor
