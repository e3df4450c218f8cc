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


def profile_cost(model_dir: str | Path, *, rows: int = 128, max_tokens: int = 16, prompt_tokens: int = 8,
                 repeat: int = 3, engine_options: dict | None = None) -> ModelCost:
    """Measure a model here, at the batch the job reaches (`rows` at once; run it on the
    hardware the workers have), as MOSAIC profiles offline:

    - seconds_per_token and seconds_per_row from batches of n = max(max_tokens, 16) generated
      tokens and of 1 (greedy, ignore_eos; interleaved, best of `repeat` each, so a load
      spike from elsewhere does not land in one of them only): time = rows x (per row +
      tokens x per token), so a model of short answers is charged its prefill and per-row
      costs too;
    - load_s: the engine's start plus what its first batch took beyond a steady one (the
      first forwards' one-off costs: allocations, kernel selection, graph capture), the
      smaller of two starts (the first also pays imports a warmed-up worker has paid).
    """
    import time

    from ..engine import Engine
    from ..sampling_params import SamplingParams

    def batch(engine: Engine, tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        prompts = [[1 + (i * 7 + j) % 50 for j in range(prompt_tokens)] for i in range(rows)]
        start = time.perf_counter()
        engine.generate(prompts, params)
        return time.perf_counter() - start

    n = max(16, max_tokens)
    starts: list[tuple[float, float]] = []  # (engine start, its first batch of n)
    for _ in range(2):
        begin = time.perf_counter()
        engine = Engine(model_dir, **(engine_options or {}))
        built = time.perf_counter() - begin
        try:
            starts.append((built, batch(engine, n)))
            if len(starts) == 2:
                long = short = float("inf")
                for _ in range(max(1, repeat)):
                    long, short = min(long, batch(engine, n)), min(short, batch(engine, 1))
        finally:
            engine.close()
    per_token = (long - short) / (rows * (n - 1))
    per_row = short / rows - per_token
    if per_token <= 0 or per_row < 0:  # noise swamped the difference: charge it all per token
        per_token, per_row = long / (rows * n), 0.0
    load_s = min(built + max(0.0, first - long) for built, first in starts)
    return ModelCost(per_token, load_s, weight_bytes(model_dir), per_row)
