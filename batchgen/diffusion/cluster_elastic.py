"""The elastic scheduling loop on the workers: rounds of one step, degree chosen per round.

Every worker of the job runs `elastic_loop` (a Dask task pinned to it, all in one gloo world, see
sp_cluster.start_world). A round is:

  1. state: each worker all-gathers (over the world Group, group-free collectives) the running
     trajectories it owns (policy views: key, tokens, rows, remaining steps) and its clock;
  2. plan: each runs plan.plan_round (pure) on that same state -> the same RoundPlan everywhere:
     admissions, each trajectory's group (ranks) and degree, the round's forwards;
  3. reshard: a trajectory whose group gains members is copied to them (point-to-point, the
     owner's snapshot); members that leave it drop their copy. Every member holds the whole latents and the
     Ulysses forward takes its token shard, so a degree change moves state only to new members;
  4. run: each worker takes its degree-1 forwards, then the sequence-parallel ones it is a member
     of, in the plan's order (every member applies the same scheduler step to the all-gathered
     model output, so the copies stay identical);
  5. finish: the owner of a trajectory that took its last step decodes it and puts the result on
     the job's output Queue; the other members drop their copies.

The loops end together when the gathered state has nothing running and nothing left to admit.
"""
from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from typing import Any

from .cost import CostModel
from .plan import ClusterState, ElasticOptions, Measured, Placed, plan_round
from .policy import TrajView
from .request import ImageRequest


def request_view(pipe: Any, index: int, req: ImageRequest, arrival: float, deadline: float | None) -> TrajView:
    """The policy's view of a request not yet admitted (as the engine will see it)."""
    h, w = req.height or pipe.native_size, req.width or pipe.native_size
    f = pipe.vae_scale_factor
    key = ((pipe.latent_channels, h // f, w // f),)
    tokens = (h // f // pipe.patch_size) * (w // f // pipe.patch_size)
    return TrajView(index, key, tokens, 2 if req.uses_guidance else 1, req.num_inference_steps, arrival, deadline)


def allowed_degrees(pipe: Any, workers: int) -> tuple[int, ...]:
    """Degrees the Ulysses split allows: they divide the attention heads."""
    heads = pipe.transformer.config.num_attention_heads
    return tuple(d for d in range(1, workers + 1) if heads % d == 0)


def elastic_loop(model: str, job: str, world_ranks: tuple[int, ...], requests: Sequence[ImageRequest],
                 deadlines: Sequence[float | None], arrivals: Sequence[float], policy: str, options: ElasticOptions,
                 cost: CostModel, engine_options: dict, keep_arrays: bool) -> dict[str, Any]:
    """One worker's part of an elastic job (see the module docstring); -> its statistics."""
    import torch.distributed as dist
    from distributed import Queue, get_worker, secede

    from .cluster import ImageResult, _png
    from .frame import _engine
    from .groups import Group, all_gather_bytes, send_recv_bytes
    from .sp import UlyssesShard

    secede()
    engine = _engine(model, {**engine_options, "policy": policy, "cost": cost})
    pipe = engine.pipe
    me = dist.get_rank()
    address = get_worker().address
    world = Group.of(world_ranks, salt=f"bg-diff-{job}")
    out = Queue(f"bg-diff-out-{job}")
    degrees = allowed_degrees(pipe, len(world_ranks))
    held: dict[int, int] = {}                     # request index -> engine tid (this worker's copies)
    groups: dict[int, tuple[int, ...]] = {}       # request index -> ranks, as of the last plan (all workers)
    history: dict[int, list[tuple[int, int]]] = {}  # request index -> (owner, degree) per step taken
    pending = list(range(len(requests)))
    measured = Measured()
    samples: list[tuple[int, tuple, int, float, float]] = []  # this worker's forwards last round
    stats = {"rounds": 0, "forwards": 0, "sp_forwards": 0, "copies_in": 0, "max_degree": 1,
             "plan_s": 0.0, "sync_s": 0.0, "est_s": 0.0}
    start = None
    while True:
        t0 = time.perf_counter()
        mine = []
        for index, tid in held.items():
            t = engine.trajectory(tid)
            if groups[index][0] == me and t.remaining_steps > 0 and t.error is None:
                v = request_view(pipe, index, t.request, arrivals[index], deadlines[index])
                mine.append(Placed(TrajView(index, v.key, v.tokens, v.rows, t.remaining_steps, v.arrival,
                                            v.deadline), groups[index]))
        states = [pickle.loads(b) for b in all_gather_bytes(world, pickle.dumps((time.time(), mine, samples)))]
        now = states[0][0]
        start = now if start is None else start
        running = tuple(p for _, ps, _ in states for p in ps)
        if options.adapt:
            measured.update([x for _, _, xs in states for x in xs])
        samples = []
        arrived = [i for i in pending if arrivals[i] <= now - start]
        if not running and not pending:
            break
        t1 = time.perf_counter()
        waiting = tuple(request_view(pipe, i, requests[i], arrivals[i], deadlines[i]) for i in arrived)
        plan = plan_round(ClusterState(tuple(world_ranks), running, waiting, now, degrees, dict(measured.scale),
                                       dict(measured.speed), measured.overall), policy, cost, options)
        t2 = time.perf_counter()
        stats["sync_s"] += t1 - t0
        stats["plan_s"] += t2 - t1
        stats["est_s"] += plan.est_round_s
        stats["rounds"] += 1
        if not running and not plan.admit:
            time.sleep(0.01)  # nothing arrived yet
            continue
        for rank, indices in plan.admit.items():
            for index in indices:
                pending.remove(index)
                groups[index] = (rank,)
                if rank == me:
                    held[index] = engine.add_request(requests[index], deadline=deadlines[index])

        # reshard: copies to new members, old members not in the new group drop theirs
        moves, payloads = [], {}
        for index in sorted(plan.groups):
            old, new = groups[index], plan.groups[index]
            for r in new:
                if r not in old:
                    moves.append((old[0], r, index))
                    if old[0] == me:
                        payloads[index] = engine.snapshot(held[index])
        for index, data in send_recv_bytes(moves, payloads).items():
            held[index] = engine.resume(data, deadline=deadlines[index])
            stats["copies_in"] += 1
        for index in [i for i in groups if i not in plan.groups]:
            groups.pop(index)  # finished last round (on its owner)
            history.pop(index, None)
        for index, new in plan.groups.items():
            if me not in new and index in held:
                engine.drop(held.pop(index))
            groups[index] = new
            history.setdefault(index, []).append((new[0], len(new)))

        for n, fwd in enumerate(plan.forwards):
            if me not in fwd.ranks:
                continue
            tids = [held[i] for i in fwd.tids]
            views = [request_view(pipe, i, requests[i], 0.0, None) for i in fwd.tids]
            modelled = cost.step_time(sum(v.rows * v.tokens for v in views), views[0].tokens, len(fwd.ranks))
            began = time.perf_counter()
            if len(fwd.ranks) == 1:
                try:
                    engine.step_trajectories(tids)
                except Exception as exc:  # noqa: BLE001 - those trajectories fail, the job goes on
                    for tid in tids:
                        engine.fail(tid, f"step failed on worker {address}: {type(exc).__name__}: {exc}")
                shard = None
            else:
                # a member that failed here would leave the others waiting in the collective: no
                # guard, the loop's error reaches the driver (run_on_cluster raises it)
                shard = UlyssesShard(Group.of(fwd.ranks, salt=f"{job}:{stats['rounds']}:{n}"))
                engine.step_trajectories(tids, shard)
            samples.append((me, views[0].key, len(fwd.ranks), modelled, time.perf_counter() - began))
            stats["forwards"] += 1
            stats["sp_forwards"] += shard is not None
            stats["max_degree"] = max(stats["max_degree"], len(fwd.ranks))

        index_of = {tid: index for index, tid in held.items()}
        for index, tid in list(held.items()):
            t = engine.trajectory(tid)
            if t.remaining_steps == 0 and groups[index][0] != me:
                engine.drop(held.pop(index))
        for o in engine.collect():
            index = index_of[o.index]
            held.pop(index)
            groups.pop(index, None)
            steps = history.pop(index, []) if o.error is None else []
            moved = len({owner for owner, _ in steps}) > 1
            out.put(ImageResult(index, _png(o.image) if o.error is None else None, o.error, time.time(),
                                address, moved, tuple(d for _, d in steps), o.array if keep_arrays else None))
    return stats
