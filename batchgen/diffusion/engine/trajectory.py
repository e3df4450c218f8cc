"""A denoising trajectory as explicit state: what a coroutine would hold between its yield points.

Not a live generator: everything needed to take the next step is a field, so a trajectory
suspends to bytes at any step boundary and resumes on another engine or Dask worker.
"""
from __future__ import annotations

import enum
import io
import pickle
from dataclasses import dataclass, field
from typing import Any

from ...errors import StateError
from .request import ImageRequest

# 2: cfg_scale travels (a family's default guidance resolved at admission); 3: num_frames travels
# (a video's frame count, its model's default resolved at admission; ImageRequest gained the field)
STATE_VERSION = 3


class Status(enum.Enum):
    WAITING = "waiting"      # conditioning not computed yet
    RUNNING = "running"      # between two steps
    DENOISED = "denoised"    # all steps taken, VAE decode pending
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(slots=True)
class Trajectory:
    """One request's denoising state.

    latents: [C, h, w] (h, w = pixels / VAE factor; a video's [C, F', h, w]); cond: DiT
    {"class_label": int}, PixArt {"embeds": [L, D], "mask": [L]}, Wan {"embeds": [L, D]} (computed
    once, at admission); num_frames: a video's frames, None for an image; scheduler_state: schedulers.read_state
    of its scheduler; rng_state: its torch.Generator's state (stochastic schedulers draw from it).
    """

    tid: int
    request: ImageRequest
    height: int
    width: int
    num_frames: int | None = None
    status: Status = Status.WAITING
    step: int = 0
    latents: Any = None
    cond: dict[str, Any] = field(default_factory=dict)
    scheduler_state: dict[str, Any] = field(default_factory=dict)
    rng_state: Any = None
    model_key: str = ""
    cfg_scale: float = 1.0  # classifier-free guidance scale (> 1: an unconditional row joins each forward)
    error: str | None = None
    reasons: list[str] = field(default_factory=list)  # why the status changed, in order

    @property
    def num_steps(self) -> int:
        return self.request.num_inference_steps

    @property
    def remaining_steps(self) -> int:
        return self.num_steps - self.step

    @property
    def uses_guidance(self) -> bool:
        return self.cfg_scale > 1.0

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return tuple(self.latents.shape)

    @property
    def group_key(self) -> tuple[tuple[int, ...]]:
        """Trajectories with equal keys can share a forward, at any timesteps and with or without
        classifier-free guidance (a guided one adds its unconditional row to the same forward)."""
        return (self.latent_shape,)

    def move(self, status: Status, reason: str) -> None:
        self.status = status
        self.reasons.append(f"{status.value}: {reason}")


def to_bytes(traj: Trajectory) -> bytes:
    buf = io.BytesIO()
    pickle.dump((STATE_VERSION, traj), buf, protocol=pickle.HIGHEST_PROTOCOL)
    return buf.getvalue()


def from_bytes(data: bytes, model_key: str) -> Trajectory:
    try:
        version, traj = pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a corrupt state
        raise StateError(f"cannot read a suspended trajectory ({type(exc).__name__}: {exc})") from exc
    if version != STATE_VERSION or not isinstance(traj, Trajectory):
        raise StateError(f"suspended trajectory has version {version!r}, this batchgen reads {STATE_VERSION}")
    if traj.model_key != model_key:
        raise StateError(f"trajectory was suspended on model {traj.model_key!r}, this engine runs {model_key!r}")
    return traj
