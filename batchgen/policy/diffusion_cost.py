"""Step-time cost model: seconds for one forward of `rows x tokens` at sequence-parallel degree d.

    t(T_batch, N, d) = fixed + per_token * T_batch / d + per_attn * T_batch * N / d + comm(d) * T_batch
    comm(d) = 0 for d = 1, else per_comm_token * (d - 1) / d + comm_fixed

T_batch: image tokens in the forward (rows x tokens per row), N: tokens per image (attention is
quadratic in N per row). max_batch_tokens (None: no limit) is the most image tokens one forward
runs efficiently (beyond it, time per token rises: caches); a larger batch is run as
ceil(T_batch / (max_batch_tokens x d)) forwards of equal share (policy.plan_step splits them so),
and step_time prices it so: chunks x (fixed + comm_fixed) + marginal, the marginal part linear in
T_batch.

packed: a worker's degree-1 forwards of one step, of any latent shapes, run as one forward
(packed.py), so they pay one fixed cost between them (pack_time); False where the pipeline's
blocks cannot be packed (one forward, one fixed cost, per shape).

Torch-free; `calibrate.py` fits it by timing real forwards on this machine (`python -m
batchgen.diffusion.distributed.calibrate`), the simulator and policy read it.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CostModel:
    fixed: float = 2e-3
    per_token: float = 2e-6
    per_attn: float = 2e-9
    per_comm_token: float = 1e-6
    comm_fixed: float = 1e-3
    max_batch_tokens: int | None = None
    packed: bool = True
    source: str = ""  # what it was fitted from (calibrate.py); "" for these defaults

    def step_time(self, batch_tokens: int, tokens: int, degree: int = 1) -> float:
        return self.chunks(batch_tokens, degree) * self.fixed_time(degree) + self.marginal(batch_tokens, tokens, degree)

    def fixed_time(self, degree: int = 1) -> float:
        """What one forward costs whatever its size."""
        return self.fixed + (self.comm_fixed if degree > 1 else 0.0)

    def marginal(self, batch_tokens: float, tokens: int, degree: int = 1) -> float:
        """What `batch_tokens` image tokens of `tokens` per image add to a forward."""
        t = (self.per_token * batch_tokens + self.per_attn * batch_tokens * tokens) / degree
        if degree > 1:
            t += self.per_comm_token * batch_tokens * (degree - 1) / degree
        return t

    def packing(self, possible: bool) -> CostModel:
        """This model for a pipeline whose forwards can (or cannot) be packed (Pipeline.packs)."""
        return replace(self, packed=False) if self.packed and not possible else self

    def pack_time(self, parts: Sequence[tuple[int, int]]) -> float:
        """Seconds for one worker's degree-1 forwards of a step; parts: (batch tokens, tokens per
        image) of each latent shape. Packed: one forward (chunked by max_batch_tokens) for all."""
        if not self.packed:
            return sum(self.step_time(bt, n) for bt, n in parts)
        total = sum(bt for bt, _ in parts)
        if not total:
            return 0.0
        return self.chunks(total) * self.fixed + sum(self.marginal(bt, n) for bt, n in parts)

    def chunks(self, batch_tokens: float, degree: int = 1) -> int:
        """How many forwards a batch of `batch_tokens` is run as (max_batch_tokens)."""
        cap = self.max_batch_tokens
        return max(1, -(-int(batch_tokens) // (cap * degree))) if cap else 1

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls(**json.loads(Path(path).read_text(encoding="utf-8")))
