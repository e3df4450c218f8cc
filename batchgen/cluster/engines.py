"""EngineSet: a host's engines, one EngineRunner per EngineSpec, started on first use and
stopped when idle (`release_idle`), with calls that survive a stop racing them (`call`)."""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from ..errors import BatchgenError
from .runner import Done, EngineRunner, RowRef, RunnerLoad
from .spec import EngineSpec
from .timeline import Timeline

T = TypeVar("T")
Failed = Callable[[EngineSpec, BaseException, list[RowRef]], None]


class EngineSet:
    def __init__(self, on_done: Done, on_fail: Failed, timeline: Timeline | None = None) -> None:
        """on_done(rows) gets every engine's finished rows; on_fail(spec, exc, rows) the rows of
        an engine that could not load or crashed; timeline: engine loads and tokens."""
        self._on_done, self._on_fail, self._timeline = on_done, on_fail, timeline
        self._runners: dict[EngineSpec, EngineRunner] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._refused: str | None = None  # why this host may start no engine (eligibility.py)

    def refuse(self, reason: str | None) -> None:
        """Start no engine from now on, failing each start with `reason` (None: allow again)."""
        with self._lock:
            self._refused = reason

    def get(self, spec: EngineSpec) -> EngineRunner:
        """The engine for `spec`, started on first use or after a failure or stop; BatchgenError
        once the set is closed."""
        with self._lock:
            runner = self._runners.get(spec)
            if runner is None or runner.failure is not None or runner.is_closed:
                if self._closed:
                    raise BatchgenError("this batchgen host is closed (worker plugin removed or worker closing)")
                if self._refused is not None:
                    raise BatchgenError(self._refused)
                runner = EngineRunner(spec, self._on_done, lambda exc, refs, s=spec: self._on_fail(s, exc, refs),
                                      self._timeline)
                self._runners[spec] = runner
            return runner

    def peek(self, spec: EngineSpec) -> EngineRunner | None:
        """The running engine for `spec`, if any (never starts one)."""
        with self._lock:
            runner = self._runners.get(spec)
        return runner if runner is not None and runner.failure is None else None

    def for_key(self, key: str) -> EngineRunner | None:
        with self._lock:
            return next((r for s, r in self._runners.items() if s.key == key), None)

    def live(self) -> list[EngineRunner]:
        with self._lock:
            return [r for r in self._runners.values() if r.failure is None]

    def specs(self) -> list[EngineSpec]:
        with self._lock:
            return list(self._runners)

    def loads(self) -> dict[str, RunnerLoad]:
        return {r.spec.key: r.load for r in self.live()}

    def call(self, spec: EngineSpec, send: Callable[[EngineRunner], Future[T]], tries: int = 3) -> Future[T]:
        """send(runner) to the engine for `spec` -> its result. A call refused because that
        engine was stopped meanwhile (`release_idle`: refused at once or, queued just behind the
        stop, when its loop exits) goes again to a fresh engine. Other errors, and a closed set,
        come back in the future."""
        result: Future[T] = Future()

        def attempt(left: int) -> None:
            try:
                runner = self.get(spec)
            except BatchgenError as exc:
                result.set_exception(exc)
                return

            def done(f: Future[T]) -> None:
                exc = f.exception()
                if exc is None:
                    result.set_result(f.result())
                elif runner.is_closed and runner.failure is None and left > 0:
                    attempt(left - 1)
                else:
                    result.set_exception(exc)
            send(runner).add_done_callback(done)

        attempt(tries)
        return result

    def release_idle(self, busy: set[EngineSpec], model: str | None = None, timeout: float = 10.0) -> int:
        """Stop the engines (of `model`, an EngineSpec key, or all) outside `busy` that hold no
        coroutine; -> how many stopped. The idle check runs on each engine's own thread, so
        nothing slips in between; one that does not answer within `timeout` (mid-step, still
        loading) counts as busy and its stop is withdrawn."""
        with self._lock:
            candidates = [(spec, r) for spec, r in self._runners.items()
                          if (model is None or spec.key == model) and spec not in busy]
        stopped = 0
        for spec, runner in candidates:
            if runner.failure is None and not runner.is_closed:
                stop = runner.close_if_idle()
                try:
                    idle = stop.result(timeout=timeout)
                except FutureTimeout:
                    idle = False if stop.cancel() else stop.result()
                except Exception:  # noqa: BLE001 - it failed or closed meanwhile: gone either way
                    idle = True
                if not idle:
                    continue
            with self._lock:
                if self._runners.get(spec) is runner:
                    del self._runners[spec]
            runner.close()
            stopped += 1
        if stopped:
            _free_cached_memory()
        return stopped

    def close(self) -> None:
        """Start no engine from now on (running ones keep serving their jobs)."""
        with self._lock:
            self._closed = True

    def stop_all(self) -> None:
        with self._lock:
            runners, self._runners = list(self._runners.values()), {}
        for runner in runners:
            runner.close()


def _free_cached_memory() -> None:
    """Hand stopped engines' memory back: to the allocator, and from torch's CUDA cache."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
