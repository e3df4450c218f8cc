"""Named mailboxes on a worker: messages between the parts of one job that run on several workers.

A job whose parts talk to each other (the elastic image loop: a worker that ran dry asks a
busy one for work; they agree on lockstep rounds) addresses a part by (worker address, box
name). A message for another worker travels as one worker-to-worker RPC (`batchgen_mail`, on
the worker's own connection pool), and lands in that worker's box; the part reads its own box
without a round trip. Nothing goes through the scheduler.
"""
from __future__ import annotations

import queue
import threading
from typing import Any


class Mailboxes:
    """Boxes by name, created on first use (a message may arrive before its reader starts)."""

    def __init__(self) -> None:
        self._boxes: dict[str, queue.SimpleQueue[Any]] = {}
        self._lock = threading.Lock()

    def box(self, name: str) -> queue.SimpleQueue[Any]:
        with self._lock:
            return self._boxes.setdefault(name, queue.SimpleQueue())

    def put(self, name: str, msg: Any) -> None:
        self.box(name).put(msg)

    def take(self, name: str, timeout: float = 0.0) -> Any | None:
        """The oldest message, or None when the box stays empty for `timeout` seconds."""
        try:
            box = self.box(name)
            return box.get(timeout=timeout) if timeout > 0 else box.get_nowait()
        except queue.Empty:
            return None

    def take_all(self, name: str) -> list[Any]:
        out = []
        while (msg := self.take(name)) is not None:
            out.append(msg)
        return out

    def drop(self, name: str) -> None:
        """Forget a box (its job ended here); later messages for it start a new one."""
        with self._lock:
            self._boxes.pop(name, None)
