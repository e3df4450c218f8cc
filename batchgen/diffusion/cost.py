"""Step-time cost model: seconds for one forward of `rows x tokens` at sequence-parallel degree d.

    t(T_batch, N, d) = fixed + per_token * T_batch / d + per_attn * T_batch * N / d + comm(d) * T_batch
    comm(d) = 0 for d = 1, else per_comm_token * (d - 1) / d + comm_fixed

T_batch: image tokens in the forward (rows x tokens per row), N: tokens per image (attention is
quadratic in N per row). max_batch_tokens (None: no limit) is the most image tokens one forward
runs efficiently (beyond it, time per token rises: caches); a larger batch is run as
ceil(T_batch / (max_batch_tokens x d)) forwards of equal share (policy.plan_step splits them so),
and step_time prices it so. Torch-free; `calibrate.py` fits it by timing real forwards on this machine
(`python -m batchgen.diffusion.calibrate`), the simulator and policy read it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CostModel:
    fixed: float = 2e-3
    per_token: float = 2e-6
    per_attn: float = 2e-9
    per_comm_token: float = 1e-6
    comm_fixed: float = 1e-3
    max_batch_tokens: int | None = None
    source: str = ""  # what it was fitted from (calibrate.py); "" for these defaults

    def step_time(self, batch_tokens: int, tokens: int, degree: int = 1) -> float:
        k = self.chunks(batch_tokens, degree)
        if k > 1:
            return k * self._one(batch_tokens / k, tokens, degree)
        return self._one(batch_tokens, tokens, degree)

    def chunks(self, batch_tokens: float, degree: int = 1) -> int:
        """How many forwards a batch of `batch_tokens` is run as (max_batch_tokens)."""
        cap = self.max_batch_tokens
        return max(1, -(-int(batch_tokens) // (cap * degree))) if cap else 1

    def _one(self, batch_tokens: float, tokens: int, degree: int) -> float:
        t = self.fixed + (self.per_token * batch_tokens + self.per_attn * batch_tokens * tokens) / degree
        if degree > 1:
            t += self.comm_fixed + self.per_comm_token * batch_tokens * (degree - 1) / degree
        return t

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls(**json.loads(Path(path).read_text(encoding="utf-8")))
