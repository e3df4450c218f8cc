"""Fit the step-time CostModel on this machine by timing real forwards of a pipeline.

    python -m batchgen.diffusion.distributed.calibrate PIPELINE_DIR [--workers 2] [--out cost.json]

Times predict() for rows x image sizes (best of 3 each) and fits fixed, per_token and per_attn
by non-negative least squares (degree 1), on the batches up to the largest one that still runs
at about the best time per token (fit_cap: the cost model's max_batch_tokens, where a larger
batch timed runs slower per token). With workers (`calibrate_cluster`, or --workers N: a
LocalCluster of N one-thread processes), degree 1 is timed on one Dask worker and degree d on d
workers at once (Ulysses over the group-free collectives); what a degree-d forward takes beyond
the degree-1 compute split d ways is fitted as comm_fixed (per forward) + per_comm_token (per
image token, x (d-1)/d: the all-to-all's share that leaves each member). Where the workers
share too few cores that excess is large, and the policy, reading it, keeps degree 1.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ...policy.diffusion_cost import CostModel


def time_forward(pipe, rows: int, latent: int, repeats: int = 3, sp=None, warm: bool = True) -> float:  # noqa: ANN001
    """Best of `repeats` seconds for one forward of rows x latent^2 (pipe: a Pipeline; sp: an
    UlyssesShard, every member calls this); warm: one untimed forward first."""
    import torch

    from ..models import wan
    from ..models.forward import predict
    from ..models.mmdit import timing_cond
    from ..models.pipeline import MMDIT

    x = torch.randn(rows, pipe.latent_channels, latent, latent)
    t = torch.full((rows,), 500, dtype=torch.long)
    if pipe.is_video:  # one latent frame: latent^2 / p^2 tokens, as an image of that size
        x = x[:, :, None]
        cond = wan.timing_cond(pipe, rows)
    elif pipe.family in MMDIT:
        cond = timing_cond(pipe, rows)
    elif pipe.family == "dit":
        cond = {"class_labels": torch.zeros(rows, dtype=torch.long)}
    else:
        width = pipe.text_encoder.config.d_model
        cond = {"embeds": torch.randn(rows, pipe.max_sequence_length, width),
                "mask": torch.ones(rows, pipe.max_sequence_length, dtype=torch.long)}
    best = float("inf")
    with torch.no_grad():
        if warm:
            predict(pipe, x, t, cond, sp)
        for _ in range(repeats):
            start = time.perf_counter()
            predict(pipe, x, t, cond, sp)
            best = min(best, time.perf_counter() - start)
    return best


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares over few terms: the best fit among the column subsets whose
    unconstrained solution is non-negative (clipping a negative term would skew the others)."""
    import itertools

    n = a.shape[1]
    best, best_err = np.zeros(n), float("inf")
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (sub < 0).any():
                continue
            coef = np.zeros(n)
            coef[list(cols)] = sub
            err = float(np.sum((a @ coef - y) ** 2))
            if err < best_err:
                best, best_err = coef, err
    return best


def fit(samples: Sequence[tuple[int, int, float]], base: CostModel | None = None) -> CostModel:
    """samples: (batch tokens, tokens per image, seconds) -> CostModel (non-negative terms)."""
    a = np.array([[1.0, bt, bt * n] for bt, n, _ in samples])
    y = np.array([s for _, _, s in samples])
    best = _nnls(a, y)
    return replace(base or CostModel(), fixed=float(best[0]), per_token=float(best[1]), per_attn=float(best[2]))


def fit_cap(samples: Sequence[tuple[int, int, float]], slack: float = 0.15) -> int | None:
    """samples: (batch tokens, tokens per image, seconds) at degree 1 -> the most batch tokens a
    forward runs efficiently, or None. Read at the largest image size timed (the biggest
    batches): the largest batch whose time per token is within `slack` of that size's best,
    provided some larger batch timed is worse than that (else nothing says a limit exists)."""
    if not samples:
        return None
    n = max(n for _, n, _ in samples)
    pts = sorted((bt, s / bt) for bt, m, s in samples if m == n and bt > 0)
    best = min(per for _, per in pts)
    ok = [bt for bt, per in pts if per <= best * (1 + slack)]
    if not any(bt > max(ok) and per > best * (1 + slack) for bt, per in pts):
        return None
    return max(ok)


def fit_comm(samples: Sequence[tuple[int, int, int, float]], base: CostModel) -> CostModel:
    """samples: (batch tokens, tokens per image, degree > 1, seconds) -> `base` with comm_fixed and
    per_comm_token fitted to what each forward took beyond base's degree-1 terms split d ways."""
    if not samples:
        return base
    a = np.array([[1.0, bt * (d - 1) / d] for bt, _, d, _ in samples])
    y = np.array([s - base.fixed - (base.per_token * bt + base.per_attn * bt * n) / d for bt, n, d, s in samples])
    best = _nnls(a, y)
    return replace(base, comm_fixed=float(best[0]), per_comm_token=float(best[1]))


def calibrate(pipe, rows: Sequence[int] = (1, 2, 4, 8, 16), latents: Sequence[int] = (8, 16, 32)) -> CostModel:  # noqa: ANN001
    p = pipe.patch_size
    samples = []
    for r in rows:
        for lat in latents:
            n = (lat // p) ** 2
            samples.append((r * n, n, time_forward(pipe, r, lat)))
    cap = fit_cap(samples)
    return replace(fit([x for x in samples if cap is None or x[0] <= cap]), max_batch_tokens=cap)


def _time_on_worker(model: str, engine_options: dict, ranks: tuple[int, ...], rows: int, latent: int,
                    warm: bool, salt: str) -> float:
    """A Dask task on each member of `ranks` (one member: degree 1, no collectives), timed on
    that worker's engine for the model."""
    from ..parallel.groups import Group
    from ..parallel.sp import UlyssesShard
    from .on_worker import on_engine

    sp = UlyssesShard(Group.of(ranks, salt=salt)) if len(ranks) > 1 else None
    return on_engine(model, engine_options, lambda engine: time_forward(engine.pipe, rows, latent, 1, sp, warm))


def _shape_on_worker(model: str, engine_options: dict) -> tuple[int, tuple[int, ...]]:
    """-> the pipeline's patch size and the degrees its heads allow (a Dask task)."""
    from .elastic_loop import allowed_degrees
    from .on_worker import on_engine
    from .world import world_size

    return on_engine(model, engine_options,
                     lambda engine: (engine.pipe.patch_size, allowed_degrees(engine.pipe, world_size())))


def calibrate_cluster(client, model: str, rows: Sequence[int] = (1, 4, 8, 16), latents: Sequence[int] = (8, 16, 24),  # noqa: ANN001
                      degrees: Sequence[int] | None = None, repeats: int = 3,
                      engine_options: dict | None = None) -> CostModel:
    """The whole CostModel measured on the Dask workers of `client` (see the module docstring);
    degrees: those to time beyond 1 (default: every one up to the worker count that divides the
    model's heads). The world is started if it is not (world.world_ranks)."""
    from .world import world_ranks

    opts = dict(engine_options or {})
    ranks = world_ranks(client)
    by_rank = sorted(ranks, key=ranks.get)
    p, allowed = client.submit(_shape_on_worker, model, opts, workers=[by_rank[0]], pure=False).result()
    if degrees is None:
        degrees = [d for d in allowed if d > 1]
    points = [(r, lat, d) for r in rows for lat in latents for d in (1, *degrees)]
    best: dict[tuple[int, int, int], float] = {}
    # repeats outermost: a burst of load from elsewhere hits every point once, not one point always
    for rep in range(repeats):
        for r, lat, d in points:
            members = by_rank[:d]
            futures = [client.submit(_time_on_worker, model, opts, tuple(ranks[w] for w in members), r, lat,
                                     rep == 0, f"calibrate:{rep}:{r}:{lat}:{d}", workers=[w],
                                     allow_other_workers=False, pure=False) for w in members]
            seconds = max(client.gather(futures))
            best[(r, lat, d)] = min(seconds, best.get((r, lat, d), float("inf")))
    ones = [(r * (lat // p) ** 2, (lat // p) ** 2, s) for (r, lat, d), s in best.items() if d == 1]
    more = [(r * (lat // p) ** 2, (lat // p) ** 2, d, s) for (r, lat, d), s in best.items() if d > 1]
    cap = fit_cap(ones)
    if cap is not None:  # the linear terms from the batches that run at the efficient rate
        ones = [x for x in ones if x[0] <= cap]
        more = [x for x in more if x[0] <= cap * x[2]]
    cost = replace(fit_comm(more, fit(ones)), max_batch_tokens=cap)
    shown = ", ".join(f"{bt}x{n}@{d}:{s * 1e3:.1f}ms" for bt, n, d, s in more)
    return replace(cost, source=f"calibrate_cluster on {len(by_rank)} workers, {Path(model).name}; degree > 1: {shown}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchgen.diffusion.distributed.calibrate")
    ap.add_argument("model")
    ap.add_argument("--workers", type=int, default=1, help="> 1: also fit the degree terms on a LocalCluster")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.workers > 1:
        from distributed import Client, LocalCluster

        with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=None,
                          env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}) as cluster, Client(cluster) as client:
            model = calibrate_cluster(client, args.model)
    else:
        from ..models.pipeline import load_pipeline

        model = calibrate(load_pipeline(args.model))
    print(model)
    if args.out:
        model.save(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
