"""Admitted trajectories' conditioning: their prompts through the text encoder, a few at a time."""
from __future__ import annotations

from typing import Any

from ..models.condition import encode_prompts
from .trajectory import Status, Trajectory

# prompts per text-encoder call: T5 / UMT5 build a [B, heads, L, L] position bias in every layer
# (L up to 512), so one call over a whole admission could exhaust memory for every request
ENCODE_CHUNK = 16


def encode_conditions(pipe: Any, trajs: list[Trajectory]) -> None:
    """Set each trajectory's `cond` from its prompt; a call that raises is retried prompt by
    prompt, and a prompt whose own encoding raises fails that trajectory alone."""
    for lo in range(0, len(trajs), ENCODE_CHUNK):
        _encode(pipe, trajs[lo:lo + ENCODE_CHUNK])


def _encode(pipe: Any, trajs: list[Trajectory]) -> None:
    try:
        conds = encode_prompts(pipe, [t.request.prompt for t in trajs])
    except Exception as exc:  # noqa: BLE001 - the request fails, the job goes on
        if len(trajs) > 1:
            for t in trajs:
                _encode(pipe, [t])
            return
        trajs[0].error = f"prompt: the text encoder failed ({type(exc).__name__}: {exc})"
        trajs[0].move(Status.FAILED, "text encoder failed")
        return
    for t, cond in zip(trajs, conds):
        t.cond = cond
