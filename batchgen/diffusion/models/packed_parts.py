"""Where each part (one latent shape) lies in a token-packed forward, and the per-part attention
over it: shared by the packed forwards of every family (packed.py, packed_wan.py, packed_sd3.py).

Shapes: parts i = 1..P, part i has B_i samples of N_i tokens; R = sum B_i samples; T = sum B_i N_i
tokens; H heads of size hd.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """Where each part lies in the packed matrices: tokens [start, start + B N), samples
    [row, row + B)."""

    parts: tuple[tuple[int, int, int, int], ...]  # (token start, sample row, B, N) per part
    owner: torch.Tensor                            # [T] sample row of each token

    @classmethod
    def of(cls, sizes: Sequence[tuple[int, int]], device: Any) -> PackedLayout:
        """sizes: (B_i, N_i) of each part."""
        parts, start, row = [], 0, 0
        for b, n in sizes:
            parts.append((start, row, b, n))
            start += b * n
            row += b
        # built on the host, then copied: no device sync for repeat_interleave's output size
        counts = torch.tensor([n for b, n in sizes for _ in range(b)])
        return cls(tuple(parts), torch.repeat_interleave(torch.arange(row), counts).to(device, non_blocking=True))

    def per_token(self, v: torch.Tensor) -> torch.Tensor:
        """[R, ..., D] per-sample values -> [T, D] (each token its sample's)."""
        return v.reshape(v.shape[0], v.shape[-1]).index_select(0, self.owner)


def join(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenated along dim 0; one part's tensor as it is (no copy)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def unpatchify(hs: torch.Tensor, layout: PackedLayout, sizes: Sequence[Sequence[int]], p: int, c_out: int
               ) -> list[torch.Tensor]:
    """[T, p p C_out] packed output, sizes: each part's latent (h_i, w_i) -> [B_i, C_out, h_i, w_i]
    per part (diffusers' unpatchify of a p x p patch transformer)."""
    outs = []
    for (start, _, b, n), (h, w) in zip(layout.parts, sizes):
        o = hs[start:start + b * n].reshape(b, h // p, w // p, p, p, c_out)
        outs.append(torch.einsum("nhwpqc->nchpwq", o).reshape(b, c_out, h, w))
    return outs


def split_heads(z: torch.Tensor, b: int, heads: int) -> torch.Tensor:
    """[b * n, H * hd] (or [b, n, H * hd]) -> [b, H, n, hd]"""
    return z.view(b, -1, heads, z.shape[-1] // heads).transpose(1, 2)


def merge_heads(parts: list[torch.Tensor]) -> torch.Tensor:
    """[b_i, H, n_i, hd] per part -> [T, H * hd]"""
    return join([o.transpose(1, 2).reshape(-1, o.shape[1] * o.shape[3]) for o in parts])


def self_attention(a: Any, x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """A diffusers Attention's self-attention (AttnProcessor2_0 / JointAttnProcessor2_0 without
    context) over each part's tokens of x [T, D] -> [T, D]; q/k norms where it has them."""
    q, k, v = a.to_q(x), a.to_k(x), a.to_v(x)                            # [T, H * hd]
    outs = []
    for start, _, b, n in layout.parts:
        span = slice(start, start + b * n)
        qs, ks = split_heads(q[span], b, a.heads), split_heads(k[span], b, a.heads)
        if a.norm_q is not None:
            qs = a.norm_q(qs)
        if a.norm_k is not None:
            ks = a.norm_k(ks)
        outs.append(F.scaled_dot_product_attention(qs, ks, split_heads(v[span], b, a.heads), dropout_p=0.0,
                                                   is_causal=False))
    return a.to_out[1](a.to_out[0](merge_heads(outs).to(q.dtype)))
