"""One worker's part of an elastic image job: free-running at degree 1, synchronised only when it pays.

Every worker of the job runs `elastic_loop` on its image engine (the runtime's engine for that
spec, as one command on its runner thread: on_worker.py), and the parts talk through the
workers' mailboxes (cluster/mailbox.py: worker-to-worker messages, read locally, nothing through
the scheduler). Most of the time a loop runs free, as a single engine would: it admits the
requests dealt to it (policy.diffusion_steal.deal; each once it has arrived) while it has room,
takes one step of its trajectories (one packed forward for all latent shapes and timesteps
where the pipeline packs, else one per shape), decodes those that finish and tells the other
parts how many finished. No barrier, no exchange with the other workers per step.

A worker left with nothing to run or admit asks one other part for work and waits for its
answer (then the next part, and after a whole turn of refusals it pauses POLL_S). A busy part
reads its mailbox at every step boundary and answers an ask (policy.diffusion_steal, pure):

  - hand over the back half of its list of requests not yet admitted, if it has any;
  - else hand over trajectories: those whose move cuts max(own, thief's) remaining time; they
    are suspended at the step boundary and resumed by the thief, bit-identically;
  - else, if the first round's plan over the two (plan_round) runs some trajectory at degree
    > 1 (the cost model says its steps run faster spread than the busy worker's round alone),
    answer with a sync offer; both then run lockstep rounds (elastic_sync.py: all-gather of
    their trajectories over a group-free Group of the two, the pure plan every step, Ulysses
    forwards) until the plan puts nothing over more than one worker, and run free again;
  - else no: and until its own work changes it answers every ask no without planning.

A thief has one ask out at a time and only the part it asked answers it, so an idle worker is
offered to one busy worker at a time and no two groups wait on each other. A part ends when
every request of the job has finished somewhere (the counts the parts send each other); it
returns its statistics and its results.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...policy.diffusion_cost import CostModel
from ...policy.diffusion_plan import ElasticOptions, Measured
from ...policy.diffusion_step import TrajView, pack_forwards, plan_step
from ..engine.output import ImageResult, png_bytes
from ..engine.request import ImageRequest

_RECENT = 32   # forward samples a worker keeps for the cost model's correction
POLL_S = 0.05  # a thief that every other part refused waits this long before asking again
IDLE_S = 0.025 # an idle part's longest wait for a message (then it looks at its arrivals again)


def box_name(job: str, rank: int) -> str:
    """The mailbox of rank `rank`'s part of `job`."""
    return f"batchgen-diffusion:{job}:{rank}"


@dataclass(frozen=True)
class Post:
    """A part's messages: to another rank's box on its worker, and from its own box."""

    side: Any  # this worker's cluster.worker.WorkerSide
    job: str
    me: int
    addresses: tuple[str, ...]  # worker address by rank

    def send(self, rank: int, msg: tuple) -> None:
        self.side.send_mail(self.addresses[rank], box_name(self.job, rank), msg)

    def to_others(self, msg: tuple) -> None:
        for rank in range(len(self.addresses)):
            if rank != self.me:
                self.send(rank, msg)

    def take(self, timeout: float = 0.0) -> tuple | None:
        return self.side.mailboxes.take(box_name(self.job, self.me), timeout)

    def take_all(self) -> list[tuple]:
        return self.side.mailboxes.take_all(box_name(self.job, self.me))


def request_view(pipe: Any, index: int, req: ImageRequest, arrival: float, deadline: float | None) -> TrajView:
    """The policy's view of a request not yet admitted (as the engine will see it)."""
    h, w = req.height or pipe.native_hw[0], req.width or pipe.native_hw[1]
    f = pipe.vae_scale_factor
    frames = (req.num_frames or pipe.default_frames) if pipe.is_video else None
    depth = (pipe.latent_frames(frames),) if pipe.is_video else ()  # a video's latents: [C, F', h, w]
    key = ((pipe.latent_channels, *depth, h // f, w // f),)
    tokens = pipe.tokens(h, w, frames)
    rows = 2 if pipe.cfg_scale(req.guidance_scale) > 1 else 1
    return TrajView(index, key, tokens, rows, req.num_inference_steps, arrival, deadline)


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
    post: Post
    pending: list[int] = field(default_factory=list)
    start: float = 0.0
    held: dict[int, int] = field(default_factory=dict)
    history: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    samples: list[tuple[int, tuple, int, float, float]] = field(default_factory=list)
    measured: Measured = field(default_factory=Measured)
    results: list[ImageResult] = field(default_factory=list)
    finished_elsewhere: int = 0  # requests of the job the other parts finished (their counts)
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
        """Decode the owned trajectories that are done (and admissions that failed) into
        results, and tell the other parts how many finished."""
        began = time.perf_counter()
        index_of = {tid: index for index, tid in self.held.items()}
        results = []
        for o in self.engine.collect(only=index_of):
            index = index_of[o.index]
            self.held.pop(index)
            steps = self.history.pop(index, [])
            if o.error is not None:
                steps = []
            moved = len({owner for owner, _ in steps}) > 1
            png = png_bytes(o.image) if o.image is not None else None
            frames = [png_bytes(f) for f in o.frames] if o.frames is not None else None
            results.append(ImageResult(index, png, o.error, time.time(), self.address, moved,
                                       tuple(d for _, d in steps), o.array if self.keep_arrays else None, frames))
        if results:
            self.results += results
            self.post.to_others(("done", len(results)))
        self.stats["report_s"] += time.perf_counter() - began

    def job_done(self) -> bool:
        """Every request of the job has its result, here or on another part."""
        return len(self.results) + self.finished_elsewhere >= len(self.requests) and not self.held

    def scale(self) -> tuple[dict[tuple, float], float]:
        return (dict(self.measured.scale), self.measured.overall) if self.options.adapt else ({}, 1.0)


def elastic_loop(engine: Any, post: Post, world: bool, mine: Sequence[int], requests: Sequence[ImageRequest],
                 deadlines: Sequence[float | None], arrivals: Sequence[float], start: float, policy: str,
                 options: ElasticOptions, cost: CostModel, keep_arrays: bool) -> tuple[dict[str, Any], list[ImageResult]]:
    """One part of a job (see the module docstring), on the engine's thread; post: its rank
    (the gloo world's when `world`, else its place among the job's workers) and mailboxes;
    mine: the request indices dealt to it, in the order to admit them; start: the driver's
    time.time() at the start (arrivals count from it); -> its statistics and results."""
    me = post.me
    workers = len(post.addresses)
    degrees = allowed_degrees(engine.pipe, workers) if world else (1,)
    if options.max_degree is not None:
        degrees = tuple(d for d in degrees if d <= options.max_degree)
    w = Loop(engine, me, post.addresses[me], post.job, requests, deadlines, arrivals, policy, options, cost, degrees,
             keep_arrays, post, pending=list(mine), start=start)
    part = _Part(w)
    began, cpu = time.perf_counter(), time.process_time()
    while True:
        if w.admit():
            w.report()  # requests that fail at admission
        for msg in post.take_all():
            part.handle(msg)
        if w.running():
            w.step_free()
            w.report()
            part.answer_thieves()
            continue
        w.report()
        part.refuse_thieves()  # nothing to give
        if w.job_done():
            w.stats["loop_s"] = time.perf_counter() - began
            w.stats["cpu_s"] = time.process_time() - cpu  # the whole worker process's
            return w.stats, w.results
        if w.pending:
            time.sleep(0.005)  # its next request has not arrived yet
            continue
        if w.held:
            continue
        part.ask_for_work()
        msg = post.take(timeout=IDLE_S)
        if msg is not None:
            part.handle(msg)
        else:
            w.stats["idle_s"] += IDLE_S


class _Part:
    """A loop's side of the work-sharing protocol (the module docstring): its one ask out, the
    asks waiting for its answer, and the work state at which it last had nothing to give."""

    def __init__(self, w: Loop) -> None:
        self.w = w
        others = [r for r in range(len(w.post.addresses)) if r != w.me]
        self.order = others[w.me % len(others):] + others[:w.me % len(others)] if others else []
        self.next = 0
        self.asking: int | None = None   # the rank asked for work, not yet answered
        self.refused = 0                 # refusals since this part last got work
        self.thieves: list[int] = []     # ranks whose asks wait for an answer
        self.declined: tuple | None = None  # (owned set, queued count) at which it had nothing to give

    def handle(self, msg: tuple) -> None:
        w, kind = self.w, msg[0]
        if kind == "done":
            w.finished_elsewhere += int(msg[1])
        elif kind == "ask":
            self.thieves.append(int(msg[1]))
        elif kind == "none":
            self.asking = None
            self.refused += 1
        elif kind == "abort":
            raise RuntimeError(f"the job was aborted: {msg[1]}")
        else:  # work, the answer to this part's ask
            self.asking, self.refused = None, 0
            self.declined = None
            if kind == "reqs":
                w.pending += [int(i) for i in msg[1]]
                w.stats["requests_in"] += len(msg[1])
            elif kind == "trajs":
                for index, history, data in msg[1]:
                    w.held[int(index)] = w.engine.resume(bytes(data), deadline=w.deadlines[int(index)])
                    w.history[int(index)] = [tuple(h) for h in history]  # messages make tuples lists
                    w.stats["migrated_in"] += 1
            elif kind == "sync":
                from .elastic_sync import sync_phase

                sync_phase(w, tuple(int(r) for r in msg[1]), str(msg[2]))
            else:
                raise ValueError(f"unknown message {kind!r} in an elastic image job")

    def ask_for_work(self) -> None:
        """One ask out at a time, to the next part in turn; after a whole turn of refusals, a
        pause first."""
        if self.asking is not None or not self.order:
            return
        if self.refused >= len(self.order):
            time.sleep(POLL_S)
            self.w.stats["idle_s"] += POLL_S
            self.refused = 0
        self.asking = self.order[self.next % len(self.order)]
        self.next += 1
        self.w.post.send(self.asking, ("ask", self.w.me))

    def refuse_thieves(self) -> None:
        for thief in self.thieves:
            self.w.post.send(thief, ("none",))
        self.thieves.clear()

    def answer_thieves(self) -> None:
        """Help the first thief waiting (one offer at a time); the others hear no and ask again."""
        if not self.thieves:
            return
        thief = self.thieves.pop(0)
        self.refuse_thieves()
        self.answer(thief)

    def answer(self, thief: int) -> None:
        from ...policy.diffusion_steal import handover, spread_plan

        w = self.w
        owned = frozenset(w.held), len(w.pending)
        if owned == self.declined:
            w.post.send(thief, ("none",))
            return
        if len(w.pending) > 1 or w.pending and w.held:
            give = w.pending[len(w.pending) // 2:]  # the end of its list: what it would run last
            del w.pending[len(w.pending) // 2:]
            w.post.send(thief, ("reqs", give))
            w.stats["requests_out"] += len(give)
            return
        views = [w.view(i) for i in w.running()]
        scale, overall = w.scale()
        give = handover(views, w.cost, w.options.switch_gain, scale, overall, w.options.max_running)
        if give:
            moved = []
            for index in give:
                moved.append((index, w.history.pop(index, []), w.engine.suspend(w.held.pop(index))))
                w.stats["migrated_out"] += 1
            w.post.send(thief, ("trajs", moved))
            return
        if spread_plan(w.me, thief, views, time.time(), w.degrees, w.policy, w.cost, w.options, scale,
                       overall) is not None:
            from .elastic_sync import sync_phase

            members = tuple(sorted((w.me, thief)))
            salt = f"{w.job}:sync:{w.me}:{w.stats['offers']}"
            w.stats["offers"] += 1
            w.post.send(thief, ("sync", members, salt))
            sync_phase(w, members, salt)
            self.declined = None
            return
        w.post.send(thief, ("none",))
        self.declined = owned
