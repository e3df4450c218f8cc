"""diffusers' DDIM step (eta 0) for many trajectories in one set of tensor ops.

Each trajectory keeps its own DDIMScheduler (its own step count and timesteps); a step of B of
them is B calls of `DDIMScheduler.step`, each a dozen tensor ops on one image: per-call overhead
that dominates for small images and costs B x 12 kernel launches on a GPU. Here the per-row
coefficients (alpha_prod_t, alpha_prod_t_prev from each scheduler's own tables) are gathered into
[B, 1, ..., 1] tensors and the same expressions, in the same order and dtype, run once over the
batch. The result is bit-identical to the per-row calls (tests/test_diffusion_ddim_batch.py checks
every prediction type, clipping, spacing and final-alpha setting against diffusers); anything
else (eta > 0, thresholding, another scheduler) takes diffusers' own step.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def batchable(scheduler: Any) -> bool:
    """A deterministic DDIM step this module reproduces exactly (thresholding is refused at load)."""
    import diffusers

    cfg = scheduler.config
    return (type(scheduler) is diffusers.DDIMScheduler and not cfg.thresholding
            and cfg.prediction_type in ("epsilon", "sample", "v_prediction"))


def ddim_step(schedulers: Sequence[Any], timesteps: Sequence[torch.Tensor], model_output: torch.Tensor,
              sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """model_output, sample: [B, ...]; row i steps with schedulers[i] at timesteps[i] ->
    (prev_sample, pred_original_sample), both [B, ...], as DDIMScheduler.step(eta=0) gives them
    row by row. The schedulers must share prediction_type and clipping (one pipeline's config)."""
    first = schedulers[0].config
    a_t, a_prev = [], []
    for sched, t in zip(schedulers, timesteps):
        prev_t = t - sched.config.num_train_timesteps // sched.num_inference_steps
        a_t.append(sched.alphas_cumprod[t])
        a_prev.append(sched.alphas_cumprod[prev_t] if prev_t >= 0 else sched.final_alpha_cumprod)
    shape = (-1,) + (1,) * (sample.dim() - 1)
    alpha_prod_t = torch.stack(a_t).to(sample.device).view(shape)
    alpha_prod_t_prev = torch.stack(a_prev).to(sample.device).view(shape)
    beta_prod_t = 1 - alpha_prod_t
    if first.prediction_type == "epsilon":
        pred_original_sample = (sample - beta_prod_t ** (0.5) * model_output) / alpha_prod_t ** (0.5)
        pred_epsilon = model_output
    elif first.prediction_type == "sample":
        pred_original_sample = model_output
        pred_epsilon = (sample - alpha_prod_t ** (0.5) * pred_original_sample) / beta_prod_t ** (0.5)
    else:  # v_prediction
        pred_original_sample = (alpha_prod_t**0.5) * sample - (beta_prod_t**0.5) * model_output
        pred_epsilon = (alpha_prod_t**0.5) * model_output + (beta_prod_t**0.5) * sample
    if first.clip_sample:
        pred_original_sample = pred_original_sample.clamp(-first.clip_sample_range, first.clip_sample_range)
    # eta 0: std_dev_t is 0, and 1 - a_prev - 0 ** 2 is 1 - a_prev exactly
    pred_sample_direction = (1 - alpha_prod_t_prev) ** (0.5) * pred_epsilon
    prev_sample = alpha_prod_t_prev ** (0.5) * pred_original_sample + pred_sample_direction
    return prev_sample, pred_original_sample
