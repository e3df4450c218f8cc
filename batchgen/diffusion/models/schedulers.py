"""diffusers schedulers, one instance per trajectory, with their state read out and put back.

A trajectory's scheduler state is the difference between its live scheduler's attributes and a
fresh instance after `set_timesteps(n)`: step index, DPM-Solver's history of model outputs,
lower_order_nums, Euler's sigmas cursor, ... (whatever the class keeps) — small, picklable, and
resumable into a fresh instance on any engine.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from ...errors import UnsupportedModelError

# deterministic: the image depends on the initial noise only.
DETERMINISTIC = ("DDIMScheduler", "DPMSolverMultistepScheduler", "EulerDiscreteScheduler",
                 "FlowMatchEulerDiscreteScheduler", "UniPCMultistepScheduler")
FLOW = "FlowMatchEulerDiscreteScheduler"  # SD3's and Flux's; the only one they run here
# Wan 2.1's own scheduler (flow_prediction, use_flow_sigmas, flow_shift); for Wan only, which also
# runs FLOW (diffusers' Wan tests)
UNIPC = "UniPCMultistepScheduler"
# these draw noise every step from the trajectory's own generator (its RNG state travels).
STOCHASTIC = ("DDPMScheduler",)
SUPPORTED = DETERMINISTIC + STOCHASTIC


def check_scheduler(cls: str, config: dict[str, Any], where: str, family: str | None = None) -> None:
    """Raise UnsupportedModelError naming the scheduler (or option) we do not run."""
    if cls not in SUPPORTED:
        raise UnsupportedModelError(f"{where}: scheduler {cls!r} is not supported (supported: {', '.join(SUPPORTED)})")
    if cls == "DPMSolverMultistepScheduler" and "sde" in str(config.get("algorithm_type", "dpmsolver++")):
        raise UnsupportedModelError(f"{where}: {cls} with algorithm_type={config['algorithm_type']!r} is not supported")
    if cls == "DDIMScheduler" and config.get("thresholding"):
        raise UnsupportedModelError(f"{where}: {cls} with thresholding=True is not supported")
    flow_family = family in ("sd3", "flux")
    if flow_family and cls != FLOW:
        raise UnsupportedModelError(f"{where}: scheduler {cls!r} is not supported for {family} (supported: {FLOW})")
    if family == "wan" and cls not in (FLOW, UNIPC):
        raise UnsupportedModelError(f"{where}: scheduler {cls!r} is not supported for wan (supported: {FLOW}, {UNIPC})")
    if cls == UNIPC and (family != "wan" or config.get("prediction_type") != "flow_prediction"
                         or not config.get("use_flow_sigmas")):
        raise UnsupportedModelError(f"{where}: {cls} is supported for Wan's flow prediction only "
                                    "(prediction_type='flow_prediction', use_flow_sigmas=True)")
    if family == "wan" and cls == FLOW and config.get("use_dynamic_shifting"):
        # WanPipeline sets its timesteps without mu: diffusers itself would fail at the first request
        raise UnsupportedModelError(f"{where}: {cls} with use_dynamic_shifting=True is not supported for wan")
    if cls == FLOW and family is not None and not flow_family and family != "wan":
        raise UnsupportedModelError(f"{where}: {cls} is not supported for {family} (a flow-matching scheduler)")
    if cls == FLOW and config.get("stochastic_sampling"):
        # diffusers' SD3 and Flux pipelines step it without a generator: no reproducible image
        raise UnsupportedModelError(f"{where}: {cls} with stochastic_sampling=True is not supported")
    if family == "dit" and cls in STOCHASTIC:
        # DiTPipeline steps the scheduler on the doubled CFG batch, drawing noise for both halves.
        raise UnsupportedModelError(f"{where}: DiTPipeline with the stochastic scheduler {cls!r} is not supported")


@dataclass(frozen=True, slots=True)
class Timing:
    """set_timesteps' arguments beyond the step count, as a flow-matching pipeline passes them:
    mu (dynamic shifting by the image's tokens) and sigmas (Flux's linspace(1, 1/n, n))."""

    mu: float | None = None
    sigmas: tuple[float, ...] | None = None

    def kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in (("mu", self.mu), ("sigmas", self.sigmas)) if v is not None}


def calculate_shift(image_seq_len: int, base_seq_len: int, max_seq_len: int, base_shift: float,
                    max_shift: float) -> float:
    """diffusers' calculate_shift (SD3 and Flux pipelines), the same expressions: equal mu."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def make_scheduler(cls: str, config: dict[str, Any], steps: int, device: str = "cpu",
                   timing: Timing = Timing()) -> Any:
    """A fresh scheduler after set_timesteps(steps, **timing): a deep copy of one made once per
    (class, config, steps, device, timing). from_config + set_timesteps cost ~4 ms a request on
    CPU (config validation, building the tables), as much as a small image's forward."""
    key = (cls, json.dumps(dict(config), sort_keys=True, default=repr), steps, str(device), timing)
    proto = _PROTOTYPES.get(key)
    if proto is None:
        proto = _build(cls, config, steps, device, timing)
        if len(_PROTOTYPES) >= _MAX_PROTOTYPES:
            _PROTOTYPES.pop(next(iter(_PROTOTYPES)))  # the oldest
        _PROTOTYPES[key] = proto
    return copy.deepcopy(proto)


_PROTOTYPES: dict[tuple, Any] = {}
_MAX_PROTOTYPES = 256


def _build(cls: str, config: dict[str, Any], steps: int, device: str, timing: Timing) -> Any:
    import diffusers

    sched = getattr(diffusers, cls).from_config(config)
    sched.set_timesteps(steps, device=device, **timing.kwargs())
    if hasattr(sched, "set_begin_index"):
        sched.set_begin_index(0)  # as PixArt's pipeline does; DiT's leaves it None (same steps)
    return sched


def read_state(sched: Any, fresh: Any) -> dict[str, Any]:
    """The attributes of `sched` that differ from `fresh` (same class, config and steps)."""
    return {k: _detach(v) for k, v in vars(sched).items()
            if k != "_internal_dict" and not _same(v, vars(fresh).get(k, _MISSING))}


def restore(cls: str, config: dict[str, Any], steps: int, state: dict[str, Any], device: str = "cpu",
            timing: Timing = Timing()) -> Any:
    sched = make_scheduler(cls, config, steps, device, timing)
    for k, v in state.items():
        setattr(sched, k, _to(v, device))
    return sched


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    import torch

    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu())))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        import numpy as np

        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
                and bool(np.array_equal(a, b))
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values are kept
        return False


def _detach(v: Any) -> Any:
    import torch

    if isinstance(v, torch.Tensor):
        return v.detach().cpu().clone()
    if isinstance(v, list):
        return [_detach(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_detach(x) for x in v)
    return v


def _to(v: Any, device: str) -> Any:
    import torch

    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, list):
        return [_to(x, device) for x in v]
    if isinstance(v, tuple):
        return tuple(_to(x, device) for x in v)
    return v
