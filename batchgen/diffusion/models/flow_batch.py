"""diffusers' FlowMatchEulerDiscreteScheduler step (deterministic) for many trajectories in one
set of tensor ops.

Each trajectory keeps its own scheduler (its own steps, shift and mu, so its own sigmas); a step
of B of them is B calls of `FlowMatchEulerDiscreteScheduler.step`, a few tensor ops each on one
image: per-call overhead, and B x a few kernel launches on a GPU. Here each row's dt =
sigma_next - sigma (from its own scheduler, at its own step index) is gathered into a [B, 1, ...]
tensor and the same expression, prev = sample (fp32) + dt x model_output, runs once over the batch.
Bit-identical to the per-row calls for fp32 model outputs (tests/diffusion/test_diffusion_flow_batch.py);
a bf16 / fp16 output takes diffusers' own step (there a 0-d dt multiplies in the output's dtype).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def batchable(scheduler: Any) -> bool:
    """A deterministic flow-matching Euler step this module reproduces exactly (stochastic
    sampling is refused at load)."""
    import diffusers

    return type(scheduler) is diffusers.FlowMatchEulerDiscreteScheduler and not scheduler.config.stochastic_sampling


def flow_step(schedulers: Sequence[Any], model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """model_output (float32), sample: [B, ...]; row i steps with schedulers[i] at its own step
    index, which advances -> prev_sample [B, ...] in model_output's dtype, as the per-row calls."""
    dts = []
    for sched in schedulers:
        # the first step starts at begin_index (schedulers.py sets 0, as FluxPipeline does)
        i = sched.step_index if sched.step_index is not None else sched.begin_index
        if i is None:
            raise ValueError("a flow-matching scheduler without a step or begin index")
        dts.append(sched.sigmas[i + 1] - sched.sigmas[i])
        sched._step_index = i + 1
    dt = torch.stack(dts).to(sample.device).view((-1,) + (1,) * (sample.dim() - 1))
    return (sample.to(torch.float32) + dt * model_output).to(model_output.dtype)
