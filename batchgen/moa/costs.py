"""Default ModelCost of a model directory, when no profiled one is given.

seconds per token = 2 x active parameters per token / `flops` (an assumed sustained rate, not a
measurement: pass measured costs, e.g. from `batchgen bench --calibrate` or an engine's peak
tokens/s, for a placement that knows the hardware); load time = a fixed engine start plus the
weight files read at `read_bytes_per_s`; memory = the weight files' size. Only ratios between
models matter to the makespan, except where load time is weighed against work.
"""
from __future__ import annotations

from pathlib import Path

from .placement import ModelCost

ASSUMED_FLOPS = 2e10  # a few CPU cores in fp32; a GPU is ~1000x this
ASSUMED_READ_BYTES_PER_S = 1e9
ENGINE_START_S = 0.5


def weight_bytes(model_dir: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def estimate_cost(model_dir: str | Path, *, flops: float = ASSUMED_FLOPS,
                  read_bytes_per_s: float = ASSUMED_READ_BYTES_PER_S) -> ModelCost:
    from ..sim.shapes import load_shape

    shape = load_shape(Path(model_dir), bytes_per_param=4)
    size = weight_bytes(model_dir)
    return ModelCost(seconds_per_token=2.0 * shape.active_params_per_token / flops,
                     load_s=ENGINE_START_S + size / read_bytes_per_s, memory_bytes=size)


def cost_from_speed(model_dir: str | Path, tokens_per_s: float, load_s: float) -> ModelCost:
    """A measured cost: an engine's sustained generated tokens/s and its load time."""
    return ModelCost(1.0 / tokens_per_s, load_s, weight_bytes(model_dir))
