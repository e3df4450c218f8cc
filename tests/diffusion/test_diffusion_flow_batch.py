"""flow_batch.flow_step against diffusers' FlowMatchEulerDiscreteScheduler.step row by row: bit-identical."""
from __future__ import annotations

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from batchgen.diffusion.models import flow_batch  # noqa: E402

CONFIGS = [({"shift": 3.0}, {}),                                           # SD3.5
           ({"shift": 1.0}, {"sigmas": "flux"}),                           # Flux-schnell
           ({"use_dynamic_shifting": True, "shift": 3.0}, {"mu": 0.83, "sigmas": "flux"}),  # Flux-dev
           ({"shift": 3.0, "shift_terminal": 0.02, "invert_sigmas": False}, {})]


def _scheduler(config: dict, extra: dict, steps: int):
    s = diffusers.FlowMatchEulerDiscreteScheduler(**config)
    kw = dict(extra)
    if kw.get("sigmas") == "flux":
        kw["sigmas"] = np.linspace(1.0, 1 / steps, steps)
    s.set_timesteps(steps, **kw)
    s.set_begin_index(0)
    return s


@pytest.mark.parametrize(("config", "extra"), CONFIGS)
def test_batched_flow_step_equals_diffusers_row_by_row(config: dict, extra: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    steps = [1, 2, 5, 28, 50]
    ours = [_scheduler(config, extra, n) for n in steps]
    theirs = [_scheduler(config, extra, n) for n in steps]
    assert all(flow_batch.batchable(s) for s in ours)
    sample = torch.randn(len(steps), 4, 6, 5, generator=gen)
    ref = sample.clone()
    for _ in range(max(steps)):
        live = [i for i, n in enumerate(steps) if theirs[i].step_index is None or theirs[i].step_index < n]
        out = torch.randn(len(steps), 4, 6, 5, generator=gen)
        idx = torch.tensor(live)
        sample[idx] = flow_batch.flow_step([ours[i] for i in live], out[idx], sample[idx])
        for i in live:
            t = theirs[i].timesteps[theirs[i].step_index or 0]
            ref[i:i + 1] = theirs[i].step(out[i:i + 1], t, ref[i:i + 1], return_dict=False)[0]
            assert ours[i].step_index == theirs[i].step_index
    # exactly equal (shift_terminal with one step gives NaN, in both)
    torch.testing.assert_close(sample, ref, rtol=0, atol=0, equal_nan=True)


def test_stochastic_sampling_is_not_batched() -> None:
    assert not flow_batch.batchable(diffusers.FlowMatchEulerDiscreteScheduler(stochastic_sampling=True))
    assert not flow_batch.batchable(diffusers.EulerDiscreteScheduler())
