"""ddim_batch.ddim_step against diffusers' DDIMScheduler.step row by row: bit-identical."""
from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from batchgen.diffusion.models import ddim_batch  # noqa: E402

CONFIGS = [
    {},
    {"prediction_type": "v_prediction", "timestep_spacing": "trailing", "set_alpha_to_one": False},
    {"prediction_type": "sample", "clip_sample": True, "clip_sample_range": 0.5, "timestep_spacing": "linspace"},
    {"prediction_type": "epsilon", "clip_sample": True, "beta_schedule": "scaled_linear", "steps_offset": 1},
]


@pytest.mark.parametrize("config", CONFIGS)
def test_batched_ddim_step_equals_diffusers_row_by_row(config: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    steps = [1, 3, 7, 10, 50, 999]  # one row with a single step, one at num_train_timesteps - 1
    scheds = []
    for n in steps:
        s = diffusers.DDIMScheduler(**config)
        s.set_timesteps(n)
        scheds.append(s)
    assert all(ddim_batch.batchable(s) for s in scheds)
    for at in (0, -1):  # the first step and the last (prev timestep < 0: final_alpha_cumprod)
        ts = [s.timesteps[at if at == 0 else len(s.timesteps) - 1] for s in scheds]
        out = torch.randn(len(steps), 4, 6, 5, generator=gen)
        sample = torch.randn(len(steps), 4, 6, 5, generator=gen)
        prev, original = ddim_batch.ddim_step(scheds, ts, out, sample)
        for i, (s, t) in enumerate(zip(scheds, ts)):
            ref_prev, ref_original = s.step(out[i:i + 1], t, sample[i:i + 1], return_dict=False)
            assert torch.equal(prev[i:i + 1], ref_prev), (config, steps[i], at)
            assert torch.equal(original[i:i + 1], ref_original), (config, steps[i], at)


def test_what_ddim_batch_does_not_reproduce_takes_diffusers_step() -> None:
    assert not ddim_batch.batchable(diffusers.DDIMScheduler(thresholding=True))
    assert not ddim_batch.batchable(diffusers.DPMSolverMultistepScheduler())
    assert not ddim_batch.batchable(diffusers.EulerDiscreteScheduler())
