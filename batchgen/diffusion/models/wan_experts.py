"""Wan 2.2 A14B's two experts: WanPipeline runs `transformer` (high noise) at the steps whose
timestep is at or above boundary_ratio x num_train_timesteps and `transformer_2` (low noise)
below it. Here the choice is made per row, so trajectories at different timesteps still share a
step: each expert gets the rows it owns, in one forward (packed or not) of its own.

Shapes: parts i = 1..P of (x [B_i, ...], t [B_i], cond {name: [B_i, ...]}).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

Part = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def boundary_timestep(pipe: Any) -> float:
    """The timestep at and above which `transformer` runs (WanPipeline's boundary_timestep)."""
    assert pipe.boundary_ratio is not None
    return pipe.boundary_ratio * float(pipe.scheduler_options["num_train_timesteps"])


def per_expert(pipe: Any, parts: Sequence[Part], run: Callable[[Any, list[Part]], list[torch.Tensor]]
               ) -> list[torch.Tensor]:
    """pipe: a models.pipeline.Pipeline with a transformer_2 (typed Any, as packed.py takes it:
    pipeline.py imports this side). Each part's rows split by expert, each expert's share through
    `run` (given a pipeline whose `transformer` is that expert and which has no second one) ->
    the outputs per part, rows in the parts' order."""
    boundary = boundary_timestep(pipe)
    experts = ((replace(pipe, transformer_2=None, boundary_ratio=None), True),
               (replace(pipe, transformer=pipe.transformer_2, transformer_2=None, boundary_ratio=None), False))
    pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in parts]
    for view, high in experts:
        share, where = [], []
        for i, (x, t, cond) in enumerate(parts):
            rows = torch.nonzero((t >= boundary) if high else (t < boundary)).flatten()
            if not len(rows):
                continue
            share.append((x, t, cond) if len(rows) == len(t) else
                         (x[rows], t[rows], {k: v[rows] for k, v in cond.items()}))
            where.append((i, rows))
        if share:
            for (i, rows), out in zip(where, run(view, share)):
                pieces[i].append((rows, out))
    outs = []
    for (_, t, _), got in zip(parts, pieces):
        if len(got) == 1:  # every row with one expert
            outs.append(got[0][1])
            continue
        out = got[0][1].new_empty((len(t), *got[0][1].shape[1:]))
        for rows, o in got:
            out[rows] = o
        outs.append(out)
    return outs
