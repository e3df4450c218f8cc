"""`batchgen bench --calibrate`: time the real engine's forwards and fit FittedCost to them.

Each grid point puts B requests of a P-token prompt in an engine and times every `step()`:
the first ones prefill, the rest decode at a growing context. What each forward fed is read
from the scheduler's state around the step (tokens per sequence before and after), so the
regressors are exactly the FittedCost terms of what ran. The fit minimizes relative error
(rows weighted by 1/time) with non-negative coefficients.
"""
from __future__ import annotations

import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from ..errors import PlanError
from .cost import fit_features
from .profiles import FIT_TERMS, FittedProfile
from .shapes import shape_from_spec

GRID = ((1, 4, 16, 48, 128), (16, 128, 512))  # batch sizes, prompt lengths
QUICK_GRID = ((1, 8, 32), (16, 128))
DECODE_STEPS = 24


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: drop the most negative term and refit until none is."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        coef[active] = sol
        if (sol >= 0).all() or not active:
            return coef
        active.pop(int(np.argmin(sol)))


def _expert_bytes(engine: object) -> tuple[int, int]:
    """(bytes copied from host memory, bytes read from disk) by the expert store so far."""
    store = getattr(engine.model, "experts", None)  # type: ignore[attr-defined]
    return (int(store.stats.bytes_from_host), int(store.stats.bytes_from_disk)) if store is not None else (0, 0)


def measure(engine: object, batch: int, prompt: int, steps: int, seed: int) -> list[tuple[float, ...]]:
    """[(tokens, seqs, kv_tokens, attn_pairs, host_bytes, disk_bytes, seconds)] of the forwards
    of one grid point (host/disk bytes: the experts the forward moved; 0 when all are resident)."""
    from ..sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = int(engine.vocab_size)  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(rng.integers(5, vocab, prompt).tolist(), params)  # type: ignore[attr-defined]
    sched = engine.scheduler  # type: ignore[attr-defined]
    rows: list[tuple[float, ...]] = []
    while sched.has_work:
        before = {int(s.seq_id): (s.num_computed, s.num_tokens) for s in list(sched.waiting) + sched.running}
        host0, disk0 = _expert_bytes(engine)
        t0 = time.perf_counter()
        engine.step()  # type: ignore[attr-defined]
        seconds = time.perf_counter() - t0
        host1, disk1 = _expert_bytes(engine)
        after = {int(s.seq_id): s.num_computed for s in sched.running}
        tokens = seqs = kv = 0
        pairs = 0.0
        for seq_id, (c, n) in before.items():
            fed = (after[seq_id] - c) if seq_id in after else (n - c if seq_id not in {int(s.seq_id) for s in sched.waiting} else 0)
            if fed > 0:
                tokens, seqs, kv, pairs = tokens + fed, seqs + 1, kv + c + fed, pairs + fed * (c + (fed + 1) / 2)
        if tokens:
            rows.append((tokens, seqs, kv, pairs, host1 - host0, disk1 - disk0, seconds))
    for seq_id in list(engine._seqs):  # type: ignore[attr-defined]
        engine.pop_output(seq_id)  # type: ignore[attr-defined]
    return rows


def fit(rows: list[tuple[float, ...]], num_experts: int, top_k: int, num_moe_layers: int
        ) -> tuple[dict[str, float], dict[str, float]]:
    data = np.array(rows, dtype=np.float64)
    x = fit_features(data[:, 0], data[:, 1], data[:, 2], data[:, 3], num_experts, top_k, num_moe_layers,
                     data[:, 4], data[:, 5])
    y = data[:, 6]
    w = 1.0 / np.maximum(y, 1e-6)
    coef = _nnls(x * w[:, None], y * w)
    rel = np.abs(x @ coef - y) / y
    return dict(zip(FIT_TERMS, map(float, coef))), {"points": int(len(y)), "median_rel_error": float(np.median(rel)),
                                                    "p90_rel_error": float(np.percentile(rel, 90))}


def calibrate(model_dir: Path, *, dtype: str = "float32", device: str | None = None,
              kv_cache_bytes: int = 256 << 20, quick: bool = False, seed: int = 0, threads: int | None = None,
              **engine_options: object) -> FittedProfile:
    """Measure `model_dir` on this machine and fit a profile for `batchgen plan --profile FILE`.
    threads: torch intra-op threads while measuring (a Dask worker process gets its share)."""
    import torch

    from ..engine import Engine

    if threads is not None:
        if threads < 1:
            raise PlanError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)

    if not (Path(model_dir) / "config.json").is_file():
        raise PlanError(f"--calibrate {model_dir}: not a model directory (no config.json)")
    try:
        engine = Engine(model_dir, dtype=dtype, device=device, kv_cache_bytes=kv_cache_bytes, **engine_options)
    except (ValueError, AssertionError, RuntimeError) as exc:  # EngineConfig's checks; torch without the device
        raise PlanError(f"--calibrate {model_dir}: cannot build the engine: {exc}") from exc
    shape = shape_from_spec(engine.model.spec, Path(model_dir).name)
    batches, prompts = QUICK_GRID if quick else GRID
    steps = DECODE_STEPS if not quick else 8
    if engine.allocator.capacity_tokens < max(prompts) + steps:
        raise PlanError(f"--kv-cache-bytes {kv_cache_bytes}: the KV pool holds {engine.allocator.capacity_tokens} "
                        f"tokens, the calibration grid needs {max(prompts) + steps} for one sequence")
    measure(engine, 2, 8, 2, seed)  # warm-up: first calls allocate and compile
    rows: list[tuple[float, ...]] = []
    for i, b in enumerate(batches):
        for j, p in enumerate(prompts):
            rows += measure(engine, b, p, steps, seed + 10 * i + j)
    coefficients, quality = fit(rows, shape.num_experts, shape.top_k, shape.num_moe_layers)
    traffic = expert_traffic(engine, rows, engine_options)
    cfg = engine.config
    quality.update(grid={"batches": list(batches), "prompts": list(prompts)},
                   engine={"max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                           "dtype": dtype, "device": str(engine.model.device), "threads": torch.get_num_threads()})
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return FittedProfile(
        name=f"calibrated:{Path(model_dir).name}", model=Path(model_dir).name, coefficients=coefficients,
        kv_capacity_tokens=int(engine.allocator.capacity_tokens), kv_bytes_per_token=int(engine.model.kv_bytes_per_token()),
        num_experts=shape.num_experts, top_k=shape.top_k, num_moe_layers=shape.num_moe_layers,
        network_bytes_per_s=float(cfg.kv_link_bytes_per_s), host_bytes_per_s=float(cfg.host_link_bytes_per_s),
        source=f"measured by batchgen bench --calibrate on {platform.node()} ({platform.processor() or platform.machine()}, "
               f"{engine.model.device}, {dtype}) at {when}", fit=quality, expert_traffic=traffic)


def expert_traffic(engine: object, rows: list[tuple[float, ...]], engine_options: dict[str, object]) -> dict[str, object]:
    """An offloaded engine's measured expert traffic for FittedCost: the mean host / disk bytes
    per forward at each tokens-per-forward size seen, and the engine's own per-token figures.
    {} when every expert was resident (nothing moved)."""
    if getattr(engine.model, "experts", None) is None:  # type: ignore[attr-defined]
        return {}
    stats = engine.stats_summary()  # type: ignore[attr-defined]
    by_tokens: dict[int, list[tuple[float, float]]] = {}
    for r in rows:
        by_tokens.setdefault(int(r[0]), []).append((r[4], r[5]))
    per_forward = [[t, float(np.mean([h for h, _ in v])), float(np.mean([d for _, d in v]))]
                   for t, v in sorted(by_tokens.items())]
    return {"expert_memory_bytes": engine_options.get("expert_memory_bytes"),
            "expert_host_memory_bytes": engine_options.get("expert_host_memory_bytes"),
            "expert_bytes_from_disk": float(stats["expert_bytes_from_disk"]),
            "expert_bytes_from_host": float(stats["expert_bytes_from_host"]),
            "generated_tokens": int(stats.get("generated_tokens", 0)),
            "per_forward": per_forward}
