"""Which worker runs what: the job's requests dealt out at the start, and what a busy worker
does for an idle one (hand it queued requests or trajectories, or form a synchronised group).
Torch-free, state in, decision out (elastic.py and elastic_loop.py act on it).

A worker's remaining time at degree 1 is estimated as its forwards run: one packed forward per
step for all its trajectories when the cost model packs (cost.py), else one per latent shape
(key), every trajectory of that key in it:

    T = fixed x (most steps left of any trajectory; unpacked: summed over keys, each key's most)
        + sum over trajectories of steps left x marginal(rows x tokens, tokens)

`deal` gives each request, longest first, to the worker whose list it lengthens least by that
estimate (list scheduling), so the workers start with lists of similar length; each admits its
own list in the policy's priority order without asking anyone.

Handing over the trajectory that runs longest (unpacked: the longest of its key) saves the
fixed cost of the steps only it keeps the worker taking; handing over one of many short ones
saves little. `handover` takes trajectories, most remaining work first, while that cuts
max(owner's T, thief's T) by more than `gain` of it.
When nothing is worth handing over, `spread_plan` asks plan.plan_round whether a round over
owner and thief (degree > 1 for some trajectory) is shorter than the owner's round alone: only
then do the two enter lockstep rounds (elastic_sync.py).
"""
from __future__ import annotations

from collections.abc import Sequence

from .diffusion_cost import CostModel
from .diffusion_plan import ClusterState, ElasticOptions, Placed, RoundPlan, plan_round
from .diffusion_step import TrajView, priority


def worker_time(views: Sequence[TrajView], cost: CostModel, scale: dict[tuple, float] | None = None,
                scale_default: float = 1.0) -> float:
    """Seconds to finish `views` on one worker at degree 1 (the module docstring's T); scale:
    (key, 1) -> measured / modelled step time (plan.Measured)."""
    by_key: dict[tuple, list[TrajView]] = {}
    for v in views:
        by_key.setdefault(v.key, []).append(v)
    total = 0.0
    for key, vs in by_key.items():
        s = (scale or {}).get((key, 1), scale_default)
        total += s * sum(v.remaining * cost.marginal(v.rows * v.tokens, v.tokens) for v in vs)
        if not cost.packed:
            total += s * cost.fixed * max(v.remaining for v in vs)
    if cost.packed and views:
        total += scale_default * cost.fixed * max(v.remaining for v in views)
    return total


def deal(views: Sequence[TrajView], ranks: Sequence[int], policy: str, now: float, cost: CostModel
         ) -> dict[int, list[int]]:
    """rank -> tids of `views` (not yet admitted), each list in priority order (module docstring)."""
    order = {v.tid: n for n, v in enumerate(priority(views, policy, now, cost))}
    lists: dict[int, list[int]] = {r: [] for r in ranks}
    total = {r: 0.0 for r in ranks}
    longest: dict[tuple, int] = {}  # (rank, key; packed: None) -> most steps of those on the rank
    # longest first (list scheduling's LPT rule), then each list back in priority order
    for v in sorted(views, key=lambda v: (-worker_time([v], cost), order[v.tid])):
        marginal = v.remaining * cost.marginal(v.rows * v.tokens, v.tokens)
        shared = None if cost.packed else v.key

        def grown(r: int) -> float:
            # called within this iteration only (min() and the line after it)
            return total[r] + marginal + cost.fixed * max(0, v.remaining - longest.get((r, shared), 0))  # noqa: B023
        r = min(ranks, key=lambda r: (grown(r), len(lists[r]), r))
        total[r] = grown(r)
        longest[(r, shared)] = max(longest.get((r, shared), 0), v.remaining)
        lists[r].append(v.tid)
    return {r: sorted(tids, key=order.__getitem__) for r, tids in lists.items()}


def handover(views: Sequence[TrajView], cost: CostModel, gain: float = 0.05, scale: dict[tuple, float] | None = None,
             scale_default: float = 1.0, max_running: int | None = None) -> tuple[int, ...]:
    """tids of the owner's `views` to hand to an idle worker (see the module docstring); a
    trajectory with no step left stays (it is about to be decoded)."""
    def t(vs: Sequence[TrajView]) -> float:
        return worker_time(vs, cost, scale, scale_default)

    keep = [v for v in views if v.remaining > 0]
    give: list[TrajView] = []
    cur = t(keep)
    for v in sorted(keep, key=lambda v: (-t([v]), v.tid)):
        if max_running is not None and len(give) >= max_running:
            break
        rest = [u for u in keep if u.tid != v.tid]
        new = max(t(rest), t([*give, v]))
        if new < cur * (1 - gain):
            keep, cur = rest, new
            give.append(v)
    return tuple(v.tid for v in give)


def spread_plan(owner: int, thief: int, views: Sequence[TrajView], now: float, degrees: Sequence[int], policy: str,
                cost: CostModel, options: ElasticOptions = ElasticOptions(), scale: dict[tuple, float] | None = None,
                scale_default: float = 1.0) -> RoundPlan | None:
    """The first round's plan over (owner, thief) if it runs some trajectory over more than one
    worker, else None (a synchronised group would buy nothing)."""
    running = tuple(Placed(v, (owner,)) for v in views if v.remaining > 0)
    if not running or max(degrees, default=1) < 2:
        return None
    state = ClusterState(tuple(sorted((owner, thief))), running, (), now, tuple(degrees), dict(scale or {}), {},
                         scale_default)
    plan = plan_round(state, policy, cost, options)
    return plan if any(len(g) > 1 for g in plan.groups.values()) else None
