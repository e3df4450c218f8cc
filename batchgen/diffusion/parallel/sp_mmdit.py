"""Ulysses sequence parallelism for the MMDiT families (SD3/SD3.5, Flux): attention processors
for a forward whose image tokens are sharded across the group's members and whose text tokens
(the same L on every member) are not.

Around joint attention the image tokens' q/k/v go through the all-to-all over heads (each member
then holds every image token for H/k heads), the text tokens' q/k/v are cut to the same heads,
and the two are joined as diffusers joins them (SD3: image then text; Flux: text then image,
rotated by the full sequence's rotary table). Afterwards the image output goes back to the
token shard and the text output is gathered to all heads, so every member carries the text
stream whole (its per-token work is repeated on each member; it is L tokens).

Shapes: B rows, N image tokens (member i holds n_i), L text tokens, H heads of hd.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .sp import UlyssesShard, ulysses_joint


def apply_flux_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' apply_rotary_emb as Flux calls it (real pairs, sequence_dim 1): x [B, S, H, hd],
    cos / sin [S, hd]."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class UlyssesJointProcessor:
    """SD3's JointAttnProcessor2_0 on a token shard (its image-only second attention too)."""

    def __init__(self, shard: UlyssesShard) -> None:
        self.shard = shard

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        if attention_mask is not None:
            raise NotImplementedError("Ulysses joint processor: no attention mask")
        b, n, _ = hidden_states.shape
        q, k, v = (z.view(b, n, attn.heads, -1) for z in (attn.to_q(hidden_states), attn.to_k(hidden_states),
                                                          attn.to_v(hidden_states)))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if encoder_hidden_states is None:
            image, _ = ulysses_joint(self.shard, (q, k, v), None, text_first=False)
            return attn.to_out[1](attn.to_out[0](image))
        c = encoder_hidden_states
        cq, ck, cv = (z.view(b, c.shape[1], attn.heads, -1) for z in (attn.add_q_proj(c), attn.add_k_proj(c),
                                                                      attn.add_v_proj(c)))
        if attn.norm_added_q is not None:
            cq = attn.norm_added_q(cq)
        if attn.norm_added_k is not None:
            ck = attn.norm_added_k(ck)
        image, text = ulysses_joint(self.shard, (q, k, v), (cq, ck, cv), text_first=False,
                                    text_out=not attn.context_pre_only)
        return attn.to_out[1](attn.to_out[0](image)), (None if text is None else attn.to_add_out(text))


class UlyssesFluxProcessor:
    """FluxAttnProcessor on a token shard. text_length: in a single-stream block the hidden
    states are each row's L text tokens then this member's image tokens (None in a double-stream
    block, whose text comes as encoder_hidden_states)."""

    def __init__(self, shard: UlyssesShard, text_length: int | None = None) -> None:
        self.shard, self.text_length = shard, text_length

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        if attention_mask is not None:
            raise NotImplementedError("Ulysses Flux processor: no attention mask")
        q, k, v = (z.unflatten(-1, (-1, attn.head_dim)) for z in (attn.to_q(hidden_states), attn.to_k(hidden_states),
                                                                  attn.to_v(hidden_states)))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if encoder_hidden_states is not None:
            c = encoder_hidden_states
            cq, ck, cv = (z.unflatten(-1, (-1, attn.head_dim)) for z in (attn.add_q_proj(c), attn.add_k_proj(c),
                                                                         attn.add_v_proj(c)))
            text, image = (attn.norm_added_q(cq), attn.norm_added_k(ck), cv), (q, k, v)
        else:
            length = self.text_length or 0
            text, image = tuple(z[:, :length] for z in (q, k, v)), tuple(z[:, length:] for z in (q, k, v))
        rotary = image_rotary_emb
        rotate = None if rotary is None else (lambda z: apply_flux_rotary(z, *rotary))
        image_out, text_out = ulysses_joint(self.shard, image, text, text_first=True, rotate=rotate)
        if encoder_hidden_states is None:
            return torch.cat([text_out, image_out], dim=1)              # [B, L + n_me, H hd]
        return attn.to_out[1](attn.to_out[0](image_out)), attn.to_add_out(text_out)


@contextlib.contextmanager
def processors(pairs: list[tuple[Any, Any]]) -> Iterator[None]:
    """(attention module, processor): each runs its processor inside the `with`, its own after."""
    saved = [(a, a.processor) for a, _ in pairs]
    for a, p in pairs:
        a.set_processor(p)
    try:
        yield
    finally:
        for a, p in saved:
            a.set_processor(p)


def sd3_attention(shard: UlyssesShard, model: Any) -> contextlib.AbstractContextManager[None]:
    """Every SD3 block's attention (and SD3.5's second attention) on the token shard."""
    joint = UlyssesJointProcessor(shard)
    return processors([(a, joint) for b in model.transformer_blocks for a in (b.attn, b.attn2) if a is not None])


def flux_attention(shard: UlyssesShard, model: Any, text_length: int) -> contextlib.AbstractContextManager[None]:
    """Every Flux block's attention on the token shard (single-stream ones told the text length)."""
    single = UlyssesFluxProcessor(shard, text_length)
    double = UlyssesFluxProcessor(shard)
    return processors([(b.attn, double) for b in model.transformer_blocks]
                      + [(b.attn, single) for b in model.single_transformer_blocks])
