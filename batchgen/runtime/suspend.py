"""Coroutine state <-> bytes, for suspend / resume / migrate between engines and workers.

The state is the sequence's tokens, sampling params, seed and bookkeeping: a few KB. Its KV may
travel too (a host tensor [layers, tokens, W]) or be recomputed from the tokens on arrival.
"""
from __future__ import annotations

import pickle
from dataclasses import fields
from typing import Any

import torch

from ..errors import StateError
from ..models.model import Model
from .policy import prefer_transfer
from .sequence import SeqId, SeqStatus, Sequence

_VERSION = 1
# Fields that belong to the engine holding the sequence, not to the coroutine (block hashes
# depend on the engine's block size: the new engine recomputes them to find its own cache).
_LOCAL = {"seq_id", "block_ids", "num_computed", "num_swapped", "status", "block_hashes", "num_registered_blocks"}


class CoroutineCodec:
    def __init__(self, model: Model, link_bytes_per_s: int) -> None:
        self.model = model
        self.link_bytes_per_s = link_bytes_per_s
        spec = model.spec
        self.fingerprint = (spec.family, spec.num_layers, spec.hidden_size, spec.vocab_size, spec.kv_width,
                            str(model.dtype))

    def prefer_kv(self, num_tokens: int, recompute_tokens_per_s: float) -> bool:
        """Send the KV when moving its bytes is faster than recomputing its tokens."""
        return prefer_transfer(num_tokens, num_tokens * self.model.kv_bytes_per_token(), self.link_bytes_per_s,
                               recompute_tokens_per_s)

    def encode(self, seq: Sequence, kv: torch.Tensor | None) -> bytes:
        state: dict[str, Any] = {f.name: getattr(seq, f.name) for f in fields(Sequence) if f.name not in _LOCAL}
        state["status"] = SeqStatus.FINISHED.value if seq.is_finished else SeqStatus.WAITING.value
        return pickle.dumps({"version": _VERSION, "fingerprint": self.fingerprint, "seq": state, "kv": kv},
                            protocol=pickle.HIGHEST_PROTOCOL)

    def decode(self, data: bytes, seq_id: SeqId) -> tuple[Sequence, torch.Tensor | None]:
        try:
            payload = pickle.loads(data)
            version, fingerprint, state, kv = (payload["version"], payload["fingerprint"], payload["seq"],
                                               payload["kv"])
        except Exception as exc:  # corrupt bytes can raise nearly anything from pickle
            raise StateError(f"not a batchgen coroutine state: {exc}") from exc
        if version != _VERSION:
            raise StateError(f"coroutine state version {version} is not {_VERSION}")
        if tuple(fingerprint) != self.fingerprint:
            raise StateError(f"coroutine state was made for model {fingerprint}, this engine runs {self.fingerprint}")
        try:
            status = SeqStatus(state.pop("status"))
            seq = Sequence(seq_id=seq_id, **state)
        except (TypeError, ValueError, KeyError) as exc:
            raise StateError(f"coroutine state fields do not match this batchgen: {exc}") from exc
        seq.status = status
        seq.history.append(("resumed", "migrate"))
        if kv is not None and (kv.dim() != 3 or kv.shape[0] != self.model.num_layers
                               or kv.shape[1] >= seq.num_tokens or kv.shape[2] != self.model.spec.kv_width):
            raise StateError(f"coroutine KV has shape {tuple(kv.shape)}, expected [layers, < tokens, W]")
        return seq, kv
