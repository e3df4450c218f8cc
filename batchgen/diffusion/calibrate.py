"""Fit the step-time CostModel on this machine by timing real forwards of a pipeline.

    python -m batchgen.diffusion.calibrate PIPELINE_DIR [--out cost.json]

Times predict() for rows x image sizes (best of 3 each), least-squares fits fixed, per_token and
per_attn (degree 1). The degree > 1 terms come from sp measurements (`fit_comm`), else defaults.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from .cost import CostModel


def time_forward(pipe, rows: int, latent: int, repeats: int = 3) -> float:  # noqa: ANN001 - a Pipeline
    import torch

    from .forward import predict

    x = torch.randn(rows, pipe.latent_channels, latent, latent)
    t = torch.full((rows,), 500, dtype=torch.long)
    if pipe.family == "dit":
        cond = {"class_labels": torch.zeros(rows, dtype=torch.long)}
    else:
        width = pipe.text_encoder.config.d_model
        cond = {"embeds": torch.randn(rows, pipe.max_sequence_length, width),
                "mask": torch.ones(rows, pipe.max_sequence_length, dtype=torch.long)}
    best = float("inf")
    with torch.no_grad():
        predict(pipe, x, t, cond)
        for _ in range(repeats):
            start = time.perf_counter()
            predict(pipe, x, t, cond)
            best = min(best, time.perf_counter() - start)
    return best


def fit(samples: Sequence[tuple[int, int, float]], base: CostModel | None = None) -> CostModel:
    """samples: (batch tokens, tokens per image, seconds) -> CostModel (non-negative terms)."""
    import itertools

    a = np.array([[1.0, bt, bt * n] for bt, n, _ in samples])
    y = np.array([s for _, _, s in samples])
    # non-negative least squares over 3 terms: the best fit among the column subsets whose
    # unconstrained solution is non-negative (clipping a negative term would skew the others)
    best, best_err = np.zeros(3), float("inf")
    for k in (1, 2, 3):
        for cols in itertools.combinations(range(3), k):
            sub, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (sub < 0).any():
                continue
            coef = np.zeros(3)
            coef[list(cols)] = sub
            err = float(np.sum((a @ coef - y) ** 2))
            if err < best_err:
                best, best_err = coef, err
    return replace(base or CostModel(), fixed=float(best[0]), per_token=float(best[1]), per_attn=float(best[2]))


def calibrate(pipe, rows: Sequence[int] = (1, 2, 4, 8), latents: Sequence[int] = (8, 16, 32)) -> CostModel:  # noqa: ANN001
    p = pipe.patch_size
    samples = []
    for r in rows:
        for lat in latents:
            n = (lat // p) ** 2
            samples.append((r * n, n, time_forward(pipe, r, lat)))
    return fit(samples)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchgen.diffusion.calibrate")
    ap.add_argument("model")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from .pipeline import load_pipeline

    model = calibrate(load_pipeline(args.model))
    print(model)
    if args.out:
        model.save(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
