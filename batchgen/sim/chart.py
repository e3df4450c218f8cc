"""`batchgen plan --png`: per-worker utilization over time, one panel per policy (matplotlib).

Each row of a panel is a worker; colour is the share of each time bin it spent running a
forward. Idle ends of rows are the long tail that static placement leaves."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import PlanError
from .planner import PlanReport

BINS = 200


def utilization_grid(timeline: tuple[tuple[float, float, int], ...], end: float, bins: int = BINS) -> np.ndarray:
    """[bins]: busy share of each of `bins` equal bins of [0, end]."""
    grid = np.zeros(bins)
    width = end / bins
    for start, stop, _ in timeline:
        first, last = int(start // width), min(bins - 1, int(stop // width))
        for b in range(first, last + 1):
            lo, hi = max(start, b * width), min(stop, (b + 1) * width)
            grid[b] += max(0.0, hi - lo) / width
    return np.minimum(grid, 1.0)


def draw_utilization(report: PlanReport, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlanError("--png needs matplotlib: pip install 'batchgen[plot]'") from exc
    end = max(r.bct_s for r in report.results)
    fig, axes = plt.subplots(len(report.results), 1, figsize=(9, 2 + 1.6 * len(report.results)), sharex=True,
                             squeeze=False)
    for ax, result in zip(axes[:, 0], report.results):
        grid = np.stack([utilization_grid(t, end) for t in result.timelines])
        ax.imshow(grid, aspect="auto", extent=(0, end, result.workers, 0), vmin=0, vmax=1, cmap="viridis",
                  interpolation="nearest")
        ax.axvline(report.ideal.bct_s, color="white", linestyle="--", linewidth=1)
        ax.set_ylabel("worker")
        ax.set_title(f"{result.policy}: BCT {result.bct_s:.0f} s, utilization {result.utilization:.0%} "
                     f"(dashed: ideal {report.ideal.bct_s:.0f} s) [simulated]", fontsize=9)
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise PlanError(f"--png {path}: cannot write it: {exc}") from exc
    finally:
        plt.close(fig)
