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


def profile_cost(model_dir: str | Path, *, rows: int = 32, max_tokens: int = 16,
                 engine_options: dict | None = None) -> ModelCost:
    """Measure a model here: the engine's load time and its generated tokens/s on `rows` rows
    of `max_tokens` (ignore_eos, greedy) at once. Offline profiling, as MOSAIC does; run it on
    the hardware the workers have, at the batch size the job will reach."""
    import time

    from ..engine import Engine
    from ..sampling_params import SamplingParams

    start = time.perf_counter()
    engine = Engine(model_dir, **(engine_options or {}))
    load_s = time.perf_counter() - start
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.generate([[1, 2, 3]], params)  # warm-up
        start = time.perf_counter()
        outs = engine.generate([[1, 2, 3, 4 + i % 7] for i in range(rows)], params)
        elapsed = time.perf_counter() - start
    finally:
        engine.close()
    tokens = sum(o.num_generated_tokens for o in outs)
    return ModelCost(elapsed / max(1, tokens), load_s, weight_bytes(model_dir))
