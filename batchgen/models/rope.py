"""Rotary position embeddings: inverse frequencies per scaling type, and their application."""
from __future__ import annotations

import math

import torch

from .spec import RopeSpec


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(rope: RopeSpec) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [dim/2] fp32, attention_factor that multiplies cos and sin)."""
    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / pos_freqs
    if rope.kind in ("default", "dynamic"):
        # dynamic NTK only changes frequencies past max_position_embeddings, which we never reach.
        return inv_freq, 1.0
    if rope.kind == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.kind == "llama3":
        old_len = rope.original_max_position_embeddings or 8192
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_get_mscale(factor, rope.mscale) / _yarn_get_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_get_mscale(factor)
    orig = rope.original_max_position_embeddings or 4096

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """cos/sin lookup by absolute position; `apply` rotates the first `dim` channels of each head."""

    def __init__(self, rope: RopeSpec, max_positions: int, device: torch.device) -> None:
        inv_freq, attention_factor = inverse_frequencies(rope)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, dim/2]
        self.cos = (freqs.cos() * attention_factor).to(device)
        self.sin = (freqs.sin() * attention_factor).to(device)
        self.dim = rope.dim
        self.interleaved = rope.interleaved

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> (cos, sin), each [T, 1, dim/2] fp32; the same for every layer of a
        forward, so a batch looks them up once (AttentionBatch.rope_tables)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, positions: torch.Tensor,
              tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [T, H, D] with D >= dim; positions: [T] -> rotated copy (computed in fp32).

        tables: `tables(positions)`, when the caller has them already."""
        cos, sin = tables if tables is not None else self.tables(positions)
        rot, rest = x[..., : self.dim].float(), x[..., self.dim:]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        else:
            half = self.dim // 2
            x1, x2 = rot[..., :half], rot[..., half:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        out = out.to(x.dtype)
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)
