"""One worker's loop of an elastic job: free-running at degree 1, synchronised only when it pays.

Every worker of the job runs `elastic_loop` (a Dask task pinned to it). Most of the time a loop
runs free, as a single engine would: it admits the requests dealt to it (steal.deal; each once
it has arrived) while it has room, takes one step of its trajectories (one packed forward for
all latent shapes and timesteps where the pipeline packs, else one per shape), decodes and
reports those that finish. No barrier, no exchange with the other workers per step.

A worker left with nothing to run or admit registers on the job's `steal` queue and waits on
its inbox. A busy worker that finds it there (it looks at most every POLL_S) decides (steal.py,
pure):

  - hand over the back half of its list of requests not yet admitted, if it has any;
  - else hand over trajectories: those whose move cuts max(own, thief's) remaining time; they
    are suspended at the step boundary and resumed by the thief, bit-identically;
  - else, if the first round's plan over the two (plan.plan_round) runs some trajectory at degree
    > 1 (the cost model says its steps run faster spread than the busy worker's round alone),
    send the thief a sync offer; both then run lockstep rounds (cluster_sync.py: all-gather of
    their trajectories over a group-free Group of the two, the pure plan every step, Ulysses
    forwards) until the plan puts nothing over more than one worker, and run free again;
  - else nothing: the thief goes back on the queue for the others, and this worker looks again
    only once its own work changes.

A worker that registered keeps reading its inbox at every step boundary (it may have been given
arrivals meanwhile): an offer is answered at once, so the offering worker waits at most a step.
Only unregistered workers pop thieves, and one offer at a time, so no two groups wait on each other.
The loops end when the driver has every result (its `done` queue).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..policy.diffusion_cost import CostModel
from .output import ImageResult, png_bytes
from ..policy.diffusion_plan import ElasticOptions, Measured
from ..policy.diffusion_step import TrajView, pack_forwards, plan_step
from .request import ImageRequest

_RECENT = 32   # forward samples a worker keeps for the cost model's correction
POLL_S = 0.05  # a busy worker looks at the steal queue / its inbox at most this often (each look
               # is a round trip to the scheduler)
IDLE_S = 0.025 # an idle worker's pause between looks at its inbox
DONE_S = 0.1   # ... and between asking whether the job is done


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


@dataclass
class Loop:
    """One worker's part of a job. held: request index -> engine tid (owned trajectories, and in
    a sync phase the copies of spread ones); history: request index -> (owner, degree) per step
    taken; samples: recent forwards (rank, key, degree, modelled s, measured s)."""

    engine: Any
    me: int
    address: str
    job: str
    requests: Sequence[ImageRequest]
    deadlines: Sequence[float | None]
    arrivals: Sequence[float]
    policy: str
    options: ElasticOptions
    cost: CostModel
    degrees: tuple[int, ...]
    keep_arrays: bool
    out: Any
    pending: list[int] = field(default_factory=list)
    start: float = 0.0
    held: dict[int, int] = field(default_factory=dict)
    history: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    samples: list[tuple[int, tuple, int, float, float]] = field(default_factory=list)
    measured: Measured = field(default_factory=Measured)
    stats: dict[str, Any] = field(default_factory=lambda: {
        "steps": 0, "forwards": 0, "sp_forwards": 0, "migrated_in": 0, "migrated_out": 0, "requests_in": 0,
        "requests_out": 0, "offers": 0,
        "sync_phases": 0, "rounds": 0, "copies_in": 0, "max_degree": 1, "plan_s": 0.0, "sync_s": 0.0,
        "est_s": 0.0, "first_sp_at": None, "forward_s": 0.0, "report_s": 0.0, "idle_s": 0.0, "loop_s": 0.0,
        "cpu_s": 0.0})

    def admit(self) -> int:
        """Admit arrived requests of its list, in order, while it has room (a few per step, so
        that admissions' conditioning does not stall running trajectories); -> how many."""
        elapsed = time.time() - self.start
        n = 0
        for index in list(self.pending):
            if len(self.held) >= self.options.max_running or n >= self.options.admit_per_round:
                break
            if self.arrivals[index] <= elapsed:
                self.pending.remove(index)
                self.held[index] = self.engine.add_request(self.requests[index], deadline=self.deadlines[index])
                n += 1
        return n

    def arrived(self) -> bool:
        """A request of its list has arrived and waits."""
        elapsed = time.time() - self.start
        return any(self.arrivals[i] <= elapsed for i in self.pending)

    def view(self, index: int) -> TrajView:
        t = self.engine.trajectory(self.held[index])
        v = request_view(self.engine.pipe, index, t.request, self.arrivals[index], self.deadlines[index])
        return TrajView(index, v.key, v.tokens, v.rows, t.remaining_steps, v.arrival, v.deadline)

    def running(self) -> list[int]:
        """Owned request indices with steps left."""
        out = []
        for index, tid in self.held.items():
            t = self.engine.trajectory(tid)
            if t.remaining_steps > 0 and t.error is None:
                out.append(index)
        return out

    def forward(self, indices: Sequence[int], shard: Any = None, ranks: tuple[int, ...] | None = None) -> int:
        """One forward of these trajectories, timed; degree len(ranks). Without a shard they may
        be of several keys (one packed forward where the pipeline packs). -> how many samples it
        added (one per key, each its modelled share of the forward's time)."""
        ranks = ranks or (self.me,)
        d = len(ranks)
        parts: dict[tuple, list[int]] = {}  # key -> [batch tokens, tokens per image]
        for i in indices:
            v = request_view(self.engine.pipe, i, self.requests[i], 0.0, None)
            part = parts.setdefault(v.key, [0, v.tokens])
            part[0] += v.rows * v.tokens
        own = {key: self.cost.step_time(bt, n, d) for key, (bt, n) in parts.items()}
        modelled = self.cost.pack_time([tuple(p) for p in parts.values()]) if d == 1 else sum(own.values())
        began = time.perf_counter()
        tids = [self.held[i] for i in indices]
        if shard is None:
            try:
                self.engine.step_trajectories(tids)
            except Exception as exc:  # noqa: BLE001 - those trajectories fail, the job goes on
                for tid in tids:
                    self.engine.fail(tid, f"step failed on worker {self.address}: {type(exc).__name__}: {exc}")
        else:
            # a member that failed here would leave the others waiting in the collective: no
            # guard, the loop's error reaches the driver (run_on_cluster raises it)
            self.engine.step_trajectories(tids, shard)
            if self.stats["first_sp_at"] is None:
                self.stats["first_sp_at"] = time.time()
        took = time.perf_counter() - began
        self.stats["forward_s"] += took
        whole = sum(own.values())
        for key, t in own.items():
            share = t / whole if whole > 0 else 1 / len(own)  # a cost model of all zeros: even shares
            self.samples.append((self.me, key, d, modelled * share, took * share))
        del self.samples[:-_RECENT]
        self.stats["forwards"] += 1
        self.stats["sp_forwards"] += shard is not None
        self.stats["max_degree"] = max(self.stats["max_degree"], d)
        return len(own)

    def step_free(self) -> None:
        """One step of every owned running trajectory at degree 1: its plan_step groups (one
        per key), packed into one forward where the cost model packs (policy.pack_forwards)."""
        running = self.running()
        views = {v.tid: v for v in (self.view(i) for i in running)}
        e = self.engine
        groups = plan_step(list(views.values()), self.policy, time.time(), self.cost, e.max_batch_rows,
                           e.max_batch_tokens)
        added = 0
        for pack in pack_forwards([[views[i] for i in g] for g in groups], self.cost):
            added += self.forward([i for k in pack for i in groups[k]])
        for group in groups:
            for i in group:
                self.history.setdefault(i, []).append((self.me, 1))
        self.stats["steps"] += 1
        if self.options.adapt and added:
            self.measured.update(self.samples[-added:])

    def report(self) -> None:
        """Decode the owned trajectories that are done (and admissions that failed) -> the out queue."""

        began = time.perf_counter()
        index_of = {tid: index for index, tid in self.held.items()}
        results = []
        for o in self.engine.collect():
            index = index_of[o.index]
            self.held.pop(index)
            steps = self.history.pop(index, [])
            if o.error is not None:
                steps = []
            moved = len({owner for owner, _ in steps}) > 1
            results.append(ImageResult(index, png_bytes(o.image) if o.error is None else None, o.error, time.time(),
                                       self.address, moved, tuple(d for _, d in steps),
                                       o.array if self.keep_arrays else None))
        if results:
            self.out.put(results)  # one round trip for all that finished together
        self.stats["report_s"] += time.perf_counter() - began

    def scale(self) -> tuple[dict[tuple, float], float]:
        return (dict(self.measured.scale), self.measured.overall) if self.options.adapt else ({}, 1.0)


def elastic_loop(model: str, job: str, me: int, world: bool, mine: Sequence[int], requests: Sequence[ImageRequest],
                 deadlines: Sequence[float | None], arrivals: Sequence[float], start: float, policy: str,
                 options: ElasticOptions, cost: CostModel, engine_options: dict, keep_arrays: bool,
                 workers: int) -> dict[str, Any]:
    """One worker's part of a job (see the module docstring); me: its rank (the gloo world's
    when `world`, else its place among the job's workers); mine: the request indices dealt to
    it, in the order to admit them; start: the driver's time.time() at the start (arrivals
    count from it); -> its statistics."""
    from distributed import Queue, get_worker, secede

    from .engine_spec import process_engine
    from ..policy.diffusion_steal import handover, spread_plan

    secede()
    # the loop plans its own steps (plan_step with this job's policy and cost): the worker's
    # engine for these options serves every job, warm after the first
    engine = process_engine(model, engine_options)
    degrees = allowed_degrees(engine.pipe, workers) if world else (1,)
    if options.max_degree is not None:
        degrees = tuple(d for d in degrees if d <= options.max_degree)
    w = Loop(engine, me, get_worker().address, job, requests, deadlines, arrivals, policy, options, cost, degrees,
             keep_arrays, Queue(f"bg-diff-out-{job}"), pending=list(mine), start=start)
    done, steal, inbox = Queue(f"bg-diff-done-{job}"), Queue(f"bg-diff-steal-{job}"), Queue(f"bg-diff-inbox-{job}-{me}")
    asked = False              # registered on `steal`, not yet answered
    declined: tuple | None = None  # (owned set, queued count) at which no thief could be helped
    looked = 0.0               # when this worker last looked at a queue (at most every POLL_S while busy)
    began, cpu = time.perf_counter(), time.process_time()
    checked = 0.0              # when an idle worker last asked whether the job is done
    while True:
        admitted = w.admit()
        if admitted:
            w.report()  # requests that fail at admission
        now = time.time()
        if asked and (not w.held or now - looked >= POLL_S):
            looked = now
            msgs = inbox.get(batch=True)  # one round trip, nothing waits in the scheduler
            if not msgs and not w.held:
                time.sleep(IDLE_S)
                w.stats["idle_s"] += IDLE_S
            for msg in msgs:
                asked = False
                declined = None
                if msg[0] == "sync":
                    from .cluster_sync import sync_phase

                    sync_phase(w, msg[1], msg[2])
                elif msg[0] == "reqs":
                    w.pending += list(msg[1])
                    w.stats["requests_in"] += len(msg[1])
                else:
                    _, index, history, data = msg
                    w.held[index] = engine.resume(data, deadline=deadlines[index])
                    w.history[index] = [tuple(h) for h in history]  # the Queue may make lists tuples
                    w.stats["migrated_in"] += 1
            if msgs:
                continue
        if not w.running():
            w.report()
            if w.pending:
                time.sleep(0.005)  # its next request has not arrived yet
                continue
            if not asked and not w.held:
                steal.put(me)
                asked = True
            if time.time() - checked >= DONE_S:
                checked = time.time()
                if done.qsize() > 0:
                    w.stats["loop_s"] = time.perf_counter() - began
                    w.stats["cpu_s"] = time.process_time() - cpu  # the whole worker process's
                    return w.stats
            continue
        w.step_free()
        w.report()
        owned = frozenset(w.held), len(w.pending)
        now = time.time()
        if asked or owned == declined or now - looked < POLL_S:
            continue
        looked = now
        thief = _queue_get(steal)
        if thief is None or thief == me:  # (never itself: only unregistered workers pop)
            continue
        box = Queue(f"bg-diff-inbox-{job}-{thief}")
        if len(w.pending) > 1 or w.pending and w.held:
            give = w.pending[len(w.pending) // 2:]  # the end of its list: what it would run last
            del w.pending[len(w.pending) // 2:]
            box.put(("reqs", give))
            w.stats["requests_out"] += len(give)
            continue
        views = [w.view(i) for i in w.running()]
        scale, overall = w.scale()
        give = handover(views, cost, options.switch_gain, scale, overall, options.max_running)
        if give:
            for index in give:
                data = engine.suspend(w.held.pop(index))
                box.put(("traj", index, w.history.pop(index, []), data))
                w.stats["migrated_out"] += 1
            continue
        if spread_plan(me, thief, views, now, degrees, policy, cost, options, scale, overall) is not None:
            from .cluster_sync import sync_phase

            members = tuple(sorted((me, thief)))
            salt = f"{job}:sync:{me}:{w.stats['offers']}"
            w.stats["offers"] += 1
            box.put(("sync", members, salt))
            sync_phase(w, members, salt)
            declined = None
            continue
        steal.put(thief)  # for another worker; this one looks again when its work changes
        declined = owned


def _queue_get(queue: Any) -> Any:
    """An item, or None when the queue is empty. qsize first: a get that times out is logged by
    the scheduler as an error."""
    if queue.qsize() == 0:
        return None
    try:
        return queue.get(timeout=1.0)  # another worker may have taken it meanwhile
    except Exception:  # noqa: BLE001 - distributed's timeout
        return None
