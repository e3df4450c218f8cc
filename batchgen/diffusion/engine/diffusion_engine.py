"""DiffusionEngine: trajectories as coroutines on one device, combined step by step.

    engine = DiffusionEngine("path/to/pipeline")
    images = engine.generate([ImageRequest(prompt="a red fox", height=256, width=256, seed=1)])

Each `step()` admits waiting requests (conditioning computed once, batched), asks the policy
which trajectories run and in which groups (a group per latent shape, at mixed timesteps; the
groups run as one token-packed forward, packed.py, where the pipeline's blocks allow), advances
them one denoising step, and decodes the finished ones in one batched VAE call per shape.
"""
from __future__ import annotations

import os
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ...engine.protocol import LoadReport
from ...errors import RequestError, StateError
from ...malloc import restore_heap_reuse as _restore_heap_reuse
from ...policy.diffusion_cost import CostModel
from ...policy.diffusion_step import TrajView, check_policy, pack_forwards, plan_step
from ..models import schedulers
from ..models.condition import encode_prompts
from ..models.decode import decode, to_pil
from ..models.pipeline import load_pipeline
from .admission import IMAGE_TOKENS_OVER_NATIVE, request_error
from .denoise import Live, new_scheduler, resumed, start, step_group, step_groups
from .encoding import encode_conditions
from .output import ImageOutput
from .request import ImageRequest
from .trajectory import Status, Trajectory, from_bytes, to_bytes

if TYPE_CHECKING:
    from ..parallel.sp import UlyssesShard


class DiffusionEngine:
    def __init__(self, model: str | os.PathLike, *, dtype: str = "float32", device: str | None = None,
                 policy: str = "fcfs", max_batch_rows: int = 64, max_batch_tokens: int | None = None,
                 max_sequence_length: int | None = None, cost: CostModel | None = None,
                 max_image_tokens: int | None = None, restore_heap_reuse: bool = True) -> None:
        """Load the pipeline at `model` (ModelLoadError / UnsupportedModelError name what is wrong).
        policy: "fcfs" | "srwf" | "deadline"; max_batch_rows / max_batch_tokens: the most rows
        (CFG rows count twice) / image tokens in one step's forwards; max_image_tokens: the most
        image tokens one request may have (default: IMAGE_TOKENS_OVER_NATIVE x the model's native
        size, e.g. 1024 x 1024 px for a 256 px DiT); a larger request fails alone.
        restore_heap_reuse: raise glibc's malloc thresholds for this process, which also undoes
        Dask's MALLOC_TRIM_THRESHOLD_ (batchgen/malloc.py; measured: a worker's denoising loop ran
        1.4-1.7x slower without, its activations faulting in fresh pages every forward)."""
        for name, value in (("max_batch_rows", max_batch_rows), ("max_batch_tokens", max_batch_tokens),
                            ("max_image_tokens", max_image_tokens)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if restore_heap_reuse:
            _restore_heap_reuse()  # process-wide, once
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.pipe = load_pipeline(model, dtype=dtype, device=self.device, max_sequence_length=max_sequence_length)
        self.model_key = str(self.pipe.path.resolve())
        self.policy = check_policy(policy)
        self.max_batch_rows, self.max_batch_tokens = max_batch_rows, max_batch_tokens
        self.max_image_tokens = max_image_tokens or IMAGE_TOKENS_OVER_NATIVE * self.pipe.native_tokens
        self.cost = (cost or CostModel()).packing(self.pipe.packs)
        self._trajs: dict[int, Trajectory] = {}
        self._live: dict[int, Live] = {}
        self._meta: dict[int, tuple[float, float | None]] = {}  # tid -> (arrival, deadline)
        self._done: list[ImageOutput] = []
        self._others: list[ImageOutput] = []  # finished during a stream() but added before it: for collect()
        self._next_tid = 0
        self._uncond: dict[str, torch.Tensor] | None = None
        self.num_forwards = 0
        self.num_steps_taken = 0
        self.work_units = 0  # image tokens x guidance rows, summed over every step taken
        self._finished: dict[int, ImageOutput] = {}  # run_step's outputs until popped

    # ---- requests -------------------------------------------------------------------------
    def check(self, req: ImageRequest) -> str | None:
        """What makes `req` impossible on this model, or None."""
        return request_error(self.pipe, req, self.max_image_tokens)

    def add_request(self, req: ImageRequest, params: None = None, index: int = 0, *, deadline: float | None = None,
                    arrival: float | None = None) -> int:
        """Queue `req`; -> its id. A bad request finishes at the next step with its error.
        params, index: the CoroutineEngine signature (an image request carries its own
        parameters; outputs carry the id, which stream() maps to input positions)."""
        if params is not None:
            raise TypeError("an ImageRequest carries its own parameters: params must be None")
        tid = self._next_tid
        self._next_tid += 1
        (nh, nw), pipe = self.pipe.native_hw, self.pipe
        h, w = req.height or nh, req.width or nw
        err = self.check(req)
        cfg = pipe.cfg_scale(req.guidance_scale) if err is None else 1.0
        frames = (req.num_frames or pipe.default_frames) if pipe.is_video else None
        traj = Trajectory(tid=tid, request=req, height=h, width=w, num_frames=frames, model_key=self.model_key,
                          cfg_scale=cfg)
        if err:
            traj.error = err
            traj.move(Status.FAILED, "rejected at admission")
        self._trajs[tid] = traj
        self._meta[tid] = (time.time() if arrival is None else arrival, deadline)
        return tid

    def has_unfinished(self) -> bool:
        return bool(self._trajs)

    @property
    def num_running(self) -> int:
        return sum(t.status is Status.RUNNING for t in self._trajs.values())

    # ---- coroutine API --------------------------------------------------------------------
    def step(self, now: float | None = None) -> list[ImageOutput]:
        """Admit, take one denoising step for the planned trajectories (one packed forward for
        all their latent shapes when the pipeline packs, within the cost model's
        max_batch_tokens), decode the finished; -> the outputs finished in this step."""
        self._admit()
        running = [t for t in self._trajs.values() if t.status is Status.RUNNING]
        if running:
            views = {t.tid: self._view(t) for t in running}
            now = time.time() if now is None else now
            groups = plan_step(list(views.values()), self.policy, now, self.cost, self.max_batch_rows,
                               self.max_batch_tokens)
            for pack in pack_forwards([[views[tid] for tid in g] for g in groups], self.cost):
                self._forward_contained([[self._trajs[tid] for tid in groups[i]] for i in pack])
        return self.collect()

    def _forward_contained(self, groups: list[list[Trajectory]]) -> None:
        """_forward, where one that raises (out of memory for one huge image, ...) fails only the
        trajectories that cannot step: a failed pack is retried one group at a time, a failed
        group one trajectory at a time."""
        before = {t.tid: t.step for g in groups for t in g}
        try:
            self._forward(groups)
            return
        except Exception as exc:  # noqa: BLE001 - the request fails, the job goes on
            if len(groups) == 1 and len(groups[0]) == 1:
                t = groups[0][0]
                self.fail(t.tid, f"denoising step {before[t.tid]} failed: {type(exc).__name__}: {exc}")
                return
        parts = groups if len(groups) > 1 else [[t] for t in groups[0]]
        for part in parts:
            left = []
            for t in part:
                if t.step != before[t.tid]:  # stepped before the failure
                    if t.remaining_steps == 0:
                        t.move(Status.DENOISED, f"step {t.step} of {t.num_steps}")
                else:
                    left.append(t)
            if left:
                self._forward_contained([left])

    def suspend(self, tid: int, with_kv: bool | None = None) -> bytes:
        """Take a trajectory out at its step boundary -> bytes that `resume` (here or on another
        engine of the same model) continues from, bit-identically on CPU fp32. with_kv: the
        CoroutineEngine signature (a trajectory has no KV cache: its latents always travel)."""
        data = self.snapshot(tid, "suspended")
        self.drop(tid)
        return data

    def snapshot(self, tid: int, why: str = "copied") -> bytes:
        """A trajectory's state as `suspend` gives it, the trajectory staying here (a copy for
        the other members of a sequence-parallel group)."""
        self._admit()
        traj = self._trajs[tid]
        live = self._live.get(tid)
        if live is not None and traj.status is Status.DENOISED:
            traj.latents = traj.latents.cpu()
        elif live is not None:
            fresh = new_scheduler(self.pipe, traj, "cpu")
            traj.scheduler_state = schedulers.read_state(live.scheduler, fresh)
            traj.rng_state = live.generator.get_state()
            traj.latents = traj.latents.cpu()
            traj.cond = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in traj.cond.items()}
        traj.reasons.append(f"{why} at step {traj.step}")
        data = to_bytes(traj)
        if live is not None and self.device != "cpu":
            traj.latents = traj.latents.to(self.device)
            traj.cond = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in traj.cond.items()}
        return data

    def drop(self, tid: int) -> None:
        """Forget a trajectory without an output (it lives on elsewhere)."""
        self._trajs.pop(tid)
        self._meta.pop(tid, None)
        self._live.pop(tid, None)

    def resume(self, data: bytes, *, deadline: float | None = None, arrival: float | None = None) -> int:
        """Continue a suspended trajectory here; -> its new id on this engine."""
        traj = from_bytes(data, self.model_key)
        length = traj.cond["embeds"].shape[0] if "embeds" in traj.cond else None
        if length is not None and length != self.pipe.text_length:
            raise StateError(f"trajectory's prompt is padded to {length} tokens, this engine's prompts "
                             f"to {self.pipe.text_length} (max_sequence_length {self.pipe.max_sequence_length})")
        tid = self._next_tid
        self._next_tid += 1
        traj.tid = tid
        if traj.status is Status.DENOISED:
            traj.latents = traj.latents.to(self.device)
        if traj.status is Status.RUNNING:
            traj.latents = traj.latents.to(self.device)
            traj.cond = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in traj.cond.items()}
            self._live[tid] = resumed(self.pipe, traj, self.device)
            self._ensure_uncond()
        traj.reasons.append(f"resumed at step {traj.step}")
        self._trajs[tid] = traj
        self._meta[tid] = (time.time() if arrival is None else arrival, deadline)
        return tid

    def trajectory(self, tid: int) -> Trajectory:
        return self._trajs[tid]

    def step_trajectory(self, tid: int, sp: UlyssesShard | None = None) -> None:
        """One denoising step of one running trajectory, optionally sequence-parallel (every
        member of sp's group calls this for the same trajectory state)."""
        self._admit()
        t = self._trajs[tid]
        if t.status is not Status.RUNNING:
            raise ValueError(f"trajectory {tid} is {t.status.value}, not running")
        self.step_trajectories([tid], sp)

    def step_trajectories(self, tids: Sequence[int], sp: UlyssesShard | None = None) -> None:
        """One step of these trajectories in one forward, sequence-parallel over sp's group when
        given (then all of one group_key); without sp, trajectories of several latent shapes run
        as one packed forward (one per shape where the pipeline does not pack); those not
        running (failed at admission) are skipped."""
        self._admit()
        trajs = [self._trajs[tid] for tid in tids if self._trajs[tid].status is Status.RUNNING]
        if not trajs:
            return
        by_key: dict[tuple, list[Trajectory]] = {}
        for t in trajs:
            by_key.setdefault(t.group_key, []).append(t)
        if sp is not None and len(by_key) > 1:
            raise ValueError(f"a sequence-parallel forward runs one latent shape, got {sorted(by_key)}")
        self._forward(list(by_key.values()), sp)

    def _forward(self, groups: list[list[Trajectory]], sp: UlyssesShard | None = None) -> None:
        """One forward of running trajectories, a group per group_key (several only without sp:
        packed); those done move to DENOISED."""
        if sp is not None:
            trajs = groups[0]
            step_group(self.pipe, trajs, [self._live[t.tid] for t in trajs], self._uncond, sp)
        else:
            step_groups(self.pipe, [(g, [self._live[t.tid] for t in g]) for g in groups], self._uncond)
        self.num_forwards += 1 if self.pipe.packs or sp is not None else len(groups)
        for g in groups:
            self.num_steps_taken += len(g)
            for t in g:
                self.work_units += self._step_work(t)
                if t.remaining_steps == 0:
                    t.move(Status.DENOISED, f"step {t.step} of {t.num_steps}")

    def fail(self, tid: int, error: str) -> None:
        """End a trajectory with `error` (its output comes at the next collect or step)."""
        t = self._trajs[tid]
        t.error = error
        t.move(Status.FAILED, error)

    def collect(self, only: Collection[int] | None = None) -> list[ImageOutput]:
        """Decode the trajectories that have taken all their steps (batched per shape) -> the
        outputs finished since the last step or collect, failed admissions included.
        only: just these trajectory ids (a caller driving its own trajectories on an engine that
        also serves others: theirs stay for their own caller)."""
        self._decode_finished(only)
        out = self._others + self._done
        if only is None:
            self._done, self._others = [], []
            return out
        self._done = [o for o in self._done if o.index not in only]
        self._others = [o for o in self._others if o.index not in only]
        return [o for o in out if o.index in only]

    # ---- whole jobs -----------------------------------------------------------------------
    def stream(self, requests: Iterable[ImageRequest], max_in_flight: int = 256) -> Iterator[ImageOutput]:
        """Outputs as they finish (index = position in `requests`); new requests join between steps."""
        pending = iter(requests)
        index_of: dict[int, int] = {}
        exhausted = False
        n = 0
        while True:
            while not exhausted and len(self._trajs) < max_in_flight:
                req = next(pending, None)
                if req is None:
                    exhausted = True
                    break
                index_of[self.add_request(req)] = n
                n += 1
            if not self._trajs:
                return
            for out in self.step():
                if out.index not in index_of:  # added with add_request before this stream: kept for collect()
                    self._others.append(out)
                    continue
                out.index = index_of.pop(out.index)
                yield out
            if not index_of and exhausted:
                return

    def generate_outputs(self, requests: Sequence[ImageRequest]) -> list[ImageOutput]:
        outs: list[ImageOutput | None] = [None] * len(requests)
        for out in self.stream(requests):
            outs[out.index] = out
        return outs  # type: ignore[return-value]

    def generate(self, requests: Sequence[ImageRequest]) -> list[Any]:
        """-> one PIL image per request (a video's: its list of PIL frames), in input order; a bad
        request's slot holds a RequestError (its message names the field and the value) and the
        others go on."""
        return [o.result if o.error is None else RequestError(o.error) for o in self.generate_outputs(requests)]

    # ---- CoroutineEngine: the cluster runtime's face (cluster/runner.py) --------------------
    def run_step(self) -> list[int]:
        finished = self.step()
        self._finished.update((out.index, out) for out in finished)
        return [out.index for out in finished]

    def is_finished(self, tid: int) -> bool:
        return tid in self._finished

    def pop_output(self, tid: int) -> ImageOutput:
        return self._finished.pop(tid)

    def error_output(self, index: int, message: str) -> ImageOutput:
        return ImageOutput(index=index, error=message)

    def progress(self, tid: int) -> int:
        return self._trajs[tid].step

    def work_done(self) -> int:
        return self.work_units

    def load_report(self) -> LoadReport:
        """Work in image-token steps; no KV pool (a moved trajectory carries only its latents)."""
        remaining = {tid: t.remaining_steps * self._step_work(t) for tid, t in self._trajs.items()
                     if t.status in (Status.WAITING, Status.RUNNING)}
        waiting = sum(t.status is Status.WAITING for t in self._trajs.values())
        where = f"{torch.get_num_threads()} threads" if self.device == "cpu" else torch.cuda.get_device_name(self.device)
        return LoadReport(waiting, len(self._trajs) - waiting, 0.0, 0, self.max_batch_rows,
                          f"{self.device} {where} {str(self.pipe.transformer.dtype).removeprefix('torch.')}",
                          sum(remaining.values()), remaining)

    def close(self) -> None:
        """Nothing to release: the pipeline holds no threads or open files."""

    # ---- internals ------------------------------------------------------------------------
    def _step_work(self, t: Trajectory) -> int:
        return self.pipe.tokens(t.height, t.width, t.num_frames) * (2 if t.uses_guidance else 1)

    def _view(self, t: Trajectory) -> TrajView:
        arrival, deadline = self._meta[t.tid]
        tokens = self.pipe.tokens(t.height, t.width, t.num_frames)
        return TrajView(t.tid, t.group_key, tokens, 2 if t.uses_guidance else 1, t.remaining_steps, arrival, deadline)

    def _ensure_uncond(self) -> None:
        # the empty prompt, as PixArt's, SD3's and Wan's negative prompt defaults (Flux has no CFG here)
        if self.pipe.family in ("pixart", "sd3", "wan") and self._uncond is None:
            self._uncond = encode_prompts(self.pipe, [""])[0]

    def _admit(self) -> None:
        waiting = [t for t in self._trajs.values() if t.status is Status.WAITING]
        if not waiting:
            return
        pipe = self.pipe
        if pipe.family != "dit":
            self._ensure_uncond()
            encode_conditions(pipe, waiting)
        else:
            for t in waiting:
                t.cond = {"class_label": t.request.class_label}
        for t in waiting:
            if t.status is Status.FAILED:  # its prompt could not be encoded
                continue
            try:
                self._live[t.tid] = start(pipe, t, self.device)
            except ValueError as exc:  # e.g. more steps than the scheduler's num_train_timesteps
                t.error = f"num_inference_steps {t.request.num_inference_steps}: {exc}"
                t.move(Status.FAILED, "rejected at admission")
                continue
            t.move(Status.RUNNING, "admitted")

    def _decode_finished(self, only: Collection[int] | None = None) -> None:
        mine = [t for t in self._trajs.values() if only is None or t.tid in only]
        for t in [t for t in mine if t.status is Status.FAILED]:
            self._finish(t, ImageOutput(index=t.tid, error=t.error))
        ready = [t for t in mine if t.status is Status.DENOISED]
        by_shape: dict[tuple[int, ...], list[Trajectory]] = {}
        for t in ready:
            by_shape.setdefault(t.latent_shape, []).append(t)
        for group in by_shape.values():
            self._decode_group(group)

    def _decode_group(self, group: list[Trajectory]) -> None:
        """One VAE call for same-shape trajectories; one that raises is retried one by one."""
        try:
            images = decode(self.pipe, [t.latents for t in group])
        except Exception as exc:  # noqa: BLE001 - the request fails, the job goes on
            if len(group) == 1:
                self._finish(group[0], ImageOutput(index=group[0].tid, steps=group[0].step,
                                                   error=f"VAE decode failed: {type(exc).__name__}: {exc}"))
            else:
                for t in group:
                    self._decode_group([t])
            return
        for t, image in zip(group, images):
            if t.num_frames is not None:
                out = ImageOutput(index=t.tid, frames=[to_pil(f) for f in image], array=image, steps=t.step)
            else:
                out = ImageOutput(index=t.tid, image=to_pil(image), array=image, steps=t.step)
            self._finish(t, out)

    def _finish(self, t: Trajectory, out: ImageOutput) -> None:
        t.move(Status.FINISHED if out.error is None else Status.FAILED, "output ready")
        self._trajs.pop(t.tid)
        self._live.pop(t.tid, None)
        self._meta.pop(t.tid, None)
        self._done.append(out)
