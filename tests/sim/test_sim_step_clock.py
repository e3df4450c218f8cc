"""A decode slice's clock, computed in chunks as far as it is read, gives the values of one pass
over all its steps (the slow reference below), and so the same slice ends and positions."""
from __future__ import annotations

import numpy as np
import pytest

from batchgen.sim.cost import build_cost
from batchgen.sim.profiles import load_profile
from batchgen.sim.shapes import load_shape
from batchgen.sim.step_clock import StepClock


def _reference(cost: object, left_sorted: np.ndarray, c_sorted: np.ndarray, extra_s: float, steps: int) -> np.ndarray:
    """Every step's time at once, as a slice computed it before the clock."""
    j = np.arange(steps)
    done_by = np.searchsorted(left_sorted, j, side="right")
    active = len(left_sorted) - done_by
    c_suffix = np.concatenate([np.cumsum(c_sorted[::-1])[::-1], [0]])
    kv = c_suffix[done_by] + active * (j + 1)
    dt = cost.step_seconds(active, active, kv, kv)  # type: ignore[attr-defined]
    dt[0] += extra_s
    return np.cumsum(dt)


@pytest.mark.parametrize("rows", [1, 3, 257])
def test_the_chunked_clock_equals_one_pass(rows: int) -> None:
    cost = build_cost(load_profile("H200"), load_shape("qwen3-30b-a3b"))
    rng = np.random.default_rng(rows)
    left_sorted = np.sort(rng.integers(1, 5000, rows))
    c_sorted = rng.integers(16, 9000, rows)
    limit = int(left_sorted[-1])
    ref = _reference(cost, left_sorted, c_sorted, 0.25, limit)
    clock = StepClock(cost, left_sorted, c_sorted, 0.25, limit)
    for t in np.sort(rng.uniform(0, ref[-1] * 1.1, 40)):  # read a little at a time, as the ticks do
        cum = clock.covers(float(t), limit)
        assert np.array_equal(cum, ref[:len(cum)])
        assert len(cum) == limit or cum[-1] >= t
        assert int(cum.searchsorted(t)) == int(ref.searchsorted(t)) or len(cum) == limit
    assert np.array_equal(clock.upto(limit), ref)
    assert clock.at(limit) == float(ref[-1])
