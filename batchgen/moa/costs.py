"""Default ModelCost of a model directory, when no profiled one is given.

seconds per token = 2 x active parameters per token / `flops` (an assumed sustained rate, not a
measurement: pass measured costs, e.g. from `batchgen bench --calibrate` or an engine's peak
tokens/s, for a placement that knows the hardware); load time = a fixed engine start plus the
weight files read at `read_bytes_per_s`; memory = the weight files' size. Only ratios between
models matter to the makespan, except where load time is weighed against work.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..policy.placement import ModelCost
from ..runtime.kv_cache import blocks_for

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


def profile_cost(model_dir: str | Path, *, rows: int | None = None, max_tokens: int = 16, prompt_tokens: int = 8,
                 repeat: int = 3, engine_options: dict | None = None) -> ModelCost:
    """Measure a model here, at the batch the job reaches (`rows` at once; run it on the
    hardware the workers have), as MOSAIC profiles offline. rows=None: the batch this engine
    reaches on rows of `prompt_tokens` + `max_tokens`: its max_num_seqs, or fewer when its KV
    cache holds fewer such rows at once (a replica's rows beyond that wait for a seat, so a
    larger batch is never run; a smaller profile batch pays more forwards per token than the
    job will). A batch of r rows of k generated
    tokens is taken to cost r x per row + k x (per forward + r x per token): batches of
    n = max(max_tokens, 16) and of 1 tokens, at r = rows and at rows / 4 (greedy, ignore_eos;
    interleaved, best of `repeat` each, so a load spike from elsewhere does not land in one
    of them only) give the three, so a model of short answers is charged its prefill and
    per-row costs, and a replica with a small batch its forwards (`max_batch` = rows).
    load_s: the engine's start plus what its first batch took beyond a steady one (the first
    forwards' one-off costs: allocations, kernel selection, graph capture), the smaller of
    two starts (the first also pays imports a warmed-up worker has paid).
    """
    import time

    from ..engine import Engine
    from ..sampling_params import SamplingParams

    def batch(engine: Engine, r: int, tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        prompts = [[1 + (i * 7 + j) % 50 for j in range(prompt_tokens)] for i in range(r)]
        start = time.perf_counter()
        engine.generate(prompts, params)
        return time.perf_counter() - start

    n = max(16, max_tokens)
    starts: list[tuple[float, float]] = []  # (engine start, its first batch)
    best: dict[tuple[int, int], float] = {}
    for _ in range(2):
        begin = time.perf_counter()
        engine = Engine(model_dir, **(engine_options or {}))
        built = time.perf_counter() - begin
        if not starts:  # the first engine: the batch to profile at
            rows = max(4, reachable_batch(engine, prompt_tokens + n) if rows is None else rows)
            quarter = rows // 4
        try:
            starts.append((built, batch(engine, rows, n)))
            if len(starts) == 2:
                for _ in range(max(1, repeat)):
                    for key in ((rows, n), (rows, 1), (quarter, n), (quarter, 1)):
                        best[key] = min(best.get(key, float("inf")), batch(engine, *key))
        finally:
            engine.close()
    full = (best[rows, n] - best[rows, 1]) / (n - 1)  # per forward + rows x per token
    small = (best[quarter, n] - best[quarter, 1]) / (n - 1)
    per_token = (full - small) / (rows - quarter)
    per_step = full - rows * per_token
    if per_token <= 0 or per_step < 0:  # noise swamped the difference: no fixed cost per forward
        per_token, per_step = max(full, 1e-12) / rows, 0.0
    per_row = max(0.0, (best[rows, 1] - per_step) / rows - per_token)
    load_s = min(built + max(0.0, first - best[rows, n]) for built, first in starts)
    return ModelCost(per_token, load_s, weight_bytes(model_dir), per_row, per_step, rows)


def reachable_batch(engine: Any, row_tokens: int) -> int:
    """Rows `engine` runs at once when each holds `row_tokens` of KV at its end: its
    max_num_seqs, or as many such rows as its KV blocks hold."""
    seats = int(engine.config.max_num_seqs)
    per_row = blocks_for(max(1, row_tokens), int(engine.allocator.block_size))
    return max(1, min(seats, int(engine.allocator.num_blocks) // per_row))
