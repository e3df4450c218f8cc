"""Lockstep rounds among a few workers of a job, for as long as spreading a trajectory pays.

Entered by two workers at once (elastic_loop.py: a busy worker whose pure plan spreads a
trajectory over it and an idle one, and that idle one on the offer). A round is:

  1. state: the members all-gather, over a Group of just them (group-free collectives: no
     communicator is made; the other workers of the job run on undisturbed), the trajectories
     each owns (policy views and current group), its clock and its recent forward times; in the
     first round also each trajectory's step history;
  2. plan: each runs plan.plan_round (pure) on that same state -> the same RoundPlan everywhere:
     each trajectory's group (ranks) and degree, the round's forwards. Every member corrects the
     cost model by the same gathered forward times (a Measured of the phase), so plans agree;
  3. reshard: a trajectory whose group gains members is copied to them (point-to-point, the
     owner's snapshot); members that leave it drop their copy. Every member holds the whole
     latents and the Ulysses forward takes its token shard, so a degree change moves state only
     to new members;
  4. run: each member takes its degree-1 forwards (packed into one where the cost model packs),
     then the sequence-parallel ones it is a member of, in the plan's order (every member
     applies the same scheduler step to the all-gathered model output, so the copies stay
     identical);
  5. finish: the owner of a trajectory that took its last step decodes it and reports it; the
     other members drop their copies.

The phase ends at the round whose plan runs nothing over more than one worker (its degree-1
moves are still made: a migration), or when a member has an arrived request waiting in its list
(every trajectory returns to its owner, which admits it running free).
"""
from __future__ import annotations

import pickle
import time
from typing import Any

from ...policy.diffusion_plan import ClusterState, Measured, Placed, plan_round
from ...policy.diffusion_step import pack_forwards, split_forward


def sync_phase(w: Any, members: tuple[int, ...], salt: str) -> None:
    """Run rounds among `members` (w: this worker's elastic_loop.Loop) until the phase ends."""
    from ..parallel.groups import Group, all_gather_bytes, send_recv_bytes
    from ..parallel.sp import UlyssesShard

    engine, me, options = w.engine, w.me, w.options
    group = Group.of(members, salt=salt)
    measured = Measured()
    groups: dict[int, tuple[int, ...]] = {}  # request index -> ranks, as of the last plan
    fresh = -1                                # this member's forward samples last round (-1: first round)
    w.stats["sync_phases"] += 1
    while True:
        t0 = time.perf_counter()
        mine = [Placed(w.view(i), groups.get(i, (me,))) for i in w.running() if groups.get(i, (me,))[0] == me]
        histories = {p.view.tid: w.history.get(p.view.tid, []) for p in mine} if fresh < 0 else {}
        queued = w.arrived()
        samples = w.samples if fresh < 0 else w.samples[max(0, len(w.samples) - fresh):]
        states = [pickle.loads(b) for b in all_gather_bytes(group, pickle.dumps(
            (time.time(), mine, samples, histories, queued)))]
        now = states[0][0]
        running = tuple(p for _, ps, _, _, _ in states for p in ps)
        if options.adapt:
            measured.update([x for _, _, xs, _, _ in states for x in xs])
        for _, _, _, hs, _ in states:
            w.history.update({i: list(h) for i, h in hs.items()})
        live = {p.view.tid for p in running}
        for index in [i for i in groups if i not in live]:
            groups.pop(index)  # finished last round (on its owner)
            if index not in w.held:
                w.history.pop(index, None)
        for p in running:
            groups[p.view.tid] = p.group
        if not running:
            return
        t1 = time.perf_counter()
        adapt = options.adapt
        state = ClusterState(tuple(members), running, (), now, w.degrees, dict(measured.scale) if adapt else {},
                             dict(measured.speed) if adapt else {}, measured.overall if adapt else 1.0)
        plan = plan_round(state, w.policy, w.cost, options)
        t2 = time.perf_counter()
        w.stats["sync_s"] += t1 - t0
        w.stats["plan_s"] += t2 - t1
        w.stats["rounds"] += 1
        if any(q for *_, q in states):
            target, leave = {i: g[:1] for i, g in groups.items()}, True
        else:
            target, leave = plan.groups, not any(len(g) > 1 for g in plan.groups.values())

        # reshard: copies to new members, old members not in the new group drop theirs
        moves, payloads = [], {}
        for index in sorted(target):
            old, new = groups[index], target[index]
            for r in new:
                if r not in old:
                    moves.append((old[0], r, index))
                    if old[0] == me:
                        payloads[index] = engine.snapshot(w.held[index])
        for index, data in send_recv_bytes(moves, payloads).items():
            w.held[index] = engine.resume(data, deadline=w.deadlines[index])
            w.stats["copies_in"] += 1
        for index, new in target.items():
            if me not in new and index in w.held:
                engine.drop(w.held.pop(index))
            groups[index] = new
        if leave:  # each trajectory on its one owner, running free from here
            for index, g in target.items():
                if g[0] != me:
                    w.history.pop(index, None)
            return
        w.stats["est_s"] += plan.est_round_s

        # this member's degree-1 forwards, packed (they come first in the plan), then the
        # sequence-parallel ones it is in, in the plan's order
        views = {i: w.view(i) for fwd in plan.forwards if fwd.ranks == (me,) for i in fwd.tids}
        solo = [part for fwd in plan.forwards if fwd.ranks == (me,)
                for part in split_forward([views[i] for i in fwd.tids], w.cost)]
        fresh = 0
        for pack in pack_forwards([[views[i] for i in part] for part in solo], w.cost):
            fresh += w.forward([i for k in pack for i in solo[k]])
        for n, fwd in enumerate(plan.forwards):
            if me in fwd.ranks and len(fwd.ranks) > 1:
                shard = UlyssesShard(Group.of(fwd.ranks, salt=f"{salt}:{w.stats['rounds']}:{n}"))
                fresh += w.forward(list(fwd.tids), shard, fwd.ranks)
        for index, g in target.items():
            w.history.setdefault(index, []).append((g[0], len(g)))
        for index, tid in list(w.held.items()):
            if engine.trajectory(tid).remaining_steps == 0 and groups[index][0] != me:
                engine.drop(w.held.pop(index))  # its owner decodes it
        w.report()
