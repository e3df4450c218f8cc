"""Device profiles: a GPU's published figures (shipped JSON) or a calibrated fit (bench --calibrate).

A GPU profile is a device only; the cost model applies it to a model's shapes. A fitted profile
was measured with one model on one machine and carries that model's fitted step-time curve.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import PlanError

BUILTIN_PROFILES = ("H100", "H200", "A100-80G", "A5000", "L4")


def _number(profile: str, name: str, value: object, low: float, *, strict: bool = False,
            integer: bool = False) -> None:
    """A hand-written profile's field must be a finite number (an int where asked) >= low
    (> low with strict); the message names the field, not a comparison's TypeError."""
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    bad = isinstance(value, bool) or not ok or not math.isfinite(value)  # type: ignore[arg-type]
    if bad or value < low or (strict and value == low):  # type: ignore[operator]
        raise PlanError(f"profile {profile!r}: {name} must be {kind} {'>' if strict else '>='} {low:g}, got {value!r}")


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """Published figures of one GPU, plus the efficiency assumptions that turn peaks into times."""

    name: str
    memory_bytes: float
    peak_flops: float  # dense bf16
    hbm_bytes_per_s: float
    pcie_bytes_per_s: float  # host <-> device, each way
    network_bytes_per_s: float  # between workers (migration)
    nvlink_bytes_per_s: float = 0.0
    host_memory_bytes: float = 0.0
    disk_bytes_per_s: float = 0.0
    compute_efficiency: float = 0.5
    memory_efficiency: float = 0.8
    step_overhead_s: float = 0.002
    memory_utilization: float = 0.9
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    kind: str = "gpu"

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "peak_flops", "hbm_bytes_per_s", "pcie_bytes_per_s", "network_bytes_per_s"):
            _number(self.name, name, getattr(self, name), 0, strict=True)
        for name in ("nvlink_bytes_per_s", "host_memory_bytes", "disk_bytes_per_s", "step_overhead_s"):
            _number(self.name, name, getattr(self, name), 0)
        for name in ("compute_efficiency", "memory_efficiency", "memory_utilization"):
            _number(self.name, name, getattr(self, name), 0, strict=True)
            if getattr(self, name) > 1:
                raise PlanError(f"profile {self.name!r}: {name} must be in (0, 1], got {getattr(self, name)!r}")


FIT_TERMS = ("overhead_s", "per_token_s", "per_seq_s", "per_kv_token_s", "per_attn_pair_s", "per_expert_s",
             "per_host_byte_s", "per_disk_byte_s")


@dataclass(frozen=True, slots=True, eq=False)
class ExpertTraffic:
    """Measured expert bytes per forward of an offloaded engine, by tokens per forward.

    tokens [P] ascending, host_bytes / disk_bytes [P]: the mean bytes a forward of that many
    tokens copied from host memory / read from disk while calibrating; other sizes interpolate
    (piecewise linear in log tokens, flat past the ends). Replaces the uniform-routing estimate:
    the offload's eviction keeps the experts a router favours, so real forwards miss fewer."""

    tokens: np.ndarray
    host_bytes: np.ndarray
    disk_bytes: np.ndarray

    @classmethod
    def from_profile(cls, traffic: dict[str, Any]) -> ExpertTraffic | None:
        points = traffic.get("per_forward") or []
        if not points:
            return None
        try:
            arr = np.array(points, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise PlanError(f"expert_traffic.per_forward: numbers expected: {exc}") from exc
        if arr.ndim != 2 or arr.shape[1] != 3:
            raise PlanError(f"expert_traffic.per_forward: [[tokens, host bytes, disk bytes], ...] expected, "
                            f"got {points[:3]}...")
        if not np.isfinite(arr).all() or (arr < 0).any() or (arr[:, 0] < 1).any():
            raise PlanError(f"expert_traffic.per_forward: tokens >= 1 and bytes >= 0 expected, got {points[:3]}...")
        arr = arr[np.argsort(arr[:, 0], kind="stable")]
        return cls(arr[:, 0], arr[:, 1], arr[:, 2])

    def at(self, tokens: np.ndarray | float | int) -> tuple[np.ndarray, np.ndarray]:
        x = np.log(np.maximum(np.asarray(tokens, dtype=np.float64), 1.0))
        xp = np.log(self.tokens)
        on = np.asarray(tokens) > 0
        return np.interp(x, xp, self.host_bytes) * on, np.interp(x, xp, self.disk_bytes) * on


@dataclass(frozen=True, slots=True)
class FittedProfile:
    """Step time measured on a real engine and fitted (see cost.FittedCost for the terms)."""

    name: str
    model: str  # the model the fit was measured with (config.json's directory name)
    coefficients: dict[str, float]
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    num_experts: int  # routed experts per MoE layer of the model measured (0: dense)
    top_k: int
    num_moe_layers: int
    network_bytes_per_s: float
    host_bytes_per_s: float
    source: str
    fit: dict[str, Any] = field(default_factory=dict, compare=False)
    # an offloaded engine's measured expert traffic (bench --calibrate --expert-memory): budgets,
    # expert_bytes_from_disk / _from_host per generated token as the engine's stats report them,
    # and per_forward [[tokens, host bytes, disk bytes], ...]; {} when every expert was resident
    expert_traffic: dict[str, Any] = field(default_factory=dict)
    kind: str = "fitted"

    def __post_init__(self) -> None:
        for name in ("kv_capacity_tokens", "kv_bytes_per_token"):
            _number(self.name, name, getattr(self, name), 1, integer=True)
        for name in ("num_experts", "top_k", "num_moe_layers"):
            _number(self.name, name, getattr(self, name), 0, integer=True)
        for name in ("network_bytes_per_s", "host_bytes_per_s"):
            _number(self.name, name, getattr(self, name), 0, strict=True)
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise PlanError(f"profile {self.name!r}: top_k must be in [1, num_experts={self.num_experts}], "
                            f"got {self.top_k}")
        if not isinstance(self.coefficients, dict):
            raise PlanError(f"profile {self.name!r}: coefficients must be an object of {', '.join(FIT_TERMS)}")
        unknown = sorted(set(self.coefficients) - set(FIT_TERMS))
        if unknown:
            raise PlanError(f"profile {self.name!r}: unknown coefficients {unknown} (known: {', '.join(FIT_TERMS)})")
        for name, value in self.coefficients.items():
            _number(self.name, f"coefficients.{name}", value, 0)
        # every forward feeds >= 1 token of >= 1 sequence: some term must charge it time
        if sum(self.coefficients.get(k, 0.0) for k in FIT_TERMS[:5]) <= 0:
            raise PlanError(f"profile {self.name!r}: coefficients give a forward no time "
                            f"(one of {', '.join(FIT_TERMS[:5])} must be > 0)")
        for name in ("expert_traffic", "fit"):
            if not isinstance(getattr(self, name), dict):
                raise PlanError(f"profile {self.name!r}: {name} must be an object")
        ExpertTraffic.from_profile(self.expert_traffic)  # raises on a malformed per_forward


Profile = GpuProfile | FittedProfile


def _from_dict(data: dict[str, Any], origin: str) -> Profile:
    kind = data.get("kind", "gpu")
    cls: type[GpuProfile] | type[FittedProfile]
    cls = FittedProfile if kind == "fitted" else GpuProfile if kind == "gpu" else None  # type: ignore[assignment]
    if cls is None:
        raise PlanError(f"profile {origin}: unknown kind {kind!r} (gpu or fitted)")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise PlanError(f"profile {origin}: unknown fields {unknown}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise PlanError(f"profile {origin}: {exc}") from exc


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped GPU name (case-insensitive: H100, H200, A100-80G, A5000, L4) or a JSON file."""
    text = str(name_or_path)
    builtin = {p.lower(): p for p in BUILTIN_PROFILES}
    if text.lower() in builtin:
        raw = (resources.files("batchgen.sim") / "profiles" / f"{text.lower()}.json").read_text(encoding="utf-8")
        return _from_dict(json.loads(raw), builtin[text.lower()])
    path = Path(text).expanduser()
    if not path.is_file():
        raise PlanError(f"--profile {text!r}: not a shipped profile ({', '.join(BUILTIN_PROFILES)}) and no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PlanError(f"--profile {text}: cannot read it as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise PlanError(f"--profile {text}: expected a JSON object")
    return _from_dict(data, str(path))


def save_profile(profile: FittedProfile, path: Path) -> None:
    data = {f.name: getattr(profile, f.name) for f in fields(profile)}
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
