"""One denoising step for a group of compatible trajectories: one transformer forward; or for
several groups (latent shapes) at once: one token-packed forward (packed.py) when the pipeline packs.

Each trajectory keeps its own timestep (a per-sample timestep tensor), its own scheduler and its
own guidance scale; trajectories with guidance contribute a conditional and an unconditional row
to the same forward (CFG doubles the batch, not the forwards).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..models import ddim_batch, flow_batch, schedulers
from ..models.forward import predict
from ..models.packed import predict_packed
from ..models.pipeline import FLOW_FAMILIES, MMDIT

if TYPE_CHECKING:
    from ..models.pipeline import Pipeline
    from ..parallel.sp import UlyssesShard
    from .trajectory import Trajectory


@dataclass(slots=True)
class Live:
    """A running trajectory's live objects (rebuilt from its state on resume)."""

    scheduler: Any
    generator: torch.Generator
    stochastic: bool
    batched: bool = field(init=False)  # its steps can join one ddim_batch step (read once, not every step)

    def __post_init__(self) -> None:
        self.batched = not self.stochastic and (ddim_batch.batchable(self.scheduler)
                                                or flow_batch.batchable(self.scheduler))


def new_scheduler(pipe: Pipeline, traj: Trajectory, device: str) -> Any:
    """A fresh scheduler for `traj` (its steps, and its size where the family shifts by it)."""
    return schedulers.make_scheduler(pipe.scheduler_class, pipe.scheduler_config, traj.num_steps, device,
                                     pipe.timing(traj.height, traj.width, traj.num_steps))


def start(pipe: Pipeline, traj: Trajectory, device: str) -> Live:
    """A trajectory's first state: its scheduler and its initial noise [C, h, w] (a video's
    [C, F', h, w]), drawn as the family's diffusers pipeline draws it. ValueError: the scheduler
    refuses the request."""
    gen = torch.Generator(device="cpu").manual_seed(traj.request.seed)
    sched = new_scheduler(pipe, traj, device)
    f = pipe.vae_scale_factor
    frames = (pipe.latent_frames(traj.num_frames),) if pipe.is_video else ()
    shape = (1, pipe.latent_channels, *frames, traj.height // f, traj.width // f)
    # WanPipeline draws (and keeps until the first step) its latents in fp32, whatever the model's dtype
    dtype = torch.float32 if pipe.is_video else pipe.transformer.dtype
    latents = torch.randn(shape, generator=gen, dtype=dtype).to(device)
    if pipe.family == "pixart":  # DiT, SD3 and Flux do not scale their initial noise
        latents = latents * sched.init_noise_sigma
    traj.latents = latents[0]
    return Live(sched, gen, pipe.scheduler_class in schedulers.STOCHASTIC)


def resumed(pipe: Pipeline, traj: Trajectory, device: str) -> Live:
    """A suspended trajectory's live objects, rebuilt from its state."""
    timing = pipe.timing(traj.height, traj.width, traj.num_steps)
    sched = schedulers.restore(pipe.scheduler_class, pipe.scheduler_config, traj.num_steps, traj.scheduler_state,
                               device, timing)
    gen = torch.Generator(device="cpu")
    gen.set_state(traj.rng_state)
    return Live(sched, gen, pipe.scheduler_class in schedulers.STOCHASTIC)


def group_inputs(pipe: Pipeline, trajs: list[Trajectory], live: list[Live], uncond: dict[str, torch.Tensor] | None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """-> (x [B, C, h, w] (a video's [B, C, F', h, w]), t [B], cond) with rows: every trajectory's
    conditional row, then the unconditional rows of those using guidance, in the same order."""
    xs, ts = [], []
    for traj, lv in zip(trajs, live):
        t = lv.scheduler.timesteps[traj.step]
        x = traj.latents[None]
        # flow matching has no input scaling (diffusers' scheduler has no scale_model_input)
        xs.append(x if pipe.family in FLOW_FAMILIES else lv.scheduler.scale_model_input(x, t))
        ts.append(t)
    guided = [i for i, traj in enumerate(trajs) if traj.uses_guidance]
    x = torch.cat(xs + [xs[i] for i in guided])
    t = torch.stack(ts + [ts[i] for i in guided])
    if pipe.family in MMDIT:
        return x, t, _mmdit_cond(pipe, trajs, guided, uncond)
    if pipe.family == "wan":  # WanPipeline: the empty prompt's embeddings as the negative prompt
        embeds = [traj.cond["embeds"] for traj in trajs]
        if guided:
            assert uncond is not None
            embeds += [uncond["embeds"]] * len(guided)
        return x, t, {"embeds": torch.stack(embeds)}
    if pipe.family == "dit":
        labels = [traj.cond["class_label"] for traj in trajs] + [pipe.null_class] * len(guided)
        return x, t, {"class_labels": torch.tensor(labels, device=x.device)}
    assert uncond is not None
    embeds = [traj.cond["embeds"] for traj in trajs] + [uncond["embeds"]] * len(guided)
    masks = [traj.cond["mask"] for traj in trajs] + [uncond["mask"]] * len(guided)
    cond = {"embeds": torch.stack(embeds), "mask": torch.stack(masks)}
    if pipe.micro_conditions:
        res = [[float(tr.height), float(tr.width)] for tr in trajs]
        asp = [[float(tr.height / tr.width)] for tr in trajs]
        res += [res[i] for i in guided]
        asp += [asp[i] for i in guided]
        cond["resolution"] = torch.tensor(res, dtype=x.dtype, device=x.device)
        cond["aspect_ratio"] = torch.tensor(asp, dtype=x.dtype, device=x.device)
    return x, t, cond


def apply_output(pipe: Pipeline, trajs: list[Trajectory], live: list[Live], out: torch.Tensor) -> None:
    """Guidance, learned-sigma split and each trajectory's own scheduler step; latents advance.
    Guidance runs once over the guided rows; DDIM and (fp32) flow-matching steps run as one
    batched step (ddim_batch.py, flow_batch.py: bit-identical to diffusers' per-row calls), any
    other scheduler row by row."""
    n = len(trajs)
    # DiT guides the eps channels only (diffusers' DiTPipeline); a learned sigma is dropped after
    # guidance, which is elementwise: slicing first gives the same channels
    keep = pipe.latent_channels if pipe.learned_sigma or pipe.family == "dit" else out.shape[1]
    pred = out[:n, :keep]
    guided = [i for i, traj in enumerate(trajs) if traj.uses_guidance]
    if guided:
        uncond = out[n:n + len(guided), :keep]
        scale = torch.tensor([trajs[i].cfg_scale for i in guided], dtype=out.dtype,
                             device=out.device).view((-1,) + (1,) * (out.dim() - 1))
        rows = torch.tensor(guided, device=out.device)
        pred = pred.clone()
        pred[rows] = uncond + scale * (pred[rows] - uncond)
    batched = [i for i, lv in enumerate(live) if lv.batched]
    if pipe.family in FLOW_FAMILIES and len(batched) > 1:
        if pred.dtype == torch.float32:
            idx = torch.tensor(batched, device=out.device)
            prev = flow_batch.flow_step([live[i].scheduler for i in batched], pred[idx],
                                        torch.stack([trajs[i].latents for i in batched]))
            for j, i in enumerate(batched):
                trajs[i].latents = prev[j].clone()  # its own storage: a view would pickle the whole batch
                trajs[i].step += 1
        else:
            batched = []
    elif len(batched) > 1:
        idx = torch.tensor(batched, device=out.device)
        steps = [live[i].scheduler.timesteps[trajs[i].step] for i in batched]
        prev, original = ddim_batch.ddim_step([live[i].scheduler for i in batched], steps, pred[idx],
                                              torch.stack([trajs[i].latents for i in batched]))
        for j, i in enumerate(batched):
            traj = trajs[i]
            take = original if pipe.family == "pixart" and traj.num_steps == 1 else prev
            traj.latents = take[j].clone()  # its own storage: a view would pickle the whole batch
            traj.step += 1
    done = set(batched) if len(batched) > 1 else set()
    for i, (traj, lv) in enumerate(zip(trajs, live)):
        if i in done:
            continue
        t = lv.scheduler.timesteps[traj.step]
        kwargs: dict[str, Any] = {"generator": lv.generator} if lv.stochastic else {}
        sample = traj.latents[None]
        if pipe.family == "dit":
            # DiTPipeline steps from the *scaled* model input (the identity for DDIM and
            # DPM-Solver, sample / sqrt(sigma^2 + 1) for Euler): kept for equal images.
            sample = lv.scheduler.scale_model_input(sample, t)
        result = lv.scheduler.step(pred[i:i + 1], t, sample, return_dict=False, **kwargs)
        # PixArt takes the predicted original sample when only one step is asked for.
        take = 1 if pipe.family == "pixart" and traj.num_steps == 1 and len(result) > 1 else 0
        traj.latents = result[take][0]
        traj.step += 1


@torch.no_grad()
def step_group(pipe: Pipeline, trajs: list[Trajectory], live: list[Live],
               uncond: dict[str, torch.Tensor] | None, sp: UlyssesShard | None = None) -> None:
    x, t, cond = group_inputs(pipe, trajs, live, uncond)
    out = predict(pipe, x, t, cond, sp)
    apply_output(pipe, trajs, live, out)


@torch.no_grad()
def step_groups(pipe: Pipeline, groups: list[tuple[list[Trajectory], list[Live]]],
                uncond: dict[str, torch.Tensor] | None) -> None:
    """One step of several groups (each one latent shape): one packed forward for all when the
    pipeline packs, else one forward per group."""
    if len(groups) == 1 or not pipe.packs:
        for trajs, live in groups:
            step_group(pipe, trajs, live, uncond)
        return
    inputs = [group_inputs(pipe, trajs, live, uncond) for trajs, live in groups]
    for (trajs, live), out in zip(groups, predict_packed(pipe, inputs)):
        apply_output(pipe, trajs, live, out)


def _mmdit_cond(pipe: Pipeline, trajs: list[Trajectory], guided: list[int],
               uncond: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Rows as group_inputs orders them (every trajectory, then the unconditional rows of the
    guided ones) -> {"embeds": [B, L, D], "pooled": [B, P]} (+ Flux-dev's "guidance": [B])."""
    embeds = [t.cond["embeds"] for t in trajs]
    pooled = [t.cond["pooled"] for t in trajs]
    if guided:
        assert uncond is not None
        embeds += [uncond["embeds"]] * len(guided)
        pooled += [uncond["pooled"]] * len(guided)
    cond = {"embeds": torch.stack(embeds), "pooled": torch.stack(pooled)}
    if pipe.guidance_embeds:
        # FluxPipeline: torch.full([1], guidance_scale, dtype=float32), one value per row here
        cond["guidance"] = torch.tensor([pipe.guidance(t.request.guidance_scale) for t in trajs],
                                        dtype=torch.float32, device=embeds[0].device)
    return cond
