"""Which trajectories take a step now, in which groups, at what degree: torch-free, state in,
decisions out. The engine, the Dask scheduler (scheduler.py) and the benchmark's simulator of a
static system drive these same functions.

Policies (selectable per job): "fcfs" (arrival order), "srwf" (shortest remaining work first:
remaining steps x step cost), "deadline" (least slack first; a request that can no longer meet
its SLO yields to those that still can, then runs in arrival order).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .diffusion_cost import CostModel

POLICIES = ("fcfs", "srwf", "deadline")


@dataclass(frozen=True, slots=True)
class TrajView:
    """What a policy knows of one trajectory. key: trajectories with equal keys can share a
    forward; rows: 2 with classifier-free guidance, else 1; tokens: image tokens per row."""

    tid: int
    key: tuple
    tokens: int
    rows: int
    remaining: int
    arrival: float
    deadline: float | None = None


def check_policy(name: str) -> str:
    if name not in POLICIES:
        raise ValueError(f"unknown diffusion policy {name!r} (choose from {', '.join(POLICIES)})")
    return name


def priority(views: Sequence[TrajView], policy: str, now: float, cost: CostModel, degree: int = 1) -> list[TrajView]:
    """Views most urgent first."""
    check_policy(policy)
    if policy == "fcfs":
        return sorted(views, key=lambda v: (v.arrival, v.tid))
    if policy == "srwf":
        return sorted(views, key=lambda v: (remaining_work(v, cost, degree), v.arrival, v.tid))

    def slack_key(v: TrajView) -> tuple:
        if v.deadline is None:
            return (1, v.arrival, v.tid)
        slack = v.deadline - now - remaining_work(v, cost, degree)
        return (0, slack, v.tid) if slack >= 0 else (2, v.arrival, v.tid)
    return sorted(views, key=slack_key)


def remaining_work(v: TrajView, cost: CostModel, degree: int = 1) -> float:
    """Seconds this trajectory still needs if it ran alone at `degree`."""
    return v.remaining * cost.step_time(v.tokens * v.rows, v.tokens, degree)


def plan_step(views: Sequence[TrajView], policy: str, now: float, cost: CostModel,
              max_rows: int = 64, max_tokens: int | None = None) -> list[list[int]]:
    """-> groups of tids, each one forward, most urgent group first. Trajectories are taken in
    priority order while the step's budget lasts (rows, and image tokens summed over rows);
    those taken are grouped by key, so mixed timesteps share a forward (split where the group
    passes the cost model's max_batch_tokens: split_forward)."""
    groups: dict[tuple, list[int]] = {}
    rows = tokens = 0
    for v in priority(views, policy, now, cost):
        if groups and (rows + v.rows > max_rows or (max_tokens is not None and tokens + v.rows * v.tokens > max_tokens)):
            continue  # a smaller one further down may still fit
        groups.setdefault(v.key, []).append(v)
        rows += v.rows
        tokens += v.rows * v.tokens
    return [part for vs in groups.values() for part in split_forward(vs, cost)]


def split_forward(views: Sequence[TrajView], cost: CostModel) -> list[list[int]]:
    """One key's trajectories -> tids per forward: cost.chunks(...) forwards of about equal rows
    (whole trajectories: a guided one's two rows stay together), in the given order."""
    k = min(len(views), cost.chunks(sum(v.rows * v.tokens for v in views)))
    if k == 1:
        return [[v.tid for v in views]]
    parts: list[list[TrajView]] = [[] for _ in range(k)]
    for v in sorted(views, key=lambda v: -v.rows):  # largest first onto the lightest part
        min(parts, key=lambda p: (sum(u.rows for u in p), len(p))).append(v)
    order = {v.tid: n for n, v in enumerate(views)}
    return [sorted((v.tid for v in p), key=order.__getitem__) for p in parts if p]


def pack_forwards(forwards: Sequence[Sequence[TrajView]], cost: CostModel) -> list[list[int]]:
    """One worker's degree-1 forwards of a step (plan_step's groups) -> the indices of those run
    as one packed forward, in order. Packed: consecutive forwards share one while their tokens
    together stay within max_batch_tokens (no limit: all in one); unpacked: each alone."""
    if not cost.packed:
        return [[i] for i in range(len(forwards))]
    cap = cost.max_batch_tokens
    packs: list[list[int]] = []
    filled = 0
    for i, vs in enumerate(forwards):
        tokens = sum(v.rows * v.tokens for v in vs)
        if packs and (cap is None or filled + tokens <= cap):
            packs[-1].append(i)
            filled += tokens
        else:
            packs.append([i])
            filled = tokens
    return packs


def best_degree(tokens: int, cost: CostModel, free: int, max_degree: int | None = None) -> int:
    """The sequence-parallel degree (1..free) with the lowest step time for `tokens` image
    tokens; small images stay at 1, large ones spread (GF-DiT's per-step table)."""
    top = max(1, min(free, max_degree or free))
    return min(range(1, top + 1), key=lambda d: (cost.step_time(tokens, tokens, d), d))
